"""Auto-failover: which standby is promoted when the active failed, how an aborted failover is retried,
and the fleet's first route. Pure.

    append = failover(view, health, facts)   # promotion_requested (cascade), failover_declined, or None
    append = first_route(view, facts)        # the first declared domain promoted, once it can serve

An automatic promotion that aborted is retried promptly (`failover_retry_ms`, doubled per attempt,
at most `failover_retry_attempts` in a row: `retry_after_abort`); past that, and for any other
automatic operation that aborted, the usual backoff applies (`retry_ms`, `backing_off`).
"""

from __future__ import annotations

from datetime import datetime, timedelta

import msgspec

from haru.core import ranking, subjects
from haru.core.events import (
    FailoverDeclined,
    PromotionRequested,
)
from haru.core.residency import Resident, Sleeping, Waking, state_name
from haru.core.specs import Policy
from haru.core.standby import served
from haru.core.views import FleetView, OperationView
from haru.promoter.decisions import Append, Facts
from haru.promoter.health import ActiveHealth, standby_unfit


def retry_ms(policy: Policy) -> int:
    """How long an automatic operation that aborted waits before it is requested again."""
    return max(policy.degraded_grace_ms, policy.heartbeat_timeout_ms)


def backing_off(view: FleetView, kind: str, target: str, now: datetime) -> OperationView | None:
    last = view.last_operation
    if last is None or last.state != "aborted" or last.kind != kind or last.target != target:
        return None
    if last.finished_at is not None and now - last.finished_at >= timedelta(milliseconds=retry_ms(view.policy)):
        return None
    return last


def failover_retry_ms(policy: Policy, attempt: int) -> int:
    """The pause after automatic failover attempt `attempt` aborted: failover_retry_ms doubled per
    attempt, capped at failover_retry_max_ms."""
    return min(policy.failover_retry_ms << max(0, min(attempt - 1, 30)), policy.failover_retry_max_ms)


class Retry(msgspec.Struct, frozen=True, kw_only=True):
    """What to do about the last aborted automatic failover onto a candidate, while the active is unfit."""

    attempt: int = 1  # the attempt to request now (when `wait` and `why` are empty)
    wait: bool = False  # within the backoff: request nothing yet (the abort is the record)
    why: str = ""  # gave up the fast retries: said once as failover_declined


def retry_after_abort(view: FleetView, candidate: str, now: datetime) -> Retry:
    """An automatic promotion onto `candidate` that aborted (its standby's step failed: the trainer's
    memory not released yet, a wake that ran out of memory) is retried promptly, not after
    `retry_ms`: after `failover_retry_ms(attempt)`, each attempt a new `promotion_requested` with its
    `attempt` number, at most `failover_retry_attempts` in a row. Past the cap it gives up the fast
    retries, says why, and the usual backoff of an aborted operation (`retry_ms`) applies. A manual
    promotion that aborted keeps the usual backoff."""
    last = view.last_operation
    policy = view.policy
    if last is None or last.state != "aborted" or last.kind != "promotion" or last.target != candidate:
        return Retry()
    since = now - last.finished_at if last.finished_at is not None else timedelta(0)
    if last.reason == "manual" or last.attempt >= policy.failover_retry_attempts:
        if since >= timedelta(milliseconds=retry_ms(policy)):
            return Retry()
        if last.reason == "manual":
            return Retry(
                why=f"the last promotion onto {candidate} aborted ({last.error or 'failed'}); "
                f"retrying after {retry_ms(policy)} ms"
            )
        return Retry(
            why=f"gave up retrying the failover onto {candidate} after {last.attempt} attempts "
            f"(failover_retry_attempts), the last aborted: {last.error or 'failed'}; "
            f"next try after {retry_ms(policy)} ms"
        )
    if since < timedelta(milliseconds=failover_retry_ms(policy, last.attempt)):
        return Retry(wait=True)
    return Retry(attempt=last.attempt + 1)


def failover(view: FleetView, health: ActiveHealth, facts: Facts) -> Append | None:
    """The active failed (`health`): a promotion of the best fit standby, or `failover_declined` saying
    why none can take over (once per distinct reason and incident), or None (auto-failover is off, or
    an aborted failover's backoff is still running)."""
    if not view.policy.auto_failover:
        return None
    now = facts.now
    op_subject = subjects.op(view.fleet)
    # The best fit standby (ranked: declared order, then measured fitness); with none fit, the
    # first-ranked one, whose unfitness the decline names.
    candidate = ranking.first_fit(view) or view.standby()
    why = standby_unfit(view, candidate, view.domains.get(view.active))
    if why and len(view.domains) > 2:
        why = f"no fit standby (fleet unprotected): {why}"
    again = Retry()
    if not why:
        again = retry_after_abort(view, candidate, now)  # an aborted failover: retried promptly, bounded
        if again.wait:
            return None
        why = again.why
    if why:
        # Once per distinct reason and incident: the failure's onset is part of the reason.
        onset = f" since {health.since.isoformat(timespec='milliseconds')}" if health.since else ""
        full = f"{health.why}{onset}; {why}"
        if full == view.declined:
            return None
        return Append(
            subject=op_subject,
            event=FailoverDeclined(at=now, domain=view.active, candidate=candidate, why=full),
            why="the active failed and the standby cannot take over",
        )
    return Append(
        subject=op_subject,
        event=PromotionRequested(
            at=now,
            op_id=facts.new_op_id,
            target=candidate,
            source=view.active,
            reason=health.reason,
            detail=health.why,
            route_revision=view.route_revision,
            attempt=again.attempt,
            cascade=True,
        ),
        why=f"auto-failover: {health.why}" + (f" (attempt {again.attempt})" if again.attempt > 1 else ""),
    )


_READY_TO_PROMOTE = (Sleeping, Resident, Waking)


def first_route(view: FleetView, facts: Facts) -> Append | None:
    """No route_moved yet: promote the first declared domain through the normal path.

    Once the first domain is reachable with its models resident or asleep, and every other domain
    has been heard from (or found silent) and has finished loading (bounded by degraded_grace_ms).
    """
    names = list(view.domains)
    first = names[0]
    # Every domain heard from (reachable), or known silent: a dead standby does not keep a fleet
    # from serving; the settle step then records it not eligible, and it rejoins when it recovers.
    if view.domains[first].reachable is not True or any(view.domains[n].reachable is None for n in names):
        return None
    dv = view.domains[first]
    if not dv.eligible:
        return None
    states = [dv.models[m].residency for m in served(dv)]
    if not states or not all(isinstance(s, _READY_TO_PROMOTE) for s in states):
        return None
    if backing_off(view, "promotion", first, facts.now) is not None:
        return None
    # Let the other domains' runtimes finish loading first, so the settle step can put them to sleep
    # (bounded: a model loading for longer than degraded_grace_ms does not hold the first route back).
    grace = timedelta(milliseconds=view.policy.degraded_grace_ms)
    for name in names[1:]:
        other = view.domains[name]
        if other.reachable is False:
            continue
        for m in served(other):
            state = other.models[m].residency
            if state_name(state) == "unknown":
                return None
            if state_name(state) == "loading" and (state.since is None or facts.now - state.since < grace):
                return None
    return Append(
        subject=subjects.op(view.fleet),
        event=PromotionRequested(
            at=facts.now,
            op_id=facts.new_op_id,
            target=first,
            source="",
            reason="initial",
            detail=f"no route yet: {first} is the first declared domain",
            route_revision=view.route_revision,
        ),
        why="first route",
    )
