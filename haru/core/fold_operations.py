"""The fleet fold's operations, decisions, route pointer and traffic weights. Pure.

    operations     every kind's request (ev.OPERATION_REQUESTS), step_*, promotion_retargeted,
                   operation_completed/aborted -> `operation` (in flight) and `last_operation`
    decisions      failover_declined -> `declined`
    route pointer  route_moved -> `active`, `route_revision`, `route_moved_at` (resets the weights)
    weights        weights_set -> `weights` or `model_weights[model]`, and `weights_change`

Each handler takes `(view, event, seq)` and returns the new view; `haru.core.fold` dispatches to them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from haru.core import events as ev
from haru.core.fold_anomalies import anomaly, missing
from haru.core.fold_declarations import with_domain
from haru.core.views import FleetView, OperationView, StepView, TriedView, WeightsChange

_replace = msgspec.structs.replace


def operation_requested(view: FleetView, e: ev.OperationRequested, seq: int) -> FleetView:
    """Any kind's request (`ev.OPERATION_REQUESTS`): the fields a kind does not have stay empty."""
    op = OperationView(
        op_id=e.op_id,
        kind=e.kind,
        target=e.target,
        source=getattr(e, "source", ""),
        reason=getattr(e, "reason", "manual"),
        detail=getattr(e, "detail", ""),
        requested_at=e.at,
        seq=seq,
        route_revision=getattr(e, "route_revision", 0),
        decl_seq=getattr(e, "decl_seq", 0),
        attempt=getattr(e, "attempt", 1),
        cascade=getattr(e, "cascade", False),
        model=getattr(e, "model", ""),
        weights=dict(getattr(e, "weights", {})),
    )
    return _start_operation(view, op, seq)


def _start_operation(view: FleetView, op: OperationView, seq: int) -> FleetView:
    if view.operation is not None and view.operation.op_id != op.op_id:
        # The promoter's sequence checks make this impossible; the newer request wins, and we say so.
        view = anomaly(view, f"seq {seq}: {op.kind} {op.op_id} requested while {view.operation.op_id} was in flight")
    if op.kind == "promotion":  # the failover that was declined goes ahead: the operation says the rest
        view = _replace(view, declined="", declined_at=None, declined_domain="")
    return _replace(view, operation=op)


def _current_op(view: FleetView, op_id: str) -> OperationView | None:
    op = view.operation
    if op is None or op.op_id != op_id:
        return None
    return op


def step_started(view: FleetView, e: ev.StepStarted, seq: int) -> FleetView:
    op = _current_op(view, e.op_id)
    if op is None:
        return missing(view, seq, "step_started", f"operation {e.op_id!r} (not in flight)")
    step = StepView(step=e.step, state="started", attempt=e.attempt, at=e.at, seq=seq)
    return _replace(view, operation=_replace(op, steps=[*op.steps, step]))


def step_ended(view: FleetView, e: ev.StepCompleted | ev.StepFailed, seq: int) -> FleetView:
    tag = ev.tag_of(e)
    op = _current_op(view, e.op_id)
    if op is None:
        return missing(view, seq, tag, f"operation {e.op_id!r} (not in flight)")
    if isinstance(e, ev.StepCompleted) and e.skipped:
        fields: dict[str, Any] = dict(state="skipped", detail=e.skipped, took_ms=e.took_ms, at=e.at, seq=seq)
    elif isinstance(e, ev.StepCompleted):
        fields = dict(state="completed", detail=e.detail, took_ms=e.took_ms, at=e.at, seq=seq)
    else:
        fields = dict(state="failed", error_code=e.error_code, error=e.error, took_ms=e.took_ms, at=e.at, seq=seq)
    steps = list(op.steps)
    for i in range(len(steps) - 1, -1, -1):
        if steps[i].step == e.step and steps[i].state == "started":
            steps[i] = _replace(steps[i], **fields)
            break
    else:
        steps.append(StepView(step=e.step, **fields))
    return _replace(view, operation=_replace(op, steps=steps))


def promotion_retargeted(view: FleetView, e: ev.PromotionRetargeted, seq: int) -> FleetView:
    """A cascading promotion moves on: the standby it leaves goes to `tried`, its steps start afresh."""
    op = _current_op(view, e.op_id)
    if op is None:
        return missing(view, seq, "promotion_retargeted", f"operation {e.op_id!r} (not in flight)")
    attempt = op.steps[-1].attempt if op.steps else 0
    tried = TriedView(target=op.target, step=e.step, attempt=attempt, error=e.error, at=e.at, seq=seq)
    return _replace(view, operation=_replace(op, target=e.target, steps=[], tried=[*op.tried, tried]))


def operation_completed(view: FleetView, e: ev.OperationCompleted, seq: int) -> FleetView:
    op = _current_op(view, e.op_id)
    if op is None:
        return missing(view, seq, "operation_completed", f"operation {e.op_id!r} (not in flight)")
    done = _replace(op, state="completed", finished_at=e.at)
    return _replace(view, operation=None, last_operation=done)


def operation_aborted(view: FleetView, e: ev.OperationAborted, seq: int) -> FleetView:
    op = _current_op(view, e.op_id)
    if op is None:
        return missing(view, seq, "operation_aborted", f"operation {e.op_id!r} (not in flight)")
    error = f"{e.step}: {e.error}" if e.step and e.error else (e.error or e.step)
    done = _replace(op, state="aborted", finished_at=e.at, error=error)
    return _replace(view, operation=None, last_operation=done)


def failover_declined(view: FleetView, e: ev.FailoverDeclined, seq: int) -> FleetView:
    return _replace(view, declined=e.why, declined_at=e.at, declined_domain=e.domain)


def route_moved(view: FleetView, e: ev.RouteMoved, seq: int) -> FleetView:
    # The route moved: whatever failover was declined before is history now. The domain it left
    # remembers when (it then ranks after the standbys that never lost the role: haru.core.ranking).
    old = view.domains.get(view.active) if view.active and view.active != e.active else None
    if old is not None:
        view = with_domain(view, _replace(old, left_active_seq=seq))
    # A canary's split ends with a move: the new active takes everything.
    return _replace(
        view,
        active=e.active,
        route_revision=seq,
        route_moved_at=e.at,
        declined="",
        declined_at=None,
        declined_domain="",
        weights={},
        model_weights={},
    )


def weights_set(view: FleetView, e: ev.WeightsSet, seq: int) -> FleetView:
    change = WeightsChange(
        model=e.model,
        weights=dict(e.weights),
        reason=e.reason,
        detail=e.detail,
        op_id=e.op_id,
        domain=e.domain,
        requests=e.requests,
        errors=e.errors,
        by=e.by,
        at=e.at,
        seq=seq,
    )
    if e.model:
        model_weights = {m: w for m, w in view.model_weights.items() if m != e.model}
        if e.weights:
            model_weights[e.model] = dict(e.weights)
        return _replace(view, model_weights=model_weights, weights_change=change)
    return _replace(view, weights=dict(e.weights), weights_change=change)
