"""Ranked standbys: which standby a failover promotes first, and why each sits where it does.

Pure: a function of a `FleetView`, no I/O, no clock.

    ranked = rank(view)            # every domain but the active, best first, each with its `why`
    best = first_fit(view)         # the domain auto-failover and `haru promote` (no target) pick ('' = none)
    state = protection(view)       # 'protected' | 'unprotected' | '' (no route yet, or one domain)

A fleet has one active domain and 1..N-1 standbys. The order, key by key:

1. fit before unfit: a standby is fit when it may be promoted now (`unfit` says why not: its agent
   never heard or unreachable, marked ineligible, a failure signalled, a GPU that hosts a served model
   detached, a served model missing, refused, lost or in a state a wake cannot start from). An unfit
   standby is ranked, so status can say why, but never picked;
2. a domain that lost the active role ranks after those that never did, the most recent loss last:
   the old active rejoins as the lowest-ranked standby once it has recovered;
3. the policy's declared order (`Policy.standby_order`, most preferred first; empty = the layout's
   domain order; domains it does not name come after those it names);
4. measured fitness: the shorter last measured wake (and probe) of the models it would serve (a wake
   never measured ranks after a measured one);
5. the layout's order, so the ranking is total and two projectors compute the same one.

`protection` counts the fit standbys: none is the named state `unprotected` (the route intent, `haru
status`, the `haru_fleet_unprotected` metric and the `HaruFleetUnprotected` alert carry it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, NamedTuple

from haru.core.residency import Lost, Resident, Sleeping, Waking, state_name
from haru.core.views import DomainView, FleetView, RankedStandby

__all__ = ["Unready", "first_fit", "first_unready", "fit_standbys", "protection", "rank", "unfit", "wake_ms"]

_READY = (Sleeping, Resident, Waking)
_NEVER = 1 << 62  # a wake never measured sorts after every measured one


def _served(dv: DomainView) -> list[str]:
    return [name for name, mv in dv.models.items() if mv.admitted is not False]


class Unready(NamedTuple):
    """Why one of a domain's models cannot be used now: the first `first_unready` found."""

    model: str
    why: Literal["undeclared", "not_admitted", "lost", "state"]
    state: str  # the model's state name ('' when undeclared)
    reason: str = ""  # a lost model's reason


def first_unready(dv: DomainView, models: Iterable[str], ready: tuple[type, ...]) -> Unready | None:
    """The first of `models` that `dv` does not declare, did not admit, lost, or holds in a state outside `ready`.

    One check for every caller that asks "can this domain serve these models now": the ranking (a
    standby a wake can start from), a weighting (a domain that can be woken for a share) and the
    canary's probe (a domain whose share is resident); each phrases the answer its own way.
    """
    for model in models:
        mv = dv.models.get(model)
        if mv is None:
            return Unready(model, "undeclared", "")
        if mv.admitted is False:
            return Unready(model, "not_admitted", state_name(mv.residency))
        state = mv.residency
        if isinstance(state, Lost):
            return Unready(model, "lost", state_name(state), state.reason)
        if not isinstance(state, ready):
            return Unready(model, "state", state_name(state))
    return None


def unfit(view: FleetView, dv: DomainView, serving: DomainView | None) -> str:
    """Why standby `dv` must not be promoted over `serving` now ('' = it may)."""
    name = dv.name
    if dv.reachable is None:
        return f"standby {name} has not been heard from"
    if dv.reachable is False:
        return f"standby {name} is unreachable"
    if not dv.eligible:
        return f"standby {name} is not eligible: {dv.ineligible_why or 'not recovered'}"
    if dv.signalled:
        return f"standby {name} is about to go ({dv.signalled})"
    wanted = _served(serving) if serving is not None else _served(dv)
    block = first_unready(dv, wanted, _READY)
    if block is not None:
        match block.why:
            case "undeclared":
                return f"standby {name} does not declare model {block.model}"
            case "not_admitted":
                return f"standby {name} cannot hold model {block.model} (not admitted)"
            case "lost":
                return f"standby {name}'s model {block.model} is lost: {block.reason}"
            case _:
                return f"standby {name}'s model {block.model} is {block.state}"
    hosting = {dv.models[m].gpu_index for m in _served(dv)}
    for gpu in dv.gpus:
        if gpu.present is False and gpu.index in hosting:
            return f"standby {name}'s GPU {gpu.index} is detached"
    return ""


def wake_ms(dv: DomainView, serving: DomainView | None) -> int:
    """The slowest last measured wake (and probe) of the models `dv` would serve (0 = one never measured)."""
    wanted = _served(serving) if serving is not None else _served(dv)
    figures = [dv.models[m].wake_ms for m in wanted if m in dv.models]
    if not figures or not all(figures):
        return 0
    return max(figures)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def rank(view: FleetView) -> list[RankedStandby]:
    """Every domain but the active, best first (rank 1), each with why it sits there."""
    serving = view.domains.get(view.active) if view.active else None
    order = view.policy.standby_order
    declared = {name: i for i, name in enumerate(order)} if order else {name: i for i, name in enumerate(view.domains)}
    unnamed = len(declared)
    rows: list[tuple[tuple[int, int, int, int, int], RankedStandby]] = []
    for index, (name, dv) in enumerate(view.domains.items()):
        if name == view.active:
            continue
        why_not = unfit(view, dv, serving)
        wake = wake_ms(dv, serving)
        position = declared.get(name, unnamed)
        parts: list[str] = []
        parts.append(f"not fit: {why_not}" if why_not else "fit")
        if dv.left_active_seq:
            parts.append(f"lost the active role at revision {dv.left_active_seq}, so it ranks after those that did not")
        if position < unnamed:
            parts.append(f"declared {_ordinal(position + 1)}" + (" in standby_order" if order else " in the layout"))
        else:
            parts.append("not named in standby_order")
        parts.append(f"last wake {wake} ms" if wake else "wake never measured")
        key = (1 if why_not else 0, dv.left_active_seq, position, wake or _NEVER, index)
        rows.append((key, RankedStandby(domain=name, rank=0, fit=not why_not, why="; ".join(parts), wake_ms=wake)))
    rows.sort(key=lambda row: row[0])
    return [
        RankedStandby(domain=r.domain, rank=i, fit=r.fit, why=r.why, wake_ms=r.wake_ms)
        for i, (_, r) in enumerate(rows, start=1)
    ]


def first_fit(view: FleetView, *, excluding: frozenset[str] = frozenset()) -> str:
    """The best fit standby not in `excluding` ('' = none)."""
    for r in rank(view):
        if r.fit and r.domain not in excluding:
            return r.domain
    return ""


def fit_standbys(ranked: list[RankedStandby]) -> int:
    return sum(1 for r in ranked if r.fit)


def protection(view: FleetView, ranked: list[RankedStandby] | None = None) -> str:
    """'protected' (a fit standby exists), 'unprotected' (none), or '' (no route yet, or a single-domain fleet)."""
    if not view.active or len(view.domains) < 2:
        return ""
    ranked = rank(view) if ranked is None else ranked
    return "protected" if fit_standbys(ranked) else "unprotected"
