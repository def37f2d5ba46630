"""Housekeeping with no operation in flight: what keeps every domain in its role. Pure.

    append = teardown_retry(view, facts)   # a failed teardown asked again: a billed host is never forgotten
    append = auto_replace(view, facts)     # policy auto_replace: a failed skypilot/skyserve domain replaced
    append = demotion(view, facts)         # a recovered domain, or an awake standby, put to sleep with training

A domain carrying a share of traffic (a canary: haru.core.weights) is awake on purpose and left alone.
A model whose runtime has no sleep mode (llama-server) is a standby resident, not an awake one; and a
demotion that completed is never requested again while none of its inputs changed (`already_done`).
"""

from __future__ import annotations

from datetime import timedelta

from haru.core import subjects
from haru.core.events import (
    DemotionRequested,
    ReplaceRequested,
    TeardownRequested,
)
from haru.core.residency import Resident, Sleeping, Waking, state_name
from haru.core.saga import (
    PROVISIONING_KINDS,
    TORN_DOWN,
)
from haru.core.specs import can_sleep
from haru.core.standby import served
from haru.core.views import DomainView, FleetView
from haru.promoter.decisions import Append, Facts
from haru.promoter.failover import backing_off, retry_ms


def teardown_retry(view: FleetView, facts: Facts) -> Append | None:
    """A teardown that failed (its `down` step, in a teardown or a replace) is asked again after the
    retry backoff, until one succeeds: a host that may still be running and billed is never forgotten."""
    now = facts.now
    last = view.last_operation
    if (
        last is None
        or last.state != "aborted"
        or last.kind not in ("teardown", "replace")
        or not any(s.step == "down" and s.state == "failed" for s in last.steps)
        or last.target not in view.domains
    ):
        return None
    if last.finished_at is not None and now - last.finished_at < timedelta(milliseconds=retry_ms(view.policy)):
        return None
    return Append(
        subject=subjects.op(view.fleet),
        event=TeardownRequested(
            at=now,
            op_id=facts.new_op_id,
            target=last.target,
            reason="teardown_failed",
            detail=f"the teardown in {last.op_id} failed: {last.error}",
        ),
        why=f"a failed teardown of {last.target} is asked again: its host may still be running and billed",
    )


def auto_replace(view: FleetView, facts: Facts) -> Append | None:
    """The fleet's auto-replace of a failed domain.

    Auto-replace (policy `auto_replace`, off by default): a skypilot/skyserve domain that is not the
    active and is not eligible as standby (the failover recorded why: its GPU detached, its agent
    unreachable) gets a `replace`, unless the last provisioning operation aborted less than
    `launch_cooldown_ms` (or the usual retry backoff) ago, or `max_launches_per_hour` launches were
    started in the last hour (the service counts them: `facts.launches_last_hour`)."""
    now = facts.now
    last = view.last_operation
    op_subject = subjects.op(view.fleet)
    policy = view.policy
    if not policy.auto_replace:
        return None
    for name, dv in view.domains.items():
        if (
            name == view.active
            or dv.provider not in ("skypilot", "skyserve")
            or dv.eligible
            or dv.ineligible_why == TORN_DOWN
        ):
            continue
        if last is not None and last.state == "aborted" and last.kind in PROVISIONING_KINDS and last.target == name:
            cool = max(policy.launch_cooldown_ms, retry_ms(policy))
            if last.finished_at is not None and now - last.finished_at < timedelta(milliseconds=cool):
                continue  # cooling down after a failed launch
        if policy.max_launches_per_hour and facts.launches_last_hour >= policy.max_launches_per_hour:
            continue  # over the fleet's launch budget for this hour
        return Append(
            subject=op_subject,
            event=ReplaceRequested(
                at=now,
                op_id=facts.new_op_id,
                target=name,
                reason="auto_replace",
                detail=f"{name} is not fit to be the standby: {dv.ineligible_why or 'ineligible'}",
            ),
            why=f"auto_replace: {name} failed ({dv.ineligible_why or 'ineligible'}); a new host replaces it",
        )
    return None


def demotion_reason(view: FleetView, dv: DomainView) -> str:
    """Why a non-active domain should be put to sleep and given training now ('' = it should not)."""
    if dv.reachable is not True or dv.signalled:  # a domain about to go (a notice) is no standby to keep
        return ""
    states = [dv.models[m].residency for m in served(dv)]
    hosting = {dv.models[m].gpu_index for m in served(dv)}
    if any(g.present is False and g.index in hosting for g in dv.gpus):
        return ""
    if not dv.eligible:
        if states and all(isinstance(s, (Resident, Sleeping)) for s in states):
            return "recovered"
        return ""
    if carries_share(view, dv.name):
        return ""  # a canary: awake on purpose
    # Awake only counts for a runtime that can sleep: one without a sleep mode (llama-server, a vLLM
    # whose platform has none: `Resident.sleeps`) serves the standby role resident, and asking it to
    # sleep would change nothing.
    awake = [
        m
        for m in served(dv)
        if isinstance(r := dv.models[m].residency, Resident) and r.sleeps and can_sleep(dv.models[m].runtime)
    ]
    if awake and not any(isinstance(s, (Waking,)) or state_name(s) == "loading" for s in states):
        return "standby_awake"
    return ""


def carries_share(view: FleetView, name: str) -> bool:
    """Whether a domain other than the active has a share of traffic (a canary: haru.core.weights), or a
    weighting in flight is waking it for one."""
    if name != view.active and any(w.get(name, 0) > 0 for w in (view.weights, *view.model_weights.values())):
        return True
    op = view.operation
    return op is not None and op.state == "running" and op.kind == "weighting" and op.target == name


def already_done(view: FleetView, dv: DomainView, reason: str) -> bool:
    """Whether the last operation was this same demotion, and none of its inputs changed since.

    The inputs of `_demotion_reason` are the domain's reachability, eligibility, GPU presence and its
    models' residency (a completed demotion leaves the domain eligible, and a GPU that went away
    shows in its models' residency). A demotion that finished without changing any of them would only finish the
    same way again: it is not requested twice (whatever made it change nothing is in its record).
    """
    last = view.last_operation
    if last is None or last.kind != "demotion" or last.target != dv.name or last.reason != reason:
        return False
    if last.state != "completed":
        return False  # an aborted one is retried after its backoff (`_backing_off`)
    if (
        dv.reachability_since is not None
        and last.requested_at is not None
        and dv.reachability_since > last.requested_at
    ):
        return False
    for m in served(dv):
        if dv.models[m].residency.seq > last.seq:
            return False
    return True  # (a GPU that went away or came back shows in its models' residency)


def demotion(view: FleetView, facts: Facts) -> Append | None:
    """The first domain other than the active that should be put to sleep and given training now."""
    op_subject = subjects.op(view.fleet)
    now = facts.now
    for name, dv in view.domains.items():
        if name == view.active:
            continue
        reason = demotion_reason(view, dv)
        if reason and backing_off(view, "demotion", name, now) is None and not already_done(view, dv, reason):
            return Append(
                subject=op_subject,
                event=DemotionRequested(
                    at=now, op_id=facts.new_op_id, target=name, reason=reason, route_revision=view.route_revision
                ),
                why=f"keep {name} a standby: {reason}",
            )
    return None
