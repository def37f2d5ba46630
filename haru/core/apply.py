"""`haru apply`, its pure half: turn a layout into the declaration events that differ from what the log says.

`fold_declarations(events)` reads the `haru.evt.<fleet>.decl` history into the current `Declarations`;
`diff(current, layout, plan, now)` returns only the events that make the log say what the layout says
(nothing, for a layout applied before). The shell that reads the subject and appends the difference is
`haru.log.apply.apply`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from haru.core.errors import LayoutError
from haru.core.events import (
    AdmissionDecided,
    DomainChanged,
    DomainDeclared,
    DomainRetired,
    Event,
    FleetDeclared,
    ModelChanged,
    ModelDeclared,
    ModelRetired,
    PolicyChanged,
    PriceDeclared,
    TrainingChanged,
    TrainingDeclared,
    TrainingRetired,
    tag_of,
)
from haru.core.planner import Plan, Verdict
from haru.core.prices import Price
from haru.core.residency import state_name
from haru.core.sizes import format_gib
from haru.core.specs import DomainSpec, Layout, ModelSpec, Policy, TrainingSpec, fleet_uuid

if TYPE_CHECKING:
    from haru.core.views import FleetView

__all__ = [
    "Declarations",
    "fold_declarations",
    "diff",
    "describe",
    "running_at_risk",
    "waits_on_active",
    "change_paths",
]


@dataclass
class Declarations:
    """What the decl subject says now. Keys keep declaration order (dicts are ordered)."""

    fleet: str | None = None
    uuid: str = ""  # the fleet's UUID as recorded (declared, or derived from its name)
    policy: Policy | None = None
    domains: dict[str, DomainSpec] = field(default_factory=dict)
    models: dict[tuple[str, str], ModelSpec] = field(default_factory=dict)  # (domain, model id)
    training: dict[tuple[str, str], TrainingSpec] = field(default_factory=dict)  # (domain, slot)
    admissions: dict[tuple[str, str, str], AdmissionDecided] = field(default_factory=dict)  # (domain, kind, name)
    prices: dict[str, Price] = field(default_factory=dict)  # domain -> its price now (haru.core.prices)


def fold_declarations(events: Iterable[Event | None]) -> Declarations:
    """Fold a decl subject's events, in order, into the current declarations. Unknown events are skipped."""
    d = Declarations()
    for e in events:
        if isinstance(e, FleetDeclared):
            d.fleet, d.policy, d.uuid = e.fleet, e.policy, e.uuid or fleet_uuid(e.fleet)
        elif isinstance(e, PolicyChanged):
            d.policy = e.policy
        elif isinstance(e, (DomainDeclared, DomainChanged)):
            d.domains[e.spec.name] = e.spec
        elif isinstance(e, DomainRetired):
            d.domains.pop(e.domain, None)
            for table in (d.models, d.training):
                for key in [k for k in table if k[0] == e.domain]:
                    del table[key]
            for verdict in [k for k in d.admissions if k[0] == e.domain]:
                del d.admissions[verdict]
            d.prices.pop(e.domain, None)
        elif isinstance(e, (ModelDeclared, ModelChanged)):
            d.models[(e.domain, e.spec.name)] = e.spec
        elif isinstance(e, ModelRetired):
            d.models.pop((e.domain, e.model), None)
            d.admissions.pop((e.domain, "model", e.model), None)
        elif isinstance(e, (TrainingDeclared, TrainingChanged)):
            d.training[(e.domain, e.spec.slot)] = e.spec
        elif isinstance(e, TrainingRetired):
            d.training.pop((e.domain, e.slot), None)
            d.admissions.pop((e.domain, "training", e.slot), None)
        elif isinstance(e, AdmissionDecided):
            d.admissions[(e.domain, e.kind, e.name)] = e
        elif isinstance(e, PriceDeclared):
            if e.price is None:
                d.prices.pop(e.domain, None)
            else:
                d.prices[e.domain] = e.price
    return d


def _same_verdict(a: AdmissionDecided, v: Verdict) -> bool:
    return (
        a.admitted == v.admitted
        and a.gpu_index == v.gpu_index
        and a.vram_bytes == v.vram_bytes
        and a.short_by_bytes == v.short_by_bytes
        and a.capacity_bytes == v.capacity_bytes
        and a.resource == v.resource
        and a.host_ram_bytes == v.host_ram_bytes
        and a.gpu_indexes == v.gpu_indexes
    )


def diff(current: Declarations, layout: Layout, plan: Plan, now: datetime, *, by: str = "") -> list[Event]:
    """The events that bring the log from `current` to `layout` with `plan`'s verdicts; [] if none.

    Order: fleet or policy; per domain, the domain, retirements (which free room), declarations and
    changes of models then training slots, then the admission verdicts that changed; finally the
    domains the layout no longer names, each after its models and training slots are retired.
    """
    out: list[Event] = []
    if current.fleet is not None and current.uuid and layout.uuid and layout.uuid != current.uuid:
        raise LayoutError(
            f"fleet {layout.fleet!r} was recorded with UUID {current.uuid}; the layout says {layout.uuid}",
            path="$.uuid",
            fix=f"a fleet's UUID never changes: write {current.uuid}, or leave uuid out",
        )
    if current.fleet is None:
        out.append(
            FleetDeclared(
                at=now, by=by, fleet=layout.fleet, policy=layout.policy, uuid=layout.uuid or fleet_uuid(layout.fleet)
            )
        )
    elif current.policy != layout.policy:
        out.append(PolicyChanged(at=now, by=by, policy=layout.policy, previous=current.policy))

    wanted_domains = {d.spec.name for d in layout.domains}
    for dom in layout.domains:
        name = dom.spec.name
        old = current.domains.get(name)
        if old is None:
            out.append(DomainDeclared(at=now, by=by, spec=dom.spec))
        elif old != dom.spec:
            out.append(DomainChanged(at=now, by=by, spec=dom.spec))
        price = layout.prices.get(name)
        if current.prices.get(name) != price:
            out.append(PriceDeclared(at=now, by=by, domain=name, price=price))
        wanted_models = {m.name for m in dom.models}
        wanted_slots = {t.slot for t in dom.training}
        for dname, model in current.models:
            if dname == name and model not in wanted_models:
                out.append(ModelRetired(at=now, by=by, domain=name, model=model))
        for dname, slot in current.training:
            if dname == name and slot not in wanted_slots:
                out.append(TrainingRetired(at=now, by=by, domain=name, slot=slot))
        for m in dom.models:
            was = current.models.get((name, m.name))
            if was is None:
                out.append(ModelDeclared(at=now, by=by, domain=name, spec=m))
            elif was != m:
                out.append(ModelChanged(at=now, by=by, domain=name, spec=m))
        for t in dom.training:
            was_t = current.training.get((name, t.slot))
            if was_t is None:
                out.append(TrainingDeclared(at=now, by=by, domain=name, spec=t))
            elif was_t != t:
                out.append(TrainingChanged(at=now, by=by, domain=name, spec=t))
        for dp in plan.domains:
            if dp.domain != name:
                continue
            for v in dp.verdicts():
                had = current.admissions.get((name, v.kind, v.name))
                if had is None or not _same_verdict(had, v):
                    out.append(
                        AdmissionDecided(
                            at=now,
                            by=by,
                            domain=name,
                            kind=v.kind,
                            name=v.name,
                            gpu_index=v.gpu_index,
                            admitted=v.admitted,
                            vram_bytes=v.vram_bytes,
                            short_by_bytes=v.short_by_bytes,
                            capacity_bytes=v.capacity_bytes,
                            resource=v.resource,
                            host_ram_bytes=v.host_ram_bytes,
                            gpu_indexes=list(v.gpu_indexes),
                        )
                    )
    for name in current.domains:
        if name in wanted_domains:
            continue
        for dname, model in current.models:
            if dname == name:
                out.append(ModelRetired(at=now, by=by, domain=name, model=model))
        for dname, slot in current.training:
            if dname == name:
                out.append(TrainingRetired(at=now, by=by, domain=name, slot=slot))
        out.append(DomainRetired(at=now, by=by, domain=name))
    return out


def describe(event: Event) -> str:
    """One line per difference, for `haru apply` output: `+ model_declared a/qwen3.6:27b`."""
    tag = tag_of(event)
    sign = "-" if tag.endswith("_retired") else "~" if tag.endswith("_changed") else "+"
    if isinstance(event, FleetDeclared):
        what = event.fleet
    elif isinstance(event, PolicyChanged):
        changed = []
        if event.previous is not None:
            for key in Policy.__struct_fields__:
                a, b = getattr(event.previous, key), getattr(event.policy, key)
                if a != b:
                    changed.append(f"{key} {a} -> {b}")
        what = ", ".join(changed) or "policy"
    elif isinstance(event, (DomainDeclared, DomainChanged)):
        what = event.spec.name
    elif isinstance(event, DomainRetired):
        what = event.domain
    elif isinstance(event, (ModelDeclared, ModelChanged)):
        what = f"{event.domain}/{event.spec.name}"
    elif isinstance(event, ModelRetired):
        what = f"{event.domain}/{event.model}"
    elif isinstance(event, (TrainingDeclared, TrainingChanged)):
        what = f"{event.domain}/{event.spec.slot}"
    elif isinstance(event, TrainingRetired):
        what = f"{event.domain}/{event.slot}"
    elif isinstance(event, PriceDeclared):
        p = event.price
        what = f"{event.domain}: " + (f"{p.per_hour} {p.currency}/h" if p is not None else "unpriced")
        sign = "="
    elif isinstance(event, AdmissionDecided):
        from haru.core.planner import shortfall_text

        verdict = (
            "admitted" if event.admitted else f"not admitted, {shortfall_text(event.short_by_bytes, event.resource)}"
        )
        what = f"{event.domain}/{event.name}" + (" (training)" if event.kind == "training" else "") + f": {verdict}"
        sign = "="
    else:  # pragma: no cover - diff emits only the above
        what = ""
    return f"{sign} {tag} {what}".rstrip()


def waits_on_active(events: list[Event], active: str) -> list[str]:
    """Pure: the `domain/model` changes that would interrupt a model the active domain serves (they roll
    through the standby)."""
    return [f"{e.domain}/{e.spec.name}" for e in events if isinstance(e, ModelChanged) and e.domain == active]


def change_paths(events: list[Event], active: str) -> list[str]:
    """Pure: the path each declared change takes to the running agents (`haru apply --dry-run` says it).

    Agents that read the declarations apply model changes live (docs/agent.md, "Layouts applied live"):
    a new model is started, a retired one stopped, a changed one replaced at once on the standby; on the
    `active` domain a changed model keeps serving its old spec until that domain is the standby: `haru
    apply` requests a rolling change, which promotes the standby and then replaces it there. Everything else is read
    when an agent starts.
    """
    lines = []
    for e in events:
        tag = tag_of(e)
        domain = getattr(e, "domain", "")
        if isinstance(e, ModelDeclared):
            lines.append(f"{domain}/{e.spec.name}: new: started live (no restart; the other models see no event)")
        elif isinstance(e, ModelRetired):
            lines.append(f"{domain}/{e.model}: retired: stopped live (model_stopped)")
        elif isinstance(e, ModelChanged):
            if domain == active:
                lines.append(
                    f"{domain}/{e.spec.name}: changed on the ACTIVE domain: rolls through the standby (haru "
                    f"apply requests a rolling change: the standby applies it, is woken, probed and promoted, "
                    f"then {domain}, the standby now, is replaced); it keeps serving as it is until then"
                )
            else:
                lines.append(
                    f"{domain}/{e.spec.name}: changed on a standby: replaced live (stopped, loaded, put back to sleep)"
                )
        elif tag.startswith("training_") or tag.startswith("domain_") or tag in ("policy_changed", "fleet_declared"):
            what = getattr(e, "name", "") or getattr(getattr(e, "spec", None), "name", "") or getattr(e, "slot", "")
            lines.append(
                f"{domain or 'fleet'}{'/' + what if what else ''}: {tag}: read when the agent starts "
                f"(restart it: its runtimes are adopted)"
            )
    return lines


# The residency states of a model that runs (or is coming up) on its host: what a change can take away.
_RUNNING = frozenset({"loading", "resident", "sleeping", "waking", "pulling"})


def running_at_risk(events: list[Event], view: FleetView | None, active: str) -> list[str]:
    """Pure: every running model (per the fleet `view`) that the declared changes `events` would stop,
    unload or leave unadmitted, and why (`haru apply --dry-run` names them; nothing when `view` is None:
    the running state was not read)."""
    if view is None:
        return []
    out: list[str] = []
    retired_domains = {e.domain for e in events if isinstance(e, DomainRetired)}
    for dname, dv in view.domains.items():
        where = "the ACTIVE domain " + dname if dname == active else dname
        for mname, mv in dv.models.items():
            state = state_name(mv.residency)
            if state not in _RUNNING:
                continue
            serving = "serving" if dname == active and state == "resident" else state
            if dname in retired_domains:
                out.append(f"{dname}/{mname} ({serving}) stops: the domain is retired from the layout")
                continue
            for e in events:
                if isinstance(e, ModelRetired) and (e.domain, e.model) == (dname, mname):
                    out.append(f"{dname}/{mname} ({serving}) stops: retired from the layout")
                elif (
                    isinstance(e, AdmissionDecided)
                    and e.kind == "model"
                    and (e.domain, e.name) == (dname, mname)
                    and not e.admitted
                ):
                    out.append(
                        f"{dname}/{mname} ({serving}) is unloaded and left unadmitted on {where}: no longer admitted, "
                        f"short by {format_gib(e.short_by_bytes)} on GPU {e.gpu_index} (first fit in declaration "
                        f"order: what is declared before it now takes the room); requests get 409 model_not_admitted"
                    )
    return out
