"""The verdict on an operator's request: an operation (`haru promote`, `demote`, `roll`, `provision`,
`teardown`, `replace`, the control API) or an abort (`haru op abort`). Pure.

    verdict = judge_request(view, "promotion", "b", op_id=op_id, by="cli:alice", now=now)
    verdict.status   # noop | accepted | joined | conflict | refused | not_found | invalid
    verdict.event    # the request event to append when accepted (haru.log.requests appends it)
    verdict = judge_abort(view, op_id, by="cli:alice", now=now)

The generic checks (a known fleet and target, one operation in flight per fleet) come first, then
the kind's own rule (`REQUEST_RULES`). The append of an accepted request, sequence-checked on the op
subject, is the log's (haru.log.requests): the control API and the CLI ask there, never the promoter.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Literal

import msgspec

from haru.core.events import (
    DemotionRequested,
    Event,
    OperationAborted,
    PromotionRequested,
    RollingRequested,
)
from haru.core.saga import KINDS, PROVISIONING_KINDS, OpKind, last_step
from haru.core.views import FleetView

RequestStatus = Literal["noop", "accepted", "joined", "conflict", "refused", "not_found", "invalid"]


class Judgment(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to a manual request; `event` is what to append when it is accepted."""

    status: RequestStatus
    op_id: str = ""
    message: str = ""
    event: Event | None = None


RequestRule = Callable[[FleetView, str, str, str, datetime], Judgment]
"""(view, target, op_id, by, now) -> the verdict on a request of one kind, once the generic checks
(a known fleet and target, no other operation in flight) have passed."""


def _promotion_rule(view: FleetView, target: str, op_id: str, by: str, now: datetime) -> Judgment:
    if view.active == target:
        return Judgment(status="noop", message=f"{target} is already active in fleet {view.fleet}")
    event = PromotionRequested(
        at=now,
        by=by,
        op_id=op_id,
        target=target,
        source=view.active,
        reason="manual",
        route_revision=view.route_revision,
    )
    return Judgment(status="accepted", op_id=op_id, message=f"promotion of {target} accepted", event=event)


def _demotion_rule(view: FleetView, target: str, op_id: str, by: str, now: datetime) -> Judgment:
    if view.active == target:
        return Judgment(
            status="refused",
            message=f"{target} is the active domain of fleet {view.fleet}; promote the standby instead "
            f"(haru promote {view.standby() or '<standby>'})",
        )
    event = DemotionRequested(
        at=now, by=by, op_id=op_id, target=target, reason="manual", route_revision=view.route_revision
    )
    return Judgment(status="accepted", op_id=op_id, message=f"demotion of {target} accepted", event=event)


def _rolling_rule(view: FleetView, target: str, op_id: str, by: str, now: datetime) -> Judgment:
    if not view.active:
        return Judgment(
            status="refused",
            message=f"fleet {view.fleet} has no route yet: there is nothing to roll through; "
            f"the agents apply the declarations as they start",
        )
    if view.active == target:
        return Judgment(
            status="refused",
            message=f"{target} is the active domain of fleet {view.fleet}: a rolling change goes "
            f"through the standby (haru roll {view.standby() or '<standby>'})",
        )
    dv = view.domains[target]
    if dv.reachable is not True:
        return Judgment(
            status="refused",
            message=f"standby {target} is {'unreachable' if dv.reachable is False else 'not heard from yet'}: "
            f"a rolling change needs it to take over",
        )
    if not dv.eligible:
        return Judgment(
            status="refused", message=f"standby {target} is not eligible: {dv.ineligible_why or 'not recovered'}"
        )
    event = RollingRequested(
        at=now,
        by=by,
        op_id=op_id,
        target=target,
        source=view.active,
        reason="manual",
        route_revision=view.route_revision,
        decl_seq=view.decl_seq,
    )
    return Judgment(status="accepted", op_id=op_id, message=f"rolling change through {target} accepted", event=event)


def _provisioning_rule(kind: str) -> RequestRule:
    request = KINDS[kind].request

    def rule(view: FleetView, target: str, op_id: str, by: str, now: datetime) -> Judgment:
        dv = view.domains[target]
        if dv.provider not in ("skypilot", "skyserve"):
            return Judgment(
                status="refused",
                message=f"{target} is a {dv.provider} domain: Haru launches and tears down "
                "only skypilot/skyserve domains (set its provider and provision block, then `haru apply`)",
            )
        if view.active == target:
            return Judgment(
                status="refused",
                message=f"{target} is the active domain of fleet {view.fleet}: promote "
                f"the standby first (haru promote {view.standby() or '<standby>'}), then {kind} {target}",
            )
        if kind == "provision" and dv.reachable is True:
            return Judgment(
                status="noop",
                message=f"{target} already has a running agent; to move it to a new host, use `haru replace {target}`",
            )
        event = request(at=now, by=by, op_id=op_id, target=target)
        return Judgment(status="accepted", op_id=op_id, message=f"{kind} of {target} accepted", event=event)

    return rule


REQUEST_RULES: dict[str, RequestRule] = {
    "promotion": _promotion_rule,
    "demotion": _demotion_rule,
    "rolling": _rolling_rule,
    **{kind: _provisioning_rule(kind) for kind in PROVISIONING_KINDS},
}
"""Per kind, whether a manual request is a no-op, refused, or accepted (and its request event)."""


def judge_request(view: FleetView | None, kind: OpKind, target: str, *, op_id: str, by: str, now: datetime) -> Judgment:
    """Whether a manual request of `kind` on `target` is a no-op, joins, conflicts, is refused, or is accepted."""
    rule = REQUEST_RULES.get(kind)
    if rule is None:
        known = ", ".join(REQUEST_RULES)
        return Judgment(status="refused", message=f"no operation kind {kind!r} can be requested (known: {known})")
    if view is None or not view.domains:
        return Judgment(
            status="not_found", message="no such fleet (or it declares no domains); declare it with `haru apply`"
        )
    fleet = view.fleet
    if target not in view.domains:
        known = ", ".join(view.domains) or "none"
        return Judgment(status="not_found", message=f"no domain {target!r} in fleet {fleet} (declared: {known})")
    op = view.operation if view.operation is not None and view.operation.state == "running" else None
    if op is not None:
        if op.kind == kind and op.target == target:
            return Judgment(status="joined", op_id=op.op_id, message=f"joined {op.kind} of {target} already in flight")
        return Judgment(
            status="conflict",
            op_id=op.op_id,
            message=f"{op.kind} of {op.target} ({op.op_id}) is in flight: one operation at a time per fleet; "
            f"follow it with `haru op {op.op_id} --fleet {fleet}`, or abort it with `haru op abort {op.op_id}`",
        )
    return rule(view, target, op_id, by, now)


def judge_abort(view: FleetView | None, op_id: str, *, by: str, now: datetime, why: str = "") -> Judgment:
    """Whether the operator may abort the operation in flight (`op_id` '' = whichever is in flight).

    Refused once the kind's `no_abort_from` step has started (the route may be moving: the operation
    finishes, its later steps are best effort). The abort is `operation_aborted` on the op subject,
    appended against the op subject's last sequence: a step started meanwhile makes it conflict, and
    the request is judged again on the newer view."""
    if view is None or not view.domains:
        return Judgment(status="not_found", message="no such fleet (or it declares no domains)")
    op = view.operation if view.operation is not None and view.operation.state == "running" else None
    if op is None or (op_id and op.op_id != op_id):
        last = view.last_operation
        if op_id and last is not None and last.op_id == op_id:
            return Judgment(status="noop", op_id=op_id, message=f"{op_id} already {last.state}")
        what = f"operation {op_id} is not in flight" if op_id else "no operation is in flight"
        return Judgment(
            status="not_found", op_id=op_id, message=f"{what} in fleet {view.fleet}; list them with `haru op`"
        )
    spec = KINDS.get(op.kind)
    stop = spec.no_abort_from if spec is not None else ""
    if stop and any(s.step == stop for s in op.steps):
        return Judgment(
            status="refused",
            op_id=op.op_id,
            message=f"{op.kind} {op.op_id} has started its {stop} step: it can no longer be aborted (routing may be "
            f"moving); follow it with `haru op {op.op_id}`",
        )
    cur = last_step(op)
    error = f"aborted by {by or 'the operator'}" + (f": {why}" if why else "")
    event = OperationAborted(at=now, by=by, op_id=op.op_id, step=cur.step if cur is not None else "", error=error)
    return Judgment(status="accepted", op_id=op.op_id, message=f"{op.kind} {op.op_id} aborted", event=event)
