"""The saga driver: the next append for the operation in flight. Pure.

    append = drive(view, view.operation, facts)   # start its next step, re-start a step whose runner
                                                  # died, move a cascade on, or finish it (None: wait)

It reads the tables (haru.core.saga): a step's outcome and `TRANSITIONS` name what follows. A started
step with no outcome is re-started when its lease ran out (`lease_ms`), when its runner was this
promoter before a restart, or when its runner fell silent on haru.alive (`runner_gone`). A cascading
promotion whose target failed before the flip moves on to the next fit standby (`cascade`). The shell
(haru.promoter.service) asks here for what a step sends (`command_for`), how its replies read
(`step_outcome`), whether a best-effort step applies at all (`not_applicable`) and whether the route
may move (`flip_refusal`).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from haru.core import causes, ranking, subjects
from haru.core.commands import Command, Reply
from haru.core.events import (
    EligibilityChanged,
    OperationAborted,
    OperationCompleted,
    PromotionRetargeted,
    RouteMoved,
    StepCompleted,
    StepFailed,
    StepStarted,
)
from haru.core.saga import (
    ABORT,
    COMPLETE,
    KINDS,
    STEPS,
    TORN_DOWN,
    TRANSITIONS,
    flow,
    last_step,
    lease_ms,
    step_record,
    steps_of,
    verb_timeout_ms,
)
from haru.core.views import DomainView, FleetView, OperationView, StepView
from haru.promoter import canary
from haru.promoter.decisions import Append, Facts
from haru.promoter.health import active_health


def probed(op: OperationView) -> bool:
    """Whether this operation completed the probe step (the flip's precondition)."""
    sv = step_record(op, "probe")
    return sv is not None and sv.state == "completed"


def other_domain(view: FleetView, op: OperationView) -> str:
    """The domain a step `on="other"` acts on: the old active of a promotion (its `source`, else the
    active when that is not the target; '' if none)."""
    if op.source and op.source != op.target:
        return op.source
    if view.active and view.active != op.target:
        return view.active
    for name in view.domains:
        if name != op.target:
            return name
    return ""


def step_domain(view: FleetView, op: OperationView, step: str) -> str:
    on = STEPS[step].on
    if on == "target":
        return op.target
    if on == "other":
        return other_domain(view, op)
    return ""


def not_applicable(view: FleetView, op: OperationView, step: str) -> str:
    """Why a best-effort step does not apply, when the reason is known ('' = it applies, or it is not
    best effort): the domain it acts on is unreachable or has a GPU gone, typically the very reason
    for the failover. Recorded as skipped with this reason, never as a failure."""
    spec = STEPS.get(step)
    if op.kind == "weighting" and step != "weigh" and op.target == view.active:
        return "skipped: the split gives no domain a new share, so there is nothing to wake or probe"
    if spec is None or spec.fatal or spec.on in ("route", "weights"):
        return ""
    domain = step_domain(view, op, step)
    dv = view.domains.get(domain) if domain else None
    if dv is None:
        return ""
    cause = (
        " (the reason for this operation)"
        if op.source == domain and op.reason in ("gpu_detached", "domain_unreachable")
        else ""
    )
    if dv.reachable is False:
        return f"skipped: {domain} is unreachable{cause}, so it cannot be put to sleep or given training"
    for gpu in dv.gpus:
        if gpu.present is False:
            return (
                f"skipped: GPU {gpu.index} of {domain} is gone{cause}, so it cannot be put to sleep or given training"
            )
    return ""


def drive(view: FleetView, op: OperationView, facts: Facts) -> Append | None:
    """The next append for the operation in flight (None: wait, a step is running)."""
    fleet = view.fleet
    op_subject = subjects.op(fleet)
    if op.kind not in KINDS:
        return None  # a kind this promoter does not know (a newer one's): that promoter drives it
    cur = last_step(op)
    if cur is None:
        first = TRANSITIONS[(op.kind, None, "requested")]
        # A cascading promotion that just moved on starts afresh on its new target; the attempt number
        # stays above the one of the step that failed on the old target, so the two never share a key.
        prior = op.tried[-1] if op.tried else None
        attempt = prior.attempt + 1 if prior is not None and prior.step == first else 1
        return _start(op_subject, op, first, attempt, facts)
    if cur.step not in steps_of(op.kind):
        # Only a writer of the op subject could have recorded it (the promoter, the gateway, the
        # operator): a step this kind of operation does not have is not run, and does not wedge
        # the fleet either (every later decision would fail on the missing transition).
        return Append(
            subject=op_subject,
            event=OperationAborted(
                at=facts.now, op_id=op.op_id, step=cur.step, error=f"{cur.step} is not a step of a {op.kind}"
            ),
            why="a step that does not belong to this operation was recorded",
        )
    spec = KINDS[op.kind]
    if (
        spec.yields_to_failover
        and view.policy.auto_failover
        and not any(s.step == spec.no_abort_from for s in op.steps)
    ):
        health = active_health(view, facts.now)
        if health.health == "failed":
            return Append(
                subject=op_subject,
                event=OperationAborted(
                    at=facts.now,
                    op_id=op.op_id,
                    step=cur.step,
                    error=f"the active failed ({health.why}): abandoned so that failover can go on",
                ),
                why="auto-failover goes before a rolling change",
            )
    if cur.state == "started":
        return _resume(view, op, cur, facts)
    # A skipped step (best effort, not applicable: `not_applicable`) is followed as a completed one.
    nxt = TRANSITIONS[(op.kind, cur.step, "completed" if cur.state == "skipped" else cur.state)]
    if nxt == ABORT:
        error = cur.error or cur.error_code or "failed"
        onward = cascade(view, op, cur, facts)
        if onward is not None:
            return onward
        if op.tried:
            error = f"{error} (after {', '.join(t.target for t in op.tried)} failed too)"
        return Append(
            subject=op_subject,
            event=OperationAborted(at=facts.now, op_id=op.op_id, step=cur.step, error=error),
            why=f"{cur.step} failed before the flip: routing does not move",
        )
    if nxt == COMPLETE:
        return _finish(view, op, facts)
    if nxt == "flip":
        refusal = flip_refusal(view, op)
        if refusal:
            return Append(
                subject=op_subject,
                event=OperationAborted(at=facts.now, op_id=op.op_id, step="flip", error=refusal),
                why="the flip's precondition does not hold",
            )
    return _start(op_subject, op, nxt, 1, facts)


def cascade(view: FleetView, op: OperationView, cur: StepView, facts: Facts) -> Append | None:
    """A cascading promotion (`cascade`: auto-failover, `haru promote` without a target) whose target
    failed a step before the flip moves on to the next fit standby in the ranking
    (`haru.core.ranking`), in the same operation; None when it is not one, or no fit standby is left
    (the operation then aborts, naming every standby it tried)."""
    if op.kind != "promotion" or not op.cascade or cur.state != "failed" or STEPS[cur.step].on != "target":
        return None
    tried = frozenset({op.target, op.source, *(t.target for t in op.tried)})
    onward = ranking.first_fit(view, excluding=tried)
    if not onward:
        return None
    error = cur.error or cur.error_code or "failed"
    return Append(
        subject=subjects.op(view.fleet),
        event=PromotionRetargeted(
            at=facts.now, op_id=op.op_id, target=onward, previous=op.target, step=cur.step, error=error
        ),
        why=f"{op.target} failed {cur.step} before the flip ({error}): the next fit standby, {onward}, takes over",
    )


def _start(subject: str, op: OperationView, step: str, attempt: int, facts: Facts) -> Append:
    return Append(
        subject=subject,
        event=StepStarted(at=facts.now, op_id=op.op_id, step=step, attempt=attempt),  # type: ignore[arg-type]
        why=STEPS[step].what,
    )


def _resume(view: FleetView, op: OperationView, cur: StepView, facts: Facts) -> Append | None:
    """A started step with no outcome: someone runs it, or its runner died."""
    if (op.op_id, cur.step, cur.attempt) in facts.running:
        return None
    if cur.step == "flip" and view.route_revision != op.route_revision:
        # The runner died between route_moved and step_completed: read the outcome from the route.
        if view.active == op.target:
            return Append(
                subject=subjects.op(view.fleet),
                event=StepCompleted(
                    at=facts.now,
                    op_id=op.op_id,
                    step="flip",
                    detail=f"route moved to {op.target} (revision {view.route_revision})",
                ),
                why="the route already points at the target",
            )
        return Append(
            subject=subjects.op(view.fleet),
            event=StepFailed(
                at=facts.now,
                op_id=op.op_id,
                step="flip",
                error_code="route_moved_elsewhere",
                error=f"the route moved to {view.active or 'nowhere'} (revision {view.route_revision}) since "
                f"revision {op.route_revision} this operation was decided against",
            ),
            why="another writer moved the route",
        )
    mine_before_restart = bool(facts.me) and facts.step_by == facts.me
    started = cur.at
    expired = started is None or facts.now - started >= timedelta(milliseconds=lease_ms(cur.step, view.policy))
    if mine_before_restart or expired or runner_gone(facts):
        return _start(subjects.op(view.fleet), op, cur.step, cur.attempt + 1, facts)
    return None


def runner_gone(facts: Facts) -> bool:
    """Whether the promoter running the started step is dead by its silence on haru.alive: not heard
    for `runner_timeout_ms`, or never heard since we have listened that long."""
    timeout = facts.runner_timeout_ms
    if not timeout or not facts.step_by or facts.step_by == facts.me:
        return False
    if facts.runner_silent_ms is None:
        return facts.listening_ms >= timeout
    return facts.runner_silent_ms >= timeout


def flip_event(view: FleetView, op: OperationView, by: str, now: datetime) -> RouteMoved:
    """The flip's `route_moved`: onto the operation's target, off the view's active, saying whether
    the promoter had judged that one unreachable (a router fails its requests in flight there)."""
    old = view.domains.get(view.active) if view.active else None
    return RouteMoved(
        at=now,
        by=by,
        active=op.target,
        previous=view.active,
        op_id=op.op_id,
        cause=causes.flip_cause(op),
        previous_silent=old is not None and old.reachable is False,
    )


def flip_refusal(view: FleetView, op: OperationView) -> str:
    """Why the pointer must not move to the target now ('' = it may). The decider asks before it
    starts the flip, and the promoter asks again before it appends `route_moved`: a `step_started`
    for the flip that someone else recorded is not a probe."""
    if "flip" not in flow(op.kind):
        return f"a {op.kind} never moves the route"
    if not probed(op):
        return f"{op.target}'s models were not probed in this operation"
    target = view.domains.get(op.target)
    if target is None:
        return f"domain {op.target} is no longer declared"
    if target.reachable is False:
        return f"{op.target} became unreachable after its probe"
    return ""


def _finish(view: FleetView, op: OperationView, facts: Facts) -> Append:
    """The tail of an operation: eligibility, then operation_completed."""
    subject = subjects.op(view.fleet)
    if "flip" in flow(op.kind):  # the route moved to the target: the target serves, the other is the standby
        target = view.domains.get(op.target)
        if target is not None and not target.eligible:
            return Append(
                subject=subject,
                event=EligibilityChanged(
                    at=facts.now, domain=op.target, eligible=True, why="promoted: probed and serving"
                ),
                why="a domain that was probed and now serves is healthy",
            )
        old = other_domain(view, op)
        dv = view.domains.get(old) if old else None
        if dv is not None and dv.eligible:
            why = _unfit_as_standby(view, dv, step_record(op, "settle_old_active"), step_record(op, "apply_old_active"))
            if why:
                return Append(
                    subject=subject,
                    event=EligibilityChanged(at=facts.now, domain=old, eligible=False, why=why),
                    why="the old active cannot be a standby",
                )
    elif op.kind == "weighting":
        if not canary.applied(view, op):
            return canary.weights_set(view, op, facts.now)
    elif op.kind == "teardown":
        dv = view.domains.get(op.target)
        if dv is not None and dv.eligible:
            return Append(
                subject=subject,
                event=EligibilityChanged(at=facts.now, domain=op.target, eligible=False, why=TORN_DOWN),
                why="a domain with no host cannot be the standby",
            )
    else:
        dv = view.domains.get(op.target)
        if dv is not None and not dv.eligible:
            return Append(
                subject=subject,
                event=EligibilityChanged(
                    at=facts.now, domain=op.target, eligible=True, why="recovered: asleep with training started"
                ),
                why="the recovered domain is a standby again",
            )
    return Append(subject=subject, event=OperationCompleted(at=facts.now, op_id=op.op_id), why="every step done")


def _unfit_as_standby(view: FleetView, dv: DomainView, settle: StepView | None, applied: StepView | None = None) -> str:
    if dv.reachable is False:
        return f"agent of {dv.name} unreachable"
    if dv.signalled:
        return f"{dv.name} is about to go ({dv.signalled})"
    for gpu in dv.gpus:
        if gpu.present is False:
            return f"GPU {gpu.index} of {dv.name} detached"
    if applied is not None and applied.state == "failed":
        return f"could not apply the layout change: {applied.error or applied.error_code}"
    if settle is not None and settle.state == "failed":
        return f"could not be put to sleep and given training: {settle.error or settle.error_code}"
    return ""


def command_for(view: FleetView, op: OperationView, step: str) -> tuple[str, list[tuple[str, Command, int]]]:
    """The domain a step acts on and the commands to send it: [(verb, command, timeout_ms)]."""
    domain = step_domain(view, op, step)
    # The route revision the step is decided against: after the flip, the new one, so the old
    # active's agent learns it is now the standby before it is told to train.
    cmd = Command(op_id=op.op_id, route_revision=max(op.route_revision, view.route_revision), decl_seq=op.decl_seq)
    return domain, [(verb, cmd, verb_timeout_ms(verb, view.policy)) for verb in STEPS[step].verbs]


def step_outcome(
    op: OperationView, step: str, replies: list[tuple[str, Reply]], *, now: datetime, took_ms: int, wall_ms: int = 0
) -> StepCompleted | StepFailed:
    """The record of a step from its agents' replies (stops at the first reply that is not ok)."""
    details: list[str] = []
    for verb, reply in replies:
        if not reply.ok:
            code = reply.error.code if reply.error else "command_failed"
            message = reply.error.message if reply.error else (reply.detail or f"{verb} failed")
            return StepFailed(
                at=now,
                op_id=op.op_id,
                step=step,  # type: ignore[arg-type]
                error_code=code,
                error=f"{verb}: {message}",
                took_ms=took_ms,
            )
        if reply.detail:
            details.append(reply.detail if len(replies) == 1 else f"{verb}: {reply.detail}")
    return StepCompleted(
        at=now,
        op_id=op.op_id,
        step=step,  # type: ignore[arg-type]
        detail="; ".join(details),
        took_ms=took_ms,
        wall_ms=wall_ms,
    )
