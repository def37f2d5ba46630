"""The verdict on an operator's request for traffic weights (`haru route weight b=10 [--model M]`,
`--reset`, the control API's POST /v1/fleets/{fleet}/weights), and the models a split covers. Pure.

    verdict = judge_weights(view, {"b": 10}, model="", op_id=op_id, by="cli:alice", now=now)
    verdict.status   # noop | accepted | joined | conflict | refused | invalid | not_found

The split is resolved by haru.core.weights.resolve (an unknown domain, shares that do not add up, a
model the active does not serve are `invalid`, with the fix); an accepted one is a `weighting`
operation on the op subject, like any other (one at a time per fleet; haru.log.requests appends it).
The domain it gives a share it did not have is its target: woken and probed first by the promoter (a
standby asleep is fine; one that cannot be woken now, unreachable, ineligible or with a model loading
or lost, is `refused` with why and what to do). A split that gives no domain a new share targets the
active and wakes nothing. Only the promoter records the split (`weights_set`), after its `weigh` step.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from haru.core.errors import InvalidWeights
from haru.core.events import WeightingRequested
from haru.core.ranking import first_unready
from haru.core.requests import Judgment
from haru.core.residency import Resident, Sleeping, Waking
from haru.core.views import DomainView, FleetView
from haru.core.weights import describe, gaining, resolve, scope_of, split_of

__all__ = ["judge_weights", "scope_models"]


def scope_models(view: FleetView, domain: DomainView, model: str) -> list[str]:
    """The models of a split's scope that `domain` serves: `model`, or every model the active serves there too."""
    if model:
        return [model]
    active = view.domains.get(view.active)
    served_there = [m for m, mv in domain.models.items() if mv.admitted is not False]
    if active is None:
        return served_there
    return [m for m in served_there if m in active.models and active.models[m].admitted is not False]


def judge_weights(
    view: FleetView | None,
    given: Mapping[str, int],
    *,
    model: str = "",
    reset: bool = False,
    op_id: str,
    by: str,
    now: datetime,
) -> Judgment:
    """Whether new weights are a no-op, invalid, refused, joined, in conflict, or accepted (and the request)."""
    if view is None or not view.domains:
        return Judgment(
            status="not_found", message="no such fleet (or it declares no domains); declare it with `haru apply`"
        )
    fleet, active = view.fleet, view.active
    if reset and given:
        return Judgment(status="invalid", message="give either weights or --reset, not both")
    if not reset and not given:
        return Judgment(
            status="invalid",
            message="no weights given: write them like b=10 (the active takes the rest), or reset them with --reset",
        )
    if model:
        served = view.domains.get(active)
        if served is None or model not in served.models:
            known = ", ".join(repr(m) for m in (served.models if served else {})) or "none"
            return Judgment(
                status="invalid",
                message=f"model {model!r} is not declared on the active domain {active!r} "
                f"of fleet {fleet} (it serves {known}); model ids are matched exactly",
            )
    try:
        new = {} if reset else resolve(given, domains=list(view.domains), active=active)
    except InvalidWeights as exc:
        return Judgment(status="invalid", message=str(exc))
    current = view.model_weights.get(model, {}) if model else view.weights
    op = view.operation if view.operation is not None and view.operation.state == "running" else None
    if op is not None:
        if op.kind == "weighting" and op.model == model and op.weights == new:
            return Judgment(
                status="joined", op_id=op.op_id, message=f"joined the weighting already in flight ({op.op_id})"
            )
        return Judgment(
            status="conflict",
            op_id=op.op_id,
            message=f"{op.kind} of {op.target} ({op.op_id}) is in flight: one operation at a time per fleet; "
            f"follow it with `haru op {op.op_id} --fleet {fleet}`, then ask again",
        )
    if new == current:
        return Judgment(status="noop", message=f"{scope_of(model)} already splits {describe(new, active)}")
    before = split_of(view.weights, view.model_weights, model, active) if model else (view.weights or {active: 100})
    new_shares = gaining(before, new, active)
    if len(new_shares) > 1:
        return Judgment(
            status="invalid",
            message=f"this gives {', '.join(new_shares)} a share each: one domain is woken and "
            f"probed per request, so give them their shares one at a time "
            f"(first {new_shares[0]}={new[new_shares[0]]})",
        )
    target = new_shares[0] if new_shares else active
    if target != active:
        why = _cannot_wake(view, target, model)
        if why:
            return Judgment(
                status="refused",
                message=f"{target} cannot take {new[target]}% of {scope_of(model)}'s traffic now: {why}",
            )
    what = f"{describe(new, active)} for {scope_of(model)}"
    event = WeightingRequested(
        at=now,
        by=by,
        op_id=op_id,
        target=target,
        model=model,
        weights=new,
        reason="manual",
        detail=what,
        route_revision=view.route_revision,
    )
    how = (
        f"{target} is woken and probed first, then the split is recorded"
        if target != active
        else "nothing to wake: the split is recorded"
    )
    return Judgment(
        status="accepted",
        op_id=op_id,
        message=f"weights {what} accepted ({how}); follow it with `haru op {op_id} --fleet {fleet}`",
        event=event,
    )


def _cannot_wake(view: FleetView, name: str, model: str) -> str:
    dv = view.domains[name]
    if dv.reachable is not True:
        return (
            "its agent is unreachable: start it (haru status shows the domain)"
            if dv.reachable is False
            else "its agent has not been heard from yet: start it, or wait for its first heartbeat"
        )
    if not dv.eligible:
        return f"it is not eligible: {dv.ineligible_why or 'not recovered'}"
    models = scope_models(view, dv, model)
    if not models:
        return f"it does not declare {'model ' + repr(model) if model else 'any model the active serves'}"
    block = first_unready(dv, models, (Resident, Sleeping, Waking))
    if block is None:
        return ""
    match block.why:
        case "undeclared":
            return f"it does not declare model {block.model!r}: declare it there (haru apply)"
        case "not_admitted":
            return f"model {block.model!r} is not admitted there (it does not fit): change the layout"
        case "lost":
            return f"model {block.model!r} is lost there ({block.reason}): wait for it to come back (haru status)"
        case _:
            return f"model {block.model!r} is {block.state} there: wait until it is resident or asleep (haru status)"
