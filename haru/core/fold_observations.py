"""The fleet fold's observations: what agents and the promoter saw of a domain. Pure.

    residency      model_loading .. model_stopped -> `ModelView.residency` (`residency_observed`, the
                   hot path of a replay; an illegal transition is folded leniently and counted)
    GPUs           gpu_observed -> the observed fields of `GpuView`
    training       training_started/stopped -> `TrainingView`
    agent          agent_started/stopping, failure_signalled -> `AgentView`, `DomainView.signalled`
    liveness       domain_unreachable/reachable -> `DomainView.reachable`
    eligibility    eligibility_changed -> `DomainView.eligible`

Each handler takes `(view, event, seq)` (residency also the subject) and returns the new view;
`haru.core.fold` dispatches to them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from haru.core import events as ev
from haru.core import residency
from haru.core.errors import IllegalTransition
from haru.core.fold_anomalies import anomaly, anomaly_cleared, decline_over, missing
from haru.core.fold_declarations import with_domain
from haru.core.views import AgentView, DomainView, FleetView, GpuView, TrainingView

_replace = msgspec.structs.replace


# ---------------------------------------------------------------------------------- residency


def residency_observed(view: FleetView, e: Any, seq: int, subject: str) -> FleetView:
    # The hot path of a replay (most events are residency): one replace per level, seq included,
    # and none below the view when the state did not change (a re-observed sleeping, a retried wake).
    domains = view.domains
    domain = domains.get(e.domain)
    model = domain.models.get(e.model) if domain is not None else None
    if domain is None or model is None:
        return _replace(
            missing(
                view, seq, ev.tag_of(e), f"model {e.model!r} on domain {e.domain!r}", e.at, f"{e.domain}/{e.model}"
            ),
            seq=seq,
            updated_at=e.at,
        )
    old = model.residency
    try:
        state = residency.evolve(old, e, seq=seq, subject=subject)
    except IllegalTransition as exc:
        # The log is what the agent observed: take the state the event establishes, and say so.
        state = residency.to_state(e, seq=seq)
        view = anomaly(view, f"seq {seq}: {exc}", e.at, f"{e.domain}/{e.model}")
    else:
        view = anomaly_cleared(view, f"{e.domain}/{e.model}", e.at)
    if state is old:
        return decline_over(_replace(view, seq=seq, updated_at=e.at), e)
    models = dict(domain.models)
    models[e.model] = _replace(model, residency=state, **measured(old, e))
    domains = dict(domains)
    domains[domain.name] = _replace(domain, models=models)
    return decline_over(_replace(view, domains=domains, seq=seq, updated_at=e.at), e)


def measured(old: Any, e: Any) -> dict[str, int]:
    """What a residency event measured: a `model_resident` after waking is the wake (and probe) time, after
    loading the cold warm-up (`ModelView.wake_ms` / `load_ms`, read by the promoter's faster path and the
    gateway's hold)."""
    if type(e) is not ev.ModelResident:
        return {}
    kind = _MEASURES.get(type(old))
    return {kind: e.warmup_ms} if kind is not None and e.warmup_ms else {}


_MEASURES: dict[type, str] = {residency.Waking: "wake_ms", residency.Loading: "load_ms"}


# ------------------------------------------------------------------------------- GPUs, training


def gpu_observed(view: FleetView, e: ev.GpuObserved, seq: int) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None:
        return missing(view, seq, "gpu_observed", f"GPU {e.index} on domain {e.domain!r}")
    gpus = list(domain.gpus)
    fields: dict[str, Any] = dict(
        present=e.present,
        memory_total_bytes=e.memory_total_bytes,
        memory_used_bytes=e.memory_used_bytes,
        processes=[p.pid for p in e.processes],
        mig=e.mig,
        observed_at=e.at,
        usage=list(e.usage),
        foreign=list(e.foreign),
        accounted=e.accounted,
    )
    for i, g in enumerate(gpus):
        if g.index == e.index:
            gpus[i] = _replace(g, name=g.name or e.name, **fields)
            break
    else:
        gpus.append(GpuView(index=e.index, name=e.name, **fields))
        gpus.sort(key=lambda g: g.index)
    return with_domain(view, _replace(domain, gpus=gpus))


def _training_slot(view: FleetView, e: Any) -> tuple[DomainView, TrainingView] | None:
    domain = view.domains.get(e.domain)
    if domain is None:
        return None
    slot = domain.training.get(e.slot)
    if slot is None:
        return None
    return domain, slot


def training_started(view: FleetView, e: ev.TrainingStarted, seq: int) -> FleetView:
    found = _training_slot(view, e)
    if found is None:
        return missing(view, seq, "training_started", f"training slot {e.slot!r} on domain {e.domain!r}")
    domain, slot = found
    training = dict(domain.training)
    training[e.slot] = _replace(slot, running=True, pid=e.pid, gpu_index=e.gpu_index, since=e.at)
    return with_domain(view, _replace(domain, training=training))


def training_stopped(view: FleetView, e: ev.TrainingStopped, seq: int) -> FleetView:
    found = _training_slot(view, e)
    if found is None:
        return missing(view, seq, "training_stopped", f"training slot {e.slot!r} on domain {e.domain!r}")
    domain, slot = found
    training = dict(domain.training)
    training[e.slot] = _replace(slot, running=False, pid=0, since=e.at, last_stop=e.how, last_exit_code=e.exit_code)
    return with_domain(view, _replace(domain, training=training))


# ------------------------------------------------------------------------------ agent, liveness


def agent_started(view: FleetView, e: ev.AgentStarted, seq: int) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None:
        return missing(view, seq, "agent_started", f"domain {e.domain!r}")
    agent = AgentView(
        running=True,
        host=e.host,
        pid=e.pid,
        version=e.version,
        serving_url=e.serving_url,
        since=e.at,
        host_ram_total_bytes=e.host_ram_total_bytes,
        host_ram_available_bytes=e.host_ram_available_bytes,
    )
    return with_domain(view, _replace(domain, agent=agent, signalled="", signalled_at=None, signalled_seq=0))


def failure_signalled(view: FleetView, e: ev.FailureSignalled, seq: int) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None:
        return missing(view, seq, "failure_signalled", f"domain {e.domain!r}")
    what = f"{e.source}: {e.detail}" if e.detail else e.source
    return with_domain(view, _replace(domain, signalled=what, signalled_at=e.at, signalled_seq=seq))


def agent_stopping(view: FleetView, e: ev.AgentStopping, seq: int) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None:
        return missing(view, seq, "agent_stopping", f"domain {e.domain!r}")
    return with_domain(view, _replace(domain, agent=_replace(domain.agent, running=False, since=e.at)))


def reachability(view: FleetView, e: ev.DomainUnreachable | ev.DomainReachable, seq: int) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None:
        return missing(view, seq, ev.tag_of(e), f"domain {e.domain!r}")
    reachable = isinstance(e, ev.DomainReachable)
    return with_domain(view, _replace(domain, reachable=reachable, reachability_since=e.at))


def eligibility(view: FleetView, e: ev.EligibilityChanged, seq: int) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None:
        return missing(view, seq, "eligibility_changed", f"domain {e.domain!r}")
    return with_domain(
        view, _replace(domain, eligible=e.eligible, ineligible_why="" if e.eligible else e.why, eligibility_since=e.at)
    )
