"""The fleet fold's declarations: what `haru apply` wrote on `haru.evt.<fleet>.decl`. Pure.

    fleet_declared, policy_changed          -> `FleetView.policy`, `uuid`
    domain_declared/changed/retired         -> `domains` (declared GPUs in declared order; observed ones kept)
    model_declared/changed/retired          -> `DomainView.models`
    training_declared/changed/retired       -> `DomainView.training`
    admission_decided                       -> the planner's verdict on a model or slot (a refused model
                                               moves to not_admitted through `haru.core.residency`)

Each handler takes `(view, event, seq)` and returns the new view; `haru.core.fold` dispatches to
them and sets `seq`, `updated_at` and `decl_seq` itself.
"""

from __future__ import annotations

from typing import Any

import msgspec

from haru.core import events as ev
from haru.core import residency
from haru.core.errors import IllegalTransition
from haru.core.fold_anomalies import anomaly, missing
from haru.core.specs import DomainSpec, ModelSpec, TrainingSpec, fleet_uuid
from haru.core.views import DomainView, FleetView, GpuView, ModelView, TrainingView

_replace = msgspec.structs.replace


def with_domain(view: FleetView, domain: DomainView) -> FleetView:
    domains = dict(view.domains)
    domains[domain.name] = domain
    return _replace(view, domains=domains)


def _gpus_from_spec(spec: DomainSpec, existing: list[GpuView]) -> list[GpuView]:
    """Declared GPUs in declared order, keeping what was observed; observed-only GPUs are kept."""
    by_index = {g.index: g for g in existing}
    declared: list[GpuView] = []
    for g in spec.gpus:
        old = by_index.pop(g.index, None)
        if old is None:
            declared.append(
                GpuView(index=g.index, memory_bytes=g.memory_bytes, reserve_bytes=g.reserve_bytes, name=g.name)
            )
        else:
            declared.append(
                _replace(old, memory_bytes=g.memory_bytes, reserve_bytes=g.reserve_bytes, name=g.name or old.name)
            )
    # GPUs that are observed but no longer (or never) declared: keep them, without declared sizes.
    for old in sorted(by_index.values(), key=lambda g: g.index):
        if old.present is not None or old.observed_at is not None:
            declared.append(_replace(old, memory_bytes=0, reserve_bytes=0))
    return declared


def _model_from_spec(spec: ModelSpec, old: ModelView | None) -> ModelView:
    fields: dict[str, Any] = dict(
        name=spec.name,
        slot=spec.slot,
        gpu_index=spec.gpu_index,
        runtime=spec.runtime,
        vram_bytes=spec.vram_bytes,
        port=spec.port,
        url=spec.url,
        adapters=sorted(spec.adapters),
        max_loras=spec.max_loras,
        adapter_probes=dict(spec.adapter_probes),
    )
    if old is None:
        return ModelView(**fields)
    return _replace(old, **fields)


def _training_from_spec(spec: TrainingSpec, old: TrainingView | None) -> TrainingView:
    if old is None:
        return TrainingView(slot=spec.slot, gpu_index=spec.gpu_index, vram_bytes=spec.vram_bytes)
    return _replace(old, gpu_index=spec.gpu_index, vram_bytes=spec.vram_bytes)


def fleet_declared(view: FleetView, e: ev.FleetDeclared, seq: int) -> FleetView:
    return _replace(view, policy=e.policy, uuid=e.uuid or fleet_uuid(view.fleet))


def policy_changed(view: FleetView, e: ev.PolicyChanged, seq: int) -> FleetView:
    return _replace(view, policy=e.policy)


def domain_declared(view: FleetView, e: ev.DomainDeclared | ev.DomainChanged, seq: int) -> FleetView:
    spec = e.spec
    old = view.domains.get(spec.name)
    if old is None:
        domain = DomainView(
            name=spec.name,
            provider=spec.provider,
            region=spec.region,
            serving_url=spec.serving_url,
            serve=spec.serve,
            gpus=_gpus_from_spec(spec, []),
            host_ram_bytes=spec.host_ram_bytes,
            host_ram_reserve_bytes=spec.host_ram_reserve_bytes,
        )
    else:
        domain = _replace(
            old,
            provider=spec.provider,
            region=spec.region,
            serving_url=spec.serving_url,
            serve=spec.serve,
            gpus=_gpus_from_spec(spec, old.gpus),
            host_ram_bytes=spec.host_ram_bytes,
            host_ram_reserve_bytes=spec.host_ram_reserve_bytes,
        )
    return with_domain(view, domain)


def domain_retired(view: FleetView, e: ev.DomainRetired, seq: int) -> FleetView:
    if e.domain not in view.domains:
        return missing(view, seq, "domain_retired", f"domain {e.domain!r}")
    domains = {k: d for k, d in view.domains.items() if k != e.domain}
    return _replace(view, domains=domains)


def model_declared(view: FleetView, e: ev.ModelDeclared | ev.ModelChanged, seq: int) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None:
        return missing(view, seq, ev.tag_of(e), f"model {e.spec.name!r} on domain {e.domain!r}")
    models = dict(domain.models)
    models[e.spec.name] = _model_from_spec(e.spec, models.get(e.spec.name))
    return with_domain(view, _replace(domain, models=models))


def model_retired(view: FleetView, e: ev.ModelRetired, seq: int) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None or e.model not in domain.models:
        return missing(view, seq, "model_retired", f"model {e.model!r} on domain {e.domain!r}")
    models = {k: m for k, m in domain.models.items() if k != e.model}
    return with_domain(view, _replace(domain, models=models))


def training_declared(view: FleetView, e: ev.TrainingDeclared | ev.TrainingChanged, seq: int) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None:
        return missing(view, seq, ev.tag_of(e), f"training slot {e.spec.slot!r} on domain {e.domain!r}")
    training = dict(domain.training)
    training[e.spec.slot] = _training_from_spec(e.spec, training.get(e.spec.slot))
    return with_domain(view, _replace(domain, training=training))


def training_retired(view: FleetView, e: ev.TrainingRetired, seq: int) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None or e.slot not in domain.training:
        return missing(view, seq, "training_retired", f"training slot {e.slot!r} on domain {e.domain!r}")
    training = {k: t for k, t in domain.training.items() if k != e.slot}
    return with_domain(view, _replace(domain, training=training))


def admission_decided(view: FleetView, e: ev.AdmissionDecided, seq: int, subject: str) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None:
        return missing(view, seq, "admission_decided", f"{e.kind} {e.name!r} on domain {e.domain!r}")
    if e.kind == "training":
        slot = domain.training.get(e.name)
        if slot is None:
            return missing(view, seq, "admission_decided", f"training slot {e.name!r} on domain {e.domain!r}")
        training = dict(domain.training)
        training[e.name] = _replace(
            slot,
            gpu_index=e.gpu_index,
            vram_bytes=e.vram_bytes,
            admitted=e.admitted,
            short_by_bytes=0 if e.admitted else e.short_by_bytes,
            short_of=e.resource,
            host_ram_bytes=e.host_ram_bytes,
        )
        return with_domain(view, _replace(domain, training=training))
    model = domain.models.get(e.name)
    if model is None:
        return missing(view, seq, "admission_decided", f"model {e.name!r} on domain {e.domain!r}")
    # The planner's verdict is part of the residency table: refused -> not_admitted (with the
    # shortfall), admitted -> keeps what was observed (or unknown, after a refusal).
    try:
        state = residency.evolve(model.residency, e, seq=seq, subject=subject)
    except IllegalTransition as exc:  # pragma: no cover - the table accepts a verdict in every state
        state = residency.to_state(e, seq=seq)
        view = anomaly(view, f"seq {seq}: {exc}")
    model = _replace(
        model,
        gpu_index=e.gpu_index,
        vram_bytes=e.vram_bytes,
        admitted=e.admitted,
        short_by_bytes=0 if e.admitted else e.short_by_bytes,
        residency=state,
        short_of=e.resource,
        host_ram_bytes=e.host_ram_bytes,
        gpu_indexes=list(e.gpu_indexes),
    )
    models = dict(domain.models)
    models[e.name] = model
    return with_domain(view, _replace(domain, models=models))
