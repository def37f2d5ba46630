"""The step runners: what executes a started step and returns its outcome event.

`STEPS[step].run` (haru.core.saga) names the runner; `StepRunners.table()` maps each name to its
coroutine, (fleet state, operation, step, seq of its step_started) -> `step_completed`/`step_failed`:

    agent    the step's verbs, in order, to the domain it acts on, over request/reply
    flip     `route_moved` on the route subject: the one compare-and-swap that moves traffic
    canary   a rolling change's canary share, held for rolling_canary_ms
    weigh    whether every domain a split gives a share serves (haru.promoter.canary)
    launch   the target's cluster or service (haru.promoter.provisioning)
    join     until the launched host's agent started, is heard, and has its models loaded
    down     every cluster or service of the target torn down

A new kind of step work registers its runner in `table()` under a new name.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta

import msgspec
import structlog

from haru.core import subjects
from haru.core.authority import misplaced
from haru.core.commands import ErrorInfo, Reply
from haru.core.errors import CommandError, Conflict, LogError
from haru.core.events import RouteMoved, StepCompleted, StepFailed, WeightsSet
from haru.core.residency import Resident, Sleeping
from haru.core.saga import TRANSITIONS, step_record
from haru.core.views import FleetView, OperationView
from haru.core.weights import describe, scope_of
from haru.log.bus import send
from haru.log.seam import Log
from haru.promoter.canary import weigh_refusal
from haru.promoter.drive import command_for, flip_event, flip_refusal, step_outcome
from haru.promoter.fleets import FleetState, StepRunner, utcnow
from haru.promoter.provisioning import Provisioning


async def weigh_step(st: FleetState, op: OperationView, step: str, started_seq: int) -> StepCompleted | StepFailed:
    """Runner `weigh`: the split may start when every domain it gives a share serves (haru.promoter.canary)."""
    refusal = weigh_refusal(st.view, op)
    if refusal:
        return StepFailed(at=utcnow(), op_id=op.op_id, step="weigh", error_code="weights_refused", error=refusal)
    return StepCompleted(
        at=utcnow(),
        op_id=op.op_id,
        step="weigh",
        detail=f"{describe(op.weights, st.view.active)} for {scope_of(op.model)}: every domain with a share serves",
    )


async def join_step(st: FleetState, op: OperationView, step: str, started_seq: int) -> StepCompleted | StepFailed:
    """Runner `join`: until the target's agent started after the operation was requested, is heard, and
    has every served model loaded (resident, or asleep); bounded by the policy's join_timeout_ms."""
    t0 = time.monotonic()
    bound_s = st.view.policy.join_timeout_ms / 1000
    while True:
        why = join_pending(st.view, op)
        if not why:
            dv = st.view.domains[op.target]
            return StepCompleted(
                at=utcnow(),
                op_id=op.op_id,
                step=step,  # type: ignore[arg-type]
                detail=f"agent {dv.agent.host or '?'} (pid {dv.agent.pid}) joined with "
                f"{len(dv.models)} model(s) loaded after {time.monotonic() - t0:.1f} s",
            )
        if time.monotonic() - t0 >= bound_s:
            return StepFailed(
                at=utcnow(),
                op_id=op.op_id,
                step=step,  # type: ignore[arg-type]
                error_code="join_timeout",
                error=f"{why} after join_timeout_ms ({st.view.policy.join_timeout_ms} ms)",
            )
        # polled: the view is folded by the follower; the main loop's wake-up event is not ours to clear
        await asyncio.sleep(min(0.2, max(0.01, bound_s - (time.monotonic() - t0))))


# An agent's `agent_started` carries its host's clock, the request the control plane's: a launched
# host's clock a little behind must not keep its agent from counting as started since the request.
JOIN_CLOCK_SKEW = timedelta(seconds=60)


def join_pending(view: FleetView, op: OperationView) -> str:
    """Why the launched host has not joined yet ('' = it has): its agent, heard, with its models loaded."""
    dv = view.domains.get(op.target)
    if dv is None:
        return f"domain {op.target} is no longer declared"
    started = dv.agent.since
    if (
        not dv.agent.running
        or started is None
        or (op.requested_at is not None and started < op.requested_at - JOIN_CLOCK_SKEW)
    ):
        return f"no agent of {op.target} has started since the operation was requested"
    if dv.reachable is not True:
        return f"the agent of {op.target} is not heard yet"
    waiting = [
        name
        for name, mv in dv.models.items()
        if mv.admitted is not False and not isinstance(mv.residency, (Resident, Sleeping))
    ]
    if waiting:
        return f"{len(waiting)} model(s) of {op.target} not loaded yet ({', '.join(waiting[:3])})"
    return ""


class StepRunners:
    """The runners of one promoter replica: its log, its writer id, its provisioner."""

    def __init__(
        self,
        log: Log,
        *,
        identity: str,
        provisioning: Provisioning,
        wait_folded: Callable[[int], Awaitable[None]],
        logger: structlog.typing.FilteringBoundLogger,
    ) -> None:
        self.log = log
        self.identity = identity
        self.provisioning = provisioning
        self.wait_folded = wait_folded
        self.logger = logger
        # Sequences of the probe completions this process appended itself. The op subject also takes
        # the gateway's and the operator's requests, so a `step_completed` for a probe there may be
        # theirs: the flip trusts only a probe in this set, and probes again otherwise.
        self.own_probes: set[int] = set()
        # op_id -> (seq, previous active) of a route move this process appended in the batch that started
        # the operation's flip (haru.promoter.chain): the flip runner completes the step with it.
        self.own_moves: dict[str, tuple[int, str]] = {}
        # op_id -> the verify_gpu reply the agent answered with its stop_training (`then_verify`): the verify_gpu
        # step that follows is recorded from it when chained in the same batch (haru.promoter.chain)
        self.verdicts: dict[str, Reply] = {}

    def table(self) -> dict[str, StepRunner]:
        """`STEPS[step].run` -> the coroutine that executes such a step and returns its outcome event."""
        return {
            "agent": self.agent,
            "flip": self.flip,
            "launch": self.launch,
            "join": join_step,
            "down": self.down,
            "weigh": weigh_step,
            "canary": self.canary,
        }

    async def agent(self, st: FleetState, op: OperationView, step: str, started_seq: int) -> StepCompleted | StepFailed:
        """Runner `agent`: the step's verbs, in order, to the domain it acts on; stops at the first not ok."""
        t0 = time.monotonic()
        fleet = st.view.fleet
        domain, commands = command_for(st.view, op, step)
        if not domain:
            return StepCompleted(at=utcnow(), op_id=op.op_id, step=step, detail="no other domain")  # type: ignore[arg-type]
        replies: list[tuple[str, Reply]] = []
        # stop_training followed by verify_gpu: the agent reads the GPUs as training stops, in the same trip
        then_verify = step == "stop_training" and TRANSITIONS.get((op.kind, step, "completed")) == "verify_gpu"
        for verb, command, timeout_ms in commands:
            command = msgspec.structs.replace(
                command, step=step, cause=started_seq, then_verify=then_verify and verb == "stop_training"
            )
            try:
                reply = await send(self.log.bus, fleet, domain, verb, command, timeout=timeout_ms / 1000)
            except CommandError as exc:
                reply = Reply(ok=False, error=ErrorInfo(code=exc.code, message=str(exc)))
            replies.append((verb, reply))
            if not reply.ok:
                break
        # took_ms is the agents' own measure of the work (their replies' took_ms); the
        # promoter's wall time is in the step's started/completed `at`s.
        agent_ms = sum(r.took_ms for _, r in replies)
        wall_ms = int((time.monotonic() - t0) * 1000)
        verified = next((r.data.get("verify_gpu") for v, r in replies if v == "stop_training" and r.ok), None)
        if then_verify and isinstance(verified, dict):
            try:
                self.verdicts[op.op_id] = msgspec.convert(verified, Reply)
            except msgspec.ValidationError as exc:  # an agent's answer we cannot read: verify_gpu asks again
                self.logger.warning("verify_gpu_unreadable", op_id=op.op_id, error=str(exc))
        return step_outcome(op, step, replies, now=utcnow(), took_ms=agent_ms or wall_ms, wall_ms=wall_ms)

    async def canary(
        self, st: FleetState, op: OperationView, step: str, started_seq: int
    ) -> StepCompleted | StepFailed:
        """Runner `canary` (a rolling change, before its flip): the standby takes policy rolling_canary_weight
        percent of the fleet's traffic for rolling_canary_ms; the decider's rollback (haru.promoter.canary)
        taking it back fails the step, so the change aborts with routing unmoved."""
        view = st.view
        share, hold_ms = view.policy.rolling_canary_weight, view.policy.rolling_canary_ms
        if share <= 0 or not view.active or view.active == op.target:
            return StepCompleted(
                at=utcnow(), op_id=op.op_id, step="canary", detail="no canary step (policy rolling_canary_weight is 0)"
            )
        split = {view.active: 100 - share, op.target: share}
        subject = subjects.weights(view.fleet)
        event = WeightsSet(
            at=utcnow(),
            by=self.identity,
            weights=split,
            reason="rolling",
            op_id=op.op_id,
            route_revision=view.route_revision,
            detail=f"rolling change {op.op_id}: {op.target} takes {share}% for {hold_ms} ms before the flip",
        )
        try:
            set_seq = await self.log.append(subject, event, expect=st.last.get(subject, 0))
        except (Conflict, LogError) as exc:
            return StepFailed(
                at=utcnow(),
                op_id=op.op_id,
                step="canary",
                error_code="weights_unset",
                error=f"could not give {op.target} its canary share: {exc}",
            )
        await self.wait_folded(set_seq)
        deadline = time.monotonic() + hold_ms / 1000
        while time.monotonic() < deadline:
            change = st.view.weights_change
            if change is not None and change.seq > set_seq and change.reason == "canary_rolled_back":
                return StepFailed(
                    at=utcnow(), op_id=op.op_id, step="canary", error_code="canary_rolled_back", error=change.detail
                )
            if st.view.route_revision != view.route_revision:
                return StepFailed(
                    at=utcnow(),
                    op_id=op.op_id,
                    step="canary",
                    error_code="route_moved_elsewhere",
                    error=f"the route moved to {st.view.active} during the canary",
                )
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        tallied = st.canary_window().get(op.target, {})
        requests = sum(t.requests for t in tallied.values())
        errors = sum(t.errors for t in tallied.values())
        return StepCompleted(
            at=utcnow(),
            op_id=op.op_id,
            step="canary",
            detail=f"{op.target} took {share}% of the traffic for {hold_ms} ms: {requests} requests, "
            f"{errors} errors reported by the gateways; the flip follows",
        )

    async def launch(
        self, st: FleetState, op: OperationView, step: str, started_seq: int
    ) -> StepCompleted | StepFailed:
        """Runner `launch`: the target's cluster or service, found when it is already up
        (haru.promoter.provisioning)."""
        return await self.provisioning.launch(st.view.fleet, st.specs.get(op.target), op, step)

    async def down(self, st: FleetState, op: OperationView, step: str, started_seq: int) -> StepCompleted | StepFailed:
        """Runner `down`: every cluster or service of the target, with what each cost."""
        return await self.provisioning.down(st.view.fleet, st.specs.get(op.target), op, step)

    async def flip(self, st: FleetState, op: OperationView, step: str, started_seq: int) -> StepCompleted | StepFailed:
        """Runner `flip`: the route's compare-and-swap, unless the flip's precondition does not hold."""
        made = self.own_moves.pop(op.op_id, None)
        if made is not None:  # moved in the batch that started this step, on the checks made then
            seq, previous = made
            return StepCompleted(
                at=utcnow(),
                op_id=op.op_id,
                step="flip",
                detail=f"route revision {seq}: {previous or '(none)'} -> {op.target} (with the flip's start)",
            )
        refusal = flip_refusal(st.view, op)
        if refusal:  # a flip started by someone else, before the probe: never moves the route
            return StepFailed(at=utcnow(), op_id=op.op_id, step="flip", error_code="flip_refused", error=refusal)
        probe = step_record(op, "probe")
        if probe is None or probe.seq not in self.own_probes:
            # The probe's completion is not one this process appended: a promoter restarted since
            # (SIGKILL, a replica taking over), or a record someone else wrote on the op subject. The
            # route only moves to a domain this process has probed, so: probe again, now.
            again = await self.agent(st, op, "probe", started_seq)
            if isinstance(again, StepFailed):
                return StepFailed(
                    at=utcnow(),
                    op_id=op.op_id,
                    step="flip",
                    error_code=again.error_code,
                    error=f"probed again before the flip (the probe's completion at seq "
                    f"{probe.seq if probe else 0} was not appended by this promoter) and it "
                    f"failed: {again.error}",
                )
            self.logger.info(
                "probed_again_before_flip",
                fleet=st.view.fleet,
                op_id=op.op_id,
                probe_seq=probe.seq if probe else 0,
                detail=again.detail,
            )
        return await self._move_route(st, op)

    async def _move_route(self, st: FleetState, op: OperationView) -> StepCompleted | StepFailed:
        """The one compare-and-swap that moves traffic: `route_moved` on the route subject.

        The operation was decided against `op.route_revision`, the sequence of the last route move
        the fold applied, which only a `route_moved` on the route subject can be
        (`haru.core.authority`). If the view has applied a move since, the flip fails at once. The
        append's `expect` is the route subject's REAL last sequence as followed (`st.last`): the
        same number, unless something that is not a route move was stored there (a body that does
        not decode, a misplaced event), which must not make every future flip abort. On Conflict the
        route subject is re-read from there: a route move by someone else fails the flip (routing
        stays as it is), our own stored move is success, anything else is stepped over.
        """
        fleet = st.view.fleet
        route = subjects.route(fleet)
        previous = st.view.active
        if st.view.route_revision != op.route_revision:
            return _moved_elsewhere(op, st.view.active, st.view.route_revision)
        expect = max(st.last.get(route, 0), op.route_revision)
        moved = flip_event(st.view, op, self.identity, utcnow())
        for _ in range(FLIP_TRIES):
            try:
                seq = await self.log.append(route, moved, expect=expect)
                break
            except Conflict as exc:
                since = await self.log.history(route, from_seq=expect + 1)
                moves = [r for r in since if isinstance(r.event, RouteMoved) and not misplaced(r.subject, r.event)]
                if moves:
                    last = moves[-1]
                    ev = last.event
                    assert isinstance(ev, RouteMoved)
                    if ev.op_id == op.op_id and ev.active == op.target:
                        seq = last.seq
                        break
                    return _moved_elsewhere(op, ev.active, last.seq)
                skipped = since[-1].seq if since else (exc.current or expect)
                self.logger.warning(
                    "flip_steps_over",
                    fleet=fleet,
                    op_id=op.op_id,
                    expected=expect,
                    now=skipped,
                    detail="the route subject holds something that is not a route move; expecting past it",
                )
                expect = skipped
        else:
            return StepFailed(
                at=utcnow(),
                op_id=op.op_id,
                step="flip",
                error_code="route_unsettled",
                error=f"the route subject of {fleet} kept changing without a route move ({FLIP_TRIES} tries); "
                f"routing left as it is",
            )
        return StepCompleted(
            at=utcnow(),
            op_id=op.op_id,
            step="flip",
            detail=f"route revision {seq}: {previous or '(none)'} -> {op.target}",
        )


FLIP_TRIES = 5


def _moved_elsewhere(op: OperationView, active: str, revision: int) -> StepFailed:
    return StepFailed(
        at=utcnow(),
        op_id=op.op_id,
        step="flip",
        error_code="route_moved_elsewhere",
        error=f"the route moved to {active or 'nowhere'} (revision {revision}) since revision {op.route_revision}, "
        f"which this operation was decided against; routing left as it is",
    )
