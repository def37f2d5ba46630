"""Holding requests through a failover, so that clients do not see it (docs/gateway.md).

While a fleet's active domain is unfit and a failover is under way, or about to start (auto-failover
on and an eligible standby), a request the gateway would refuse (`model_lost`, `gpu_detached`, a
warming or asleep model while a promotion runs) or could not deliver (the domain refused or reset
the connection, or its serving port said the runtime is gone) waits here for the route to move,
and is then sent to the new active. Nothing here runs for a request that is forwarded at once: the
proxy's hot path only calls in when it already has an error to give.

    plan = hold_plan(routes, code, unreachable=False)   # pure: hold? how long at most? why?
    outcome = await holds.hold(fleet, model, size, plan, accept)   # Forward, or the answer to give

Bounds, all from the fleet's policy (haru/core/specs.py):

    hold_ms            how long a request waits; 0 = the standby's measured wake and probe (the last
                       `model_resident` after `model_waking`, haru/core/fold.py) plus, when the active's
                       silence has yet to be noticed, the heartbeat timeout, plus a margin
    hold_max_ms        the ceiling of that (0 = never hold); unmeasured wake times take the ceiling
    hold_max_requests  requests held per fleet on this gateway at once; beyond it, answered at once
    hold_max_bytes     their bodies' bytes, the same way

"About to start" follows the promoter's own rule: a GPU gone or a `gpu_detached` loss fails the
active at once, and so does a cold-reload loss (`process_exited`, `evicted`, `unhealthy`) when the
standby's wake (measured, else the promoter's estimate) beats the active's measured warm-up (the faster
path). When instead the active's own cold reload is the quicker one (its warm-up measured, plus the
restart backoff and a margin, within `hold_max_ms`), a request for a model it lost waits for the model
to be resident there again: the same domain, no route move. Any other loss the promoter waits out
(`degraded_grace_ms`) is answered at once, as before: holding it would only delay the 503.

A request that died on an active the view calls unreachable (its heartbeats went silent: the proxy
failed it as stranded, gateway/stranded.py) with no failover coming waits for that active to be heard
again, within `hold_max_ms`: silence may be a cut NATS link or a loaded host while serving goes on.

An estimate counts the standby's wake and probe, not the log: where the lost domain's region held the
JetStream leaders, the promoter's writes wait for an election first. So a hold whose estimated time is
up waits on, a second at a time up to `hold_max_ms`, while its failover is still coming and a promoter
is heard on the bus (`haru.alive.promoter.*`) to drive it (`goes_on`); a `hold_ms` the operator set is
kept as set.

A held request leaves with today's diagnostic answer when its time is up, or at once when the hold
no longer applies (the promotion aborted and no other is coming). A client that disconnects cancels
its handler (the server runs with handler_cancellation), which drops the held request at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Final

import msgspec

from haru.core.residency import Loading, Lost, Resident, Sleeping, Waking
from haru.core.standby import reload_ms, standby_serves_in
from haru.core.views import FleetView
from haru.gateway.metrics import GatewayMetrics
from haru.gateway.routing import FleetRoutes, Forward, Refusal, RoutingTable

# Refusals a failover cures. `model_warming` / `model_asleep` only while a promotion is under way:
# a cold reload with nothing coming to replace it is answered at once, as before.
_CURED_BY_FAILOVER: Final = frozenset({"model_lost", "gpu_detached", "upstream_unreachable", "no_serving_url"})
_CURED_BY_PROMOTION: Final = _CURED_BY_FAILOVER | frozenset({"model_warming", "model_asleep", "residency_unknown"})
# Refusals the active cures by itself, when it reloads a lost model sooner than the standby would serve.
_CURED_IN_PLACE: Final = frozenset({"model_lost", "model_warming"})
_MOVING_KINDS: Final = frozenset({"promotion", "rolling"})
_READY_TO_PROMOTE = (Sleeping, Resident, Waking)
MARGIN_MS: Final = 1_000  # the flip and the route reaching this gateway, beyond wake and probe
WAIT_ON_S: Final = 1.0  # past its estimate, a hold looks again this often whether its failover is still coming


class HoldPlan(msgspec.Struct, frozen=True):
    """Hold for at most `budget_ms`: `why` says what the request waits for. `target`: the domain a failover
    (under way, or about to start) moves the route to; `estimated`: `budget_ms` is Haru's estimate of that
    failover (`hold_ms` 0), not a wait the operator set."""

    budget_ms: int
    why: str
    target: str = ""
    estimated: bool = False


def _under_way(view: FleetView, active: str) -> str:
    op = view.operation
    if op is None or op.state != "running" or op.kind not in _MOVING_KINDS or op.target == active:
        return ""
    return op.target


def _standby_ready(view: FleetView, active: str) -> str:
    """The standby an automatic failover would promote ('' when there is none fit to)."""
    for name, dv in view.domains.items():
        if name == active or not dv.eligible or dv.reachable is not True:
            continue
        if any(gpu.present is False for gpu in dv.gpus):
            continue
        served = [m for m, mv in dv.models.items() if mv.admitted is not False]
        if served and all(isinstance(dv.models[m].residency, _READY_TO_PROMOTE) for m in served):
            return name
    return ""


_COLD_RELOAD: Final = frozenset({"process_exited", "evicted", "unhealthy"})


def _fails_now(view: FleetView, active: str, target: str) -> bool:
    """Whether the promoter fails the active at once for what its models show (the decider's rule,
    haru/promoter/health.py `active_health` and `faster_path`): a GPU gone, a `gpu_detached` loss, or a
    cold-reload loss that the standby's wake (measured, else estimated as the promoter estimates it)
    beats the active's reload (its restart backoff and measured warm-up, `reload_ms`)."""
    dv = view.domains.get(active)
    sb = view.domains.get(target)
    if dv is None or sb is None:
        return False
    if any(gpu.present is False for gpu in dv.gpus):
        return True
    wanted = [m for m in dv.models if m in sb.models and dv.models[m].admitted is not False]
    wake = standby_serves_in(view, sb, wanted)[0] if wanted else 0  # measured, or the promoter's own estimate
    for mv in dv.models.values():
        state = mv.residency
        if isinstance(state, Lost) and state.reason == "gpu_detached":
            return True
        back = reload_ms(view.policy, mv)  # its restart backoff and measured warm-up, as the promoter counts it
        if wake and back and wake < back:
            return True
    return False


def _reloads_in_place(view: FleetView, active: str, gone: str = "") -> int:
    """ms until the active serves its lost models again by itself (0 = it will not, or nobody knows): every
    model it has lost is lost for a cold-reload reason (or loading again after one) and its warm-up was
    measured. The promoter then lets the reload run (`faster_path` found the standby no quicker), so a
    request waits for it: the measured warm-up, the restart backoff at its longest, and a margin.

    `gone`: a model whose runtime the active's own serving port just said is gone (lost, or restarting):
    reloading, whatever the view (a few events behind the agent) still says of it."""
    dv = view.domains.get(active)
    if dv is None:
        return 0
    slowest = 0
    for name, mv in dv.models.items():
        state = mv.residency
        if mv.admitted is False or isinstance(state, Resident) and name != gone:
            continue
        if (
            name == gone
            and isinstance(state, Resident)
            or isinstance(state, Lost)
            and state.reason in _COLD_RELOAD
            or isinstance(state, Loading)
            and state.attempt > 1
        ):
            if not mv.load_ms:
                return 0
            slowest = max(slowest, mv.load_ms)
        else:
            return 0  # lost for another reason, failed, a first load, asleep: not a reload the warm-up bounds
    if not slowest:  # nothing lost any more: the route intent has yet to say the model is back
        return MARGIN_MS
    policy = view.policy
    if slowest + policy.restart_backoff_ms + MARGIN_MS > policy.hold_max_ms:
        return 0  # a reload too slow to wait for even after the first backoff: answered at once
    # the restart's backoff doubles with each crash in a row (up to restart_backoff_max_ms): wait for the
    # longest; the hold ends the moment the model is back (or the route moves, if the promoter gives up on it)
    return min(slowest + policy.restart_backoff_max_ms + MARGIN_MS, policy.hold_max_ms)


def back_since(routes: FleetRoutes | None, domain: str, model: str, since: float) -> bool:
    """Whether `model` on `domain` became resident again at or after `since` (epoch seconds): its runtime
    (or the whole agent) came back after a request to it died, so that request may go to it once more
    without the route moving. Pure."""
    view = routes.view if routes is not None else None
    dv = view.domains.get(domain) if view is not None else None
    mv = dv.models.get(model) if dv is not None else None
    state = mv.residency if mv is not None else None
    return isinstance(state, Resident) and state.since is not None and state.since.timestamp() >= since


def _judged_silent(view: FleetView, domain: str) -> bool:
    dv = view.domains.get(domain)
    return dv is not None and dv.reachable is False


def heard_again(routes: FleetRoutes | None, domain: str, judged: list[bool]) -> bool:
    """Whether `domain`, judged unreachable at some point of a hold (`judged`, a flag the caller keeps for
    the hold's length), is reachable again in the view, with no promotion away from it under way: a
    request that died on it may go to it once more without the route moving. (While a promotion runs the
    request waits for its end: what the domain did while cut off, a runtime lost, may not be in the view
    yet.) Pure but for the flag."""
    view = routes.view if routes is not None else None
    if view is None:
        return False
    if _judged_silent(view, domain):
        judged[0] = True
        return False
    if _under_way(view, domain):
        return False
    dv = view.domains.get(domain)
    return judged[0] and dv is not None and dv.reachable is True


def _backing_off(view: FleetView, target: str, now: float) -> bool:
    """A promotion onto `target` aborted a moment ago and the promoter waits before it tries again, so
    nothing is about to start (the promoter's rule, haru/promoter/failover.py `retry_after_abort`): a manual
    promotion, or an automatic one past its fast retries (`failover_retry_attempts`). An automatic one
    within them is tried again in `failover_retry_ms` (doubled per attempt), so a request holds for it;
    another kind of operation that aborted (a demotion of `target` itself) holds nothing back."""
    last = view.last_operation
    if (
        last is None
        or last.state != "aborted"
        or last.kind != "promotion"
        or last.target != target
        or last.finished_at is None
    ):
        return False
    if last.reason != "manual" and last.attempt < view.policy.failover_retry_attempts:
        return False
    wait_ms = max(view.policy.degraded_grace_ms, view.policy.heartbeat_timeout_ms)
    return now - last.finished_at.timestamp() < wait_ms / 1000


def hold_plan(
    routes: FleetRoutes | None, code: str, *, unreachable: bool = False, gone: str = "", now: float
) -> HoldPlan | None:
    """Whether a request answered `code` (or that found the active unreachable) should wait for a
    failover, and for how long at most. None: answer it now. `now` is epoch seconds. Pure.

    `gone` names the model when the active's serving port answered that its runtime is gone (the
    X-Haru-Runtime-Gone header; `code` is then the agent's own: `model_lost`, `model_warming` for a
    restart under way, ...). Such a request waits for a failover as an unreachable one does, and also,
    whatever a standby does meanwhile, for the active's own reload when that is bounded (a runtime
    killed on a domain whose standby is not ready, or whose promotion just aborted, comes back in place)."""
    if routes is None or routes.view is None or not routes.active:
        return None
    view = routes.view
    policy = view.policy
    if policy.hold_max_ms <= 0:
        return None
    active = routes.active
    target = _under_way(view, active)
    in_place = 0
    if target:
        if code not in _CURED_BY_PROMOTION and not unreachable:
            return None
        why = f"promotion of {target} under way"
    else:
        in_place = _reloads_in_place(view, active, gone) if code in _CURED_IN_PLACE and (gone or not unreachable) else 0
        if code not in _CURED_BY_FAILOVER and not unreachable and not in_place:
            return None
        target = _standby_ready(view, active) if policy.auto_failover else ""
        if not target or _backing_off(view, target, now) or not (unreachable or _fails_now(view, active, target)):
            if in_place:  # the active reloads sooner than a failover would serve: wait for it
                return HoldPlan(
                    min(policy.hold_ms or in_place, policy.hold_max_ms),
                    f"{active} reloads its lost models in place (about {in_place} ms)",
                )
            if unreachable and _judged_silent(view, active):
                # the active's heartbeats went silent and no standby can take over: its serving link may well
                # be fine (a cut NATS link, a loaded host), so wait for it to be heard again
                why = f"{active} heard again (its heartbeats went silent)"
                return HoldPlan(policy.hold_ms or policy.hold_max_ms, why)
            return None  # a loss the promoter waits out (degraded_grace_ms): holding would only delay the answer
        why = f"auto-failover to {target} about to start"
        if in_place:  # or the active's own reload, whichever serves first: the longer of the two bounds it
            why += f", or {active} reloading in place (about {in_place} ms)"
    if policy.hold_ms:
        return HoldPlan(min(policy.hold_ms, policy.hold_max_ms), why, target)
    wakes = [mv.wake_ms for mv in view.domains[target].models.values() if mv.admitted is not False]
    if not wakes or not all(wakes):
        return HoldPlan(policy.hold_max_ms, why, target)  # never measured: the ceiling
    dv = view.domains.get(active)
    # The promoter fails a silent domain only once its heartbeats have been missing this long.
    detect = policy.heartbeat_timeout_ms if unreachable and (dv is None or dv.reachable is not False) else 0
    budget = min(max(detect + max(wakes) + MARGIN_MS, in_place), policy.hold_max_ms)
    return HoldPlan(budget, why, target, estimated=True)


def goes_on(plan: HoldPlan | None, promoter_heard: bool) -> bool:
    """Whether a hold whose estimated time is up may wait on (a little longer, up to `hold_max_ms` from its
    start): `plan`, made again now, is still a failover whose budget was Haru's estimate, and a promoter is
    heard on the bus to drive it. An estimate counts the standby's wake and probe, not the log: when the
    lost domain's region held the JetStream leaders, the promoter's writes wait for an election first (a
    few seconds), and the request waits with them. With no promoter heard nothing will move the route, and
    a wait the operator set (`hold_ms`) is kept as set. Pure."""
    return plan is not None and bool(plan.target) and plan.estimated and promoter_heard


class Holds:
    """The requests held on this gateway, per fleet, and the wake-up when a fleet's routes change.

    `changed(fleet)` is called by the route follower on every view, intent and route move."""

    def __init__(
        self, table: RoutingTable, metrics: GatewayMetrics, promoter_heard: Callable[[], bool] = lambda: False
    ) -> None:
        self.table = table
        self.metrics = metrics
        self.promoter_heard = promoter_heard  # a promoter beat on haru.alive.promoter.* a moment ago
        self._changes: dict[str, asyncio.Event] = {}
        self.held: dict[str, int] = {}  # fleet -> requests held now
        self.held_bytes: dict[str, int] = {}

    def changed(self, fleet: str) -> None:
        event = self._changes.pop(fleet, None)
        if event is not None:
            event.set()

    def later(self, fleet: str, plan: HoldPlan | None, started: float, now: float) -> float:
        """The new deadline (monotonic) of a hold begun at `started` whose time is up at `now` (`plan`
        made again now): a step further while the failover it waits for `goes_on`, never beyond
        `hold_max_ms` from `started`; `now` when it ends."""
        routes = self.table.get(fleet)
        policy = routes.view.policy if routes is not None and routes.view is not None else None
        if policy is None or not goes_on(plan, self.promoter_heard()):
            return now
        return max(now, min(now + WAIT_ON_S, started + policy.hold_max_ms / 1000))

    async def next_change(self, fleet: str, timeout: float) -> bool:
        """Wait until the fleet's routes change (True) or `timeout` seconds pass (False)."""
        event = self._changes.get(fleet)
        if event is None:
            event = self._changes[fleet] = asyncio.Event()
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                await event.wait()
        except TimeoutError:
            return False
        return True

    def admit(self, fleet: str, size: int) -> str:
        """'' when one more request of `size` bytes may be held in `fleet`, else why not."""
        routes = self.table.get(fleet)
        policy = routes.view.policy if routes is not None and routes.view is not None else None
        if policy is None:
            return "no fleet view"
        if self.held.get(fleet, 0) >= policy.hold_max_requests:
            return f"hold_max_requests ({policy.hold_max_requests}) requests are held already"
        if self.held_bytes.get(fleet, 0) + size > policy.hold_max_bytes:
            return f"hold_max_bytes ({policy.hold_max_bytes}) bytes are held already"
        return ""

    async def hold(
        self,
        fleet: str,
        model: str,
        size: int,
        plan: HoldPlan,
        first: Refusal,
        accept: Callable[[Forward], bool],
        *,
        unreachable: bool = False,
        gone: bool = False,
    ) -> Forward | Refusal:
        """Wait, within `plan`, until the table resolves `model` to a Forward that `accept`s; return it,
        or the answer to give when the hold ends without one: the fleet's answer at that moment."""
        full = self.admit(fleet, size)
        if full:
            self.metrics.held(fleet, "full", 0.0)
            return first
        self.held[fleet] = self.held.get(fleet, 0) + 1
        self.held_bytes[fleet] = self.held_bytes.get(fleet, 0) + size
        started = time.monotonic()
        deadline = started + plan.budget_ms / 1000
        answer: Forward | Refusal = first
        outcome = "expired"
        try:
            while True:
                result = self.table.resolve(fleet, model, time.time())
                if type(result) is Forward:
                    if accept(result):
                        outcome = "released"
                        return result
                else:
                    answer = result
                now_plan = hold_plan(
                    self.table.get(fleet),
                    first.code,
                    unreachable=unreachable,
                    gone=model if gone else "",
                    now=time.time(),
                )
                if now_plan is None:
                    outcome = "aborted"  # the promotion aborted, or nothing is coming to cure it any more
                    return answer
                now = time.monotonic()
                if now >= deadline:
                    deadline = self.later(fleet, now_plan, started, now)
                    if deadline <= now:
                        return answer
                await self.next_change(fleet, deadline - now)
        except asyncio.CancelledError:
            outcome = "dropped"  # the client went away: the request is dropped at once
            raise
        finally:
            self.held[fleet] -= 1
            self.held_bytes[fleet] -= size
            self.metrics.held(fleet, outcome, time.monotonic() - started)
