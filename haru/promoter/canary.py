"""Canaries: when a domain's share of traffic may start, and when it is taken back. Pure.

    refusal = weigh_refusal(view, op)      # '' when a `weighting` operation may set its split now
    append = rollback(view, tallies, now)  # a `weights_set` taking a failing canary's share back, or None
    tallies = tally(reports, since=..)     # the gateways' reports of a window, summed per domain and model

A `weighting` operation (haru.core.saga: stop_training -> verify_gpu -> wake -> probe -> weigh)
sets its split in `weights_set` on haru.evt.<fleet>.weights once its `weigh` step found every domain of
the split serving: reachable, eligible, each model of the split's scope resident (probed in this
operation for the one domain it woke). A canary is rolled back, its share given to the active, when

- its probe fails: the domain is unreachable or ineligible, or a model of the split's scope there is no
  longer resident (the agent's probes found it lost, or it was put to sleep), at once; or
- the gateways reported, since the split was set and within `canary_window_ms`, at least
  `canary_min_requests` requests to it with an error rate above `canary_max_error_rate`.

The `weights_set` carries the evidence (`detail`, `requests`, `errors`, `domain`): `haru why`, `haru
status` and the console show it.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from haru.core import subjects
from haru.core.events import WeightsSet
from haru.core.ranking import first_unready
from haru.core.residency import Resident
from haru.core.views import FleetView, OperationView
from haru.core.weighing import scope_models
from haru.core.weights import CanaryReport, Tally, changed_shares, describe, scope_of
from haru.promoter.decisions import Append

__all__ = ["applied", "rollback", "tally", "weigh_refusal"]


def _unfit(view: FleetView, name: str, model: str) -> str:
    """Why `name` cannot take a share of `model`'s traffic ('' = it can): the probe's verdict, from the view."""
    dv = view.domains.get(name)
    if dv is None:
        return f"domain {name} is no longer declared"
    if dv.reachable is False:
        return f"{name} is unreachable (agent heartbeat silent)"
    if not dv.eligible:
        return f"{name} is not eligible: {dv.ineligible_why or 'not recovered'}"
    models = scope_models(view, dv, model)
    if not models:
        return (
            f"{name} serves none of {scope_of(model)}'s models"
            if not model
            else f"{name} does not declare model {model!r}"
        )
    block = first_unready(dv, models, (Resident,))
    if block is None:
        return ""
    match block.why:
        case "undeclared":
            return f"{name} does not declare model {block.model!r}"
        case "not_admitted":
            return f"model {block.model!r} is not admitted on {name}"
        case _:
            return f"model {block.model!r} on {name} is {block.state}, not resident"


def weigh_refusal(view: FleetView, op: OperationView) -> str:
    """Why the `weigh` step of a weighting must not set its split now ('' = it may)."""
    if view.route_revision != op.route_revision:
        return (
            f"the route moved (revision {op.route_revision} -> {view.route_revision}, active {view.active}) since "
            f"the weights were asked for; ask again"
        )
    for name, share in op.weights.items():
        if name == view.active or share <= 0:
            continue
        why = _unfit(view, name, op.model)
        if why:
            return f"{name} cannot take {share}% of {scope_of(op.model)}'s traffic: {why}"
    return ""


def applied(view: FleetView, op: OperationView) -> bool:
    """Whether the weighting's split was recorded (a `weights_set` naming it)."""
    change = view.weights_change
    return change is not None and change.op_id == op.op_id


def weights_set(view: FleetView, op: OperationView, now: datetime) -> Append:
    """The `weights_set` a weighting that passed its `weigh` step records."""
    return Append(
        subject=subjects.weights(view.fleet),
        event=WeightsSet(
            at=now,
            model=op.model,
            weights=dict(op.weights),
            reason=op.reason or "manual",
            detail=op.detail or f"{describe(op.weights, view.active)} for {scope_of(op.model)}",
            op_id=op.op_id,
            route_revision=view.route_revision,
        ),
        why=f"weights {describe(op.weights, view.active)} for {scope_of(op.model)}",
    )


# ------------------------------------------------------------------------------------- rollback


def tally(reports: Iterable[tuple[str, CanaryReport]], *, since: datetime | None = None) -> dict[str, dict[str, Tally]]:
    """(gateway, report) pairs summed per domain and model; reports from before `since` left out."""
    sums: dict[str, dict[str, list[Any]]] = {}  # [requests, errors, gateways, last error]
    for gateway, report in reports:
        if since is not None and report.at < since:
            continue
        for c in report.counts:
            s = sums.setdefault(c.domain, {}).setdefault(c.model, [0, 0, set(), ""])
            s[0] += c.requests
            s[1] += c.errors
            s[2].add(gateway)
            if c.last_error:
                s[3] = c.last_error
    return {
        d: {m: Tally(requests=r, errors=e, gateways=sorted(g), last_error=last) for m, (r, e, g, last) in ms.items()}
        for d, ms in sums.items()
    }


def _summed(tallies: dict[str, dict[str, Tally]], domain: str, models: list[str]) -> Tally:
    per = tallies.get(domain, {})
    picked = [per[m] for m in models if m in per]
    gateways = sorted({g for t in picked for g in t.gateways})
    last = next((t.last_error for t in reversed(picked) if t.last_error), "")
    return Tally(
        requests=sum(t.requests for t in picked),
        errors=sum(t.errors for t in picked),
        gateways=gateways,
        last_error=last,
    )


def rollback(view: FleetView, tallies: dict[str, dict[str, Tally]], now: datetime) -> Append | None:
    """The first failing canary's share taken back, with its evidence; None when every canary holds."""
    active = view.active
    if not active:
        return None
    policy = view.policy
    for model, split in changed_shares(view.weights, view.model_weights):
        for name, share in split.items():
            if name == active or share <= 0:
                continue
            dv = view.domains.get(name)
            models = scope_models(view, dv, model) if dv is not None else ([model] if model else [])
            evidence = _unfit(view, name, model)
            seen = _summed(tallies, name, models)
            if evidence:
                evidence = f"probe failed: {evidence}"
            elif seen.requests >= max(1, policy.canary_min_requests) and seen.error_rate > policy.canary_max_error_rate:
                base = _summed(tallies, active, models)
                evidence = (
                    f"error rate {seen.error_rate:.1%} ({seen.errors} of {seen.requests} requests "
                    f"since the split was set, within canary_window_ms {policy.canary_window_ms} ms, "
                    f"reported by {', '.join(seen.gateways)}) is over "
                    f"canary_max_error_rate {policy.canary_max_error_rate:.1%}; the active {active}: "
                    f"{base.error_rate:.1%} of {base.requests}"
                    + (f"; last error: {seen.last_error}" if seen.last_error else "")
                )
            if not evidence:
                continue
            rest = {d: w for d, w in split.items() if d != name}
            rest[active] = rest.get(active, 0) + share
            new = {} if rest == {active: 100} else rest
            return Append(
                subject=subjects.weights(view.fleet),
                event=WeightsSet(
                    at=now,
                    model=model,
                    weights=new,
                    reason="canary_rolled_back",
                    domain=name,
                    detail=f"canary {name} rolled back ({share}% of {scope_of(model)}'s traffic back to "
                    f"{active}): {evidence}",
                    requests=seen.requests,
                    errors=seen.errors,
                    route_revision=view.route_revision,
                ),
                why=f"canary {name} rolled back: {evidence}",
            )
    return None
