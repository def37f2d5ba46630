"""The fleet fold: `HARU_EVENTS` -> one `FleetView` per fleet. Pure: no I/O, no clock, no logging.

    view = evolve(view, event, seq=record.seq, subject=record.subject)
    views = fold([(seq, subject, event), ...], views)

`evolve` handles every event type in `haru.core.events.AnyEvent`:

    declarations   fleet_declared, policy_changed, domain_*, model_*, training_* (declared,
                   changed, retired) and admission_decided build `domains`, their `models` and
                   `training`, in declaration order
    residency      model_loading .. model_stopped move `ModelView.residency` through
                   `haru.core.residency.evolve`; an illegal transition found in the log is folded
                   leniently (the state the event establishes, `haru.core.residency.to_state`) and
                   counted in `anomalies`: the log is what the agent observed
    GPUs           gpu_observed -> the observed fields of `GpuView` (a GPU observed but never
                   declared is added, in index order)
    training       training_started/stopped -> `TrainingView`
    agent          agent_started/stopping -> `AgentView`
    liveness       domain_unreachable/reachable -> `DomainView.reachable`
    operations     every kind's request (ev.OPERATION_REQUESTS), step_*, operation_completed/aborted ->
                   `operation` (in flight) and `last_operation` (finished), with their steps
    decisions      failover_declined -> `declined`; eligibility_changed -> `eligible`
    route pointer  route_moved -> `active`, `route_revision` (= its stream sequence), `route_moved_at`;
                   it resets the traffic weights (the new active takes everything)
    weights        weights_set -> `weights` (the fleet's split) or `model_weights[model]`, and
                   `weights_change` (why, by whom, a rollback's evidence); haru.core.weights

Every event sets `view.seq` (the last stream sequence folded) and `updated_at` (its `at`); events on
the fleet-level subjects also set `decl_seq`, `op_seq` or `route_seq`.

An event that may not stand on the subject it was stored on (`haru.core.authority`: a `route_moved`
anywhere but `haru.evt.<fleet>.route`, a `model_lost` whose body names another domain than its
subject) is NOT applied: it only bumps `seq` (and `decl_seq`/`op_seq`/`route_seq` on those
subjects, which are the subjects' real last sequences) and is counted in `anomalies`, with
`last_anomaly` naming its sequence, subject and writer. The subject is the authority, not the body.

Events about a domain, model or training slot that is not declared (never declared, or retired)
are NOT folded into the view: they only bump `seq` and are counted in `anomalies` with
`last_anomaly` saying which. Creating entries lazily would resurrect a retired model when its
agent reports it stopped after the retirement, which is the normal order of things.
A GPU index that was not declared is different: it is an observed fact about the host, and is shown.

Events at or below a view's `seq` are skipped by `fold` (not by `evolve`), so replaying a log
from before a stored view's sequence is idempotent.

There is one fold: `Folder`, incremental, and `evolve` is its specification. `add` stages residency
events (the bulk of a log) per (domain, model) in a mutable accumulator instead of building a new
frozen view per event, and `view()` materializes the view only when something reads it. Every
other event materializes first and goes through `evolve`. The projector, the promoter, `haru
promote`'s reads and `fold` all fold with it (`add_one` for a dict of fleets); `evolve` is what the
tests hold it to: `Folder(v).add(...)...view()` equals folding the same events with `evolve`, event
by event (tests/unit/test_fold_incremental.py proves it on random histories, legal and not,
materialized at random points). Subjects are read by `haru.core.subjects.read` (memoized).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from haru.core import authority, residency, subjects
from haru.core import events as ev
from haru.core.errors import IllegalTransition
from haru.core.specs import DomainSpec, ModelSpec, TrainingSpec, fleet_uuid
from haru.core.subjects import fleet_of
from haru.core.views import (
    AgentView,
    DomainView,
    FleetView,
    GpuView,
    ModelView,
    OperationView,
    StepView,
    TrainingView,
    TriedView,
    WeightsChange,
)

__all__ = [
    "HANDLED",
    "Folder",
    "add_one",
    "empty",
    "evolve",
    "fleet_of",
    "fold",
    "invalid",
    "misplaced",
]

_replace = msgspec.structs.replace


def empty(fleet: str) -> FleetView:
    """The view of a fleet before any event."""
    return FleetView(fleet=fleet)


def _kind(subject: str) -> str:
    # The fourth token names the fleet-level subjects; that is all `evolve` needs from a subject.
    return subjects.read(subject).level


# ------------------------------------------------------------------------------------ helpers


def _anomaly(view: FleetView, why: str, at: Any = None, about: str = "") -> FleetView:
    """One more anomaly: `why` names it, `at` is when it was observed, `about` what can clear it
    (`<domain>/<model>`; '' = nothing: a misplaced or undecodable body stays in the log)."""
    return _replace(
        view,
        anomalies=view.anomalies + 1,
        last_anomaly=why,
        last_anomaly_at=at if at is not None else view.updated_at,
        anomaly_about=about,
        anomaly_cleared_at=None,
    )


def _anomaly_cleared(view: FleetView, about: str, at: Any) -> FleetView:
    """The open anomaly about `about` (a model) is over: its next event folded legally."""
    if view.anomaly_about != about or view.anomaly_cleared_at is not None:
        return view
    return _replace(view, anomaly_cleared_at=at)


def _recovered(domain: DomainView) -> bool:
    """The domain would be a healthy active: heard from, its hosting GPUs present, no served model
    lost or failed (the promoter's `active_health` 'ok', without the clock)."""
    if domain.reachable is False:
        return False
    served = [m for m in domain.models.values() if m.admitted is not False]
    hosting = {m.gpu_index for m in served}
    if any(g.present is False and g.index in hosting for g in domain.gpus):
        return False
    return not any(isinstance(m.residency, (residency.Lost, residency.Failed)) for m in served)


def _decline_over(view: FleetView, event: Any) -> FleetView:
    """A declined failover stays on screen while its cause lasts: an event about the declined domain
    that leaves it healthy clears it."""
    if not view.declined or getattr(event, "domain", None) != view.declined_domain:
        return view
    domain = view.domains.get(view.declined_domain)
    if domain is not None and not _recovered(domain):
        return view
    return _replace(view, declined="", declined_at=None, declined_domain="")


def _with_domain(view: FleetView, domain: DomainView) -> FleetView:
    domains = dict(view.domains)
    domains[domain.name] = domain
    return _replace(view, domains=domains)


def _missing(view: FleetView, seq: int, tag: str, what: str, at: Any = None, about: str = "") -> FleetView:
    return _anomaly(view, f"seq {seq}: {tag} for {what}, which is not declared", at, about)


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
    )
    if old is None:
        return ModelView(**fields)
    return _replace(old, **fields)


def _training_from_spec(spec: TrainingSpec, old: TrainingView | None) -> TrainingView:
    if old is None:
        return TrainingView(slot=spec.slot, gpu_index=spec.gpu_index, vram_bytes=spec.vram_bytes)
    return _replace(old, gpu_index=spec.gpu_index, vram_bytes=spec.vram_bytes)


# ------------------------------------------------------------------------------ declarations


def _fleet_declared(view: FleetView, e: ev.FleetDeclared, seq: int) -> FleetView:
    return _replace(view, policy=e.policy, uuid=e.uuid or fleet_uuid(view.fleet))


def _policy_changed(view: FleetView, e: ev.PolicyChanged, seq: int) -> FleetView:
    return _replace(view, policy=e.policy)


def _domain_declared(view: FleetView, e: ev.DomainDeclared | ev.DomainChanged, seq: int) -> FleetView:
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
    return _with_domain(view, domain)


def _domain_retired(view: FleetView, e: ev.DomainRetired, seq: int) -> FleetView:
    if e.domain not in view.domains:
        return _missing(view, seq, "domain_retired", f"domain {e.domain!r}")
    domains = {k: d for k, d in view.domains.items() if k != e.domain}
    return _replace(view, domains=domains)


def _model_declared(view: FleetView, e: ev.ModelDeclared | ev.ModelChanged, seq: int) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None:
        return _missing(view, seq, ev.tag_of(e), f"model {e.spec.name!r} on domain {e.domain!r}")
    models = dict(domain.models)
    models[e.spec.name] = _model_from_spec(e.spec, models.get(e.spec.name))
    return _with_domain(view, _replace(domain, models=models))


def _model_retired(view: FleetView, e: ev.ModelRetired, seq: int) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None or e.model not in domain.models:
        return _missing(view, seq, "model_retired", f"model {e.model!r} on domain {e.domain!r}")
    models = {k: m for k, m in domain.models.items() if k != e.model}
    return _with_domain(view, _replace(domain, models=models))


def _training_declared(view: FleetView, e: ev.TrainingDeclared | ev.TrainingChanged, seq: int) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None:
        return _missing(view, seq, ev.tag_of(e), f"training slot {e.spec.slot!r} on domain {e.domain!r}")
    training = dict(domain.training)
    training[e.spec.slot] = _training_from_spec(e.spec, training.get(e.spec.slot))
    return _with_domain(view, _replace(domain, training=training))


def _training_retired(view: FleetView, e: ev.TrainingRetired, seq: int) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None or e.slot not in domain.training:
        return _missing(view, seq, "training_retired", f"training slot {e.slot!r} on domain {e.domain!r}")
    training = {k: t for k, t in domain.training.items() if k != e.slot}
    return _with_domain(view, _replace(domain, training=training))


def _admission_decided(view: FleetView, e: ev.AdmissionDecided, seq: int, subject: str) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None:
        return _missing(view, seq, "admission_decided", f"{e.kind} {e.name!r} on domain {e.domain!r}")
    if e.kind == "training":
        slot = domain.training.get(e.name)
        if slot is None:
            return _missing(view, seq, "admission_decided", f"training slot {e.name!r} on domain {e.domain!r}")
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
        return _with_domain(view, _replace(domain, training=training))
    model = domain.models.get(e.name)
    if model is None:
        return _missing(view, seq, "admission_decided", f"model {e.name!r} on domain {e.domain!r}")
    # The planner's verdict is part of the residency table: refused -> not_admitted (with the
    # shortfall), admitted -> keeps what was observed (or unknown, after a refusal).
    try:
        state = residency.evolve(model.residency, e, seq=seq, subject=subject)
    except IllegalTransition as exc:  # pragma: no cover - the table accepts a verdict in every state
        state = residency.to_state(e, seq=seq)
        view = _anomaly(view, f"seq {seq}: {exc}")
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
    return _with_domain(view, _replace(domain, models=models))


# ---------------------------------------------------------------------------------- residency


def _residency(view: FleetView, e: Any, seq: int, subject: str) -> FleetView:
    # The hot path of a replay (most events are residency): one replace per level, seq included,
    # and none below the view when the state did not change (a re-observed sleeping, a retried wake).
    domains = view.domains
    domain = domains.get(e.domain)
    model = domain.models.get(e.model) if domain is not None else None
    if domain is None or model is None:
        return _replace(
            _missing(
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
        view = _anomaly(view, f"seq {seq}: {exc}", e.at, f"{e.domain}/{e.model}")
    else:
        view = _anomaly_cleared(view, f"{e.domain}/{e.model}", e.at)
    if state is old:
        return _decline_over(_replace(view, seq=seq, updated_at=e.at), e)
    models = dict(domain.models)
    models[e.model] = _replace(model, residency=state, **_measured(old, e))
    domains = dict(domains)
    domains[domain.name] = _replace(domain, models=models)
    return _decline_over(_replace(view, domains=domains, seq=seq, updated_at=e.at), e)


def _measured(old: Any, e: Any) -> dict[str, int]:
    """What a residency event measured: a `model_resident` after waking is the wake (and probe) time, after
    loading the cold warm-up (`ModelView.wake_ms` / `load_ms`, read by the promoter's faster path and the
    gateway's hold)."""
    if type(e) is not ev.ModelResident:
        return {}
    kind = _MEASURES.get(type(old))
    return {kind: e.warmup_ms} if kind is not None and e.warmup_ms else {}


_MEASURES: dict[type, str] = {residency.Waking: "wake_ms", residency.Loading: "load_ms"}


# ------------------------------------------------------------------------------- GPUs, training


def _gpu_observed(view: FleetView, e: ev.GpuObserved, seq: int) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None:
        return _missing(view, seq, "gpu_observed", f"GPU {e.index} on domain {e.domain!r}")
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
    return _with_domain(view, _replace(domain, gpus=gpus))


def _training_slot(view: FleetView, e: Any) -> tuple[DomainView, TrainingView] | None:
    domain = view.domains.get(e.domain)
    if domain is None:
        return None
    slot = domain.training.get(e.slot)
    if slot is None:
        return None
    return domain, slot


def _training_started(view: FleetView, e: ev.TrainingStarted, seq: int) -> FleetView:
    found = _training_slot(view, e)
    if found is None:
        return _missing(view, seq, "training_started", f"training slot {e.slot!r} on domain {e.domain!r}")
    domain, slot = found
    training = dict(domain.training)
    training[e.slot] = _replace(slot, running=True, pid=e.pid, gpu_index=e.gpu_index, since=e.at)
    return _with_domain(view, _replace(domain, training=training))


def _training_stopped(view: FleetView, e: ev.TrainingStopped, seq: int) -> FleetView:
    found = _training_slot(view, e)
    if found is None:
        return _missing(view, seq, "training_stopped", f"training slot {e.slot!r} on domain {e.domain!r}")
    domain, slot = found
    training = dict(domain.training)
    training[e.slot] = _replace(slot, running=False, pid=0, since=e.at, last_stop=e.how, last_exit_code=e.exit_code)
    return _with_domain(view, _replace(domain, training=training))


# ------------------------------------------------------------------------------ agent, liveness


def _agent_started(view: FleetView, e: ev.AgentStarted, seq: int) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None:
        return _missing(view, seq, "agent_started", f"domain {e.domain!r}")
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
    return _with_domain(view, _replace(domain, agent=agent, signalled="", signalled_at=None, signalled_seq=0))


def _failure_signalled(view: FleetView, e: ev.FailureSignalled, seq: int) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None:
        return _missing(view, seq, "failure_signalled", f"domain {e.domain!r}")
    what = f"{e.source}: {e.detail}" if e.detail else e.source
    return _with_domain(view, _replace(domain, signalled=what, signalled_at=e.at, signalled_seq=seq))


def _agent_stopping(view: FleetView, e: ev.AgentStopping, seq: int) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None:
        return _missing(view, seq, "agent_stopping", f"domain {e.domain!r}")
    return _with_domain(view, _replace(domain, agent=_replace(domain.agent, running=False, since=e.at)))


def _reachability(view: FleetView, e: ev.DomainUnreachable | ev.DomainReachable, seq: int) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None:
        return _missing(view, seq, ev.tag_of(e), f"domain {e.domain!r}")
    reachable = isinstance(e, ev.DomainReachable)
    return _with_domain(view, _replace(domain, reachable=reachable, reachability_since=e.at))


def _eligibility(view: FleetView, e: ev.EligibilityChanged, seq: int) -> FleetView:
    domain = view.domains.get(e.domain)
    if domain is None:
        return _missing(view, seq, "eligibility_changed", f"domain {e.domain!r}")
    return _with_domain(
        view, _replace(domain, eligible=e.eligible, ineligible_why="" if e.eligible else e.why, eligibility_since=e.at)
    )


# ----------------------------------------------------------------------------------- operations


def _operation_requested(view: FleetView, e: ev.OperationRequested, seq: int) -> FleetView:
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
        view = _anomaly(view, f"seq {seq}: {op.kind} {op.op_id} requested while {view.operation.op_id} was in flight")
    if op.kind == "promotion":  # the failover that was declined goes ahead: the operation says the rest
        view = _replace(view, declined="", declined_at=None, declined_domain="")
    return _replace(view, operation=op)


def _current_op(view: FleetView, op_id: str) -> OperationView | None:
    op = view.operation
    if op is None or op.op_id != op_id:
        return None
    return op


def _step_started(view: FleetView, e: ev.StepStarted, seq: int) -> FleetView:
    op = _current_op(view, e.op_id)
    if op is None:
        return _missing(view, seq, "step_started", f"operation {e.op_id!r} (not in flight)")
    step = StepView(step=e.step, state="started", attempt=e.attempt, at=e.at, seq=seq)
    return _replace(view, operation=_replace(op, steps=[*op.steps, step]))


def _step_ended(view: FleetView, e: ev.StepCompleted | ev.StepFailed, seq: int) -> FleetView:
    tag = ev.tag_of(e)
    op = _current_op(view, e.op_id)
    if op is None:
        return _missing(view, seq, tag, f"operation {e.op_id!r} (not in flight)")
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


def _promotion_retargeted(view: FleetView, e: ev.PromotionRetargeted, seq: int) -> FleetView:
    """A cascading promotion moves on: the standby it leaves goes to `tried`, its steps start afresh."""
    op = _current_op(view, e.op_id)
    if op is None:
        return _missing(view, seq, "promotion_retargeted", f"operation {e.op_id!r} (not in flight)")
    attempt = op.steps[-1].attempt if op.steps else 0
    tried = TriedView(target=op.target, step=e.step, attempt=attempt, error=e.error, at=e.at, seq=seq)
    return _replace(view, operation=_replace(op, target=e.target, steps=[], tried=[*op.tried, tried]))


def _operation_completed(view: FleetView, e: ev.OperationCompleted, seq: int) -> FleetView:
    op = _current_op(view, e.op_id)
    if op is None:
        return _missing(view, seq, "operation_completed", f"operation {e.op_id!r} (not in flight)")
    done = _replace(op, state="completed", finished_at=e.at)
    return _replace(view, operation=None, last_operation=done)


def _operation_aborted(view: FleetView, e: ev.OperationAborted, seq: int) -> FleetView:
    op = _current_op(view, e.op_id)
    if op is None:
        return _missing(view, seq, "operation_aborted", f"operation {e.op_id!r} (not in flight)")
    error = f"{e.step}: {e.error}" if e.step and e.error else (e.error or e.step)
    done = _replace(op, state="aborted", finished_at=e.at, error=error)
    return _replace(view, operation=None, last_operation=done)


def _failover_declined(view: FleetView, e: ev.FailoverDeclined, seq: int) -> FleetView:
    return _replace(view, declined=e.why, declined_at=e.at, declined_domain=e.domain)


def _route_moved(view: FleetView, e: ev.RouteMoved, seq: int) -> FleetView:
    # The route moved: whatever failover was declined before is history now. The domain it left
    # remembers when (it then ranks after the standbys that never lost the role: haru.core.ranking).
    old = view.domains.get(view.active) if view.active and view.active != e.active else None
    if old is not None:
        view = _with_domain(view, _replace(old, left_active_seq=seq))
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


def _weights_set(view: FleetView, e: ev.WeightsSet, seq: int) -> FleetView:
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


# --------------------------------------------------------------------------------------- table

# Event type -> how it changes the view. Residency events are handled by `_residency`.
_HANDLERS: dict[type, Callable[[FleetView, Any, int], FleetView]] = {
    ev.FleetDeclared: _fleet_declared,
    ev.PolicyChanged: _policy_changed,
    ev.DomainDeclared: _domain_declared,
    ev.DomainChanged: _domain_declared,
    ev.DomainRetired: _domain_retired,
    ev.ModelDeclared: _model_declared,
    ev.ModelChanged: _model_declared,
    ev.ModelRetired: _model_retired,
    ev.TrainingDeclared: _training_declared,
    ev.TrainingChanged: _training_declared,
    ev.TrainingRetired: _training_retired,
    ev.GpuObserved: _gpu_observed,
    ev.TrainingStarted: _training_started,
    ev.TrainingStopped: _training_stopped,
    ev.AgentStarted: _agent_started,
    ev.AgentStopping: _agent_stopping,
    ev.FailureSignalled: _failure_signalled,
    ev.DomainUnreachable: _reachability,
    ev.DomainReachable: _reachability,
    **{cls: _operation_requested for cls in ev.OPERATION_REQUESTS.values()},
    ev.StepStarted: _step_started,
    ev.StepCompleted: _step_ended,
    ev.StepFailed: _step_ended,
    ev.PromotionRetargeted: _promotion_retargeted,
    ev.OperationCompleted: _operation_completed,
    ev.OperationAborted: _operation_aborted,
    ev.FailoverDeclined: _failover_declined,
    ev.EligibilityChanged: _eligibility,
    ev.RouteMoved: _route_moved,
    ev.WeightsSet: _weights_set,
    ev.ModelFetched: lambda view, e, seq: view,  # provenance of model files: history (`haru why`), not state
    ev.Checkpoint: lambda view, e, seq: view,  # a record of where history stood: it changes no fact
}
_RESIDENCY = frozenset(ev.RESIDENCY_EVENTS)
# Events about a domain after which a declined failover of that domain may be over (it is healthy).
_RECOVERY = frozenset({ev.DomainReachable, ev.GpuObserved, ev.AgentStarted})

HANDLED: frozenset[type] = frozenset(_HANDLERS) | _RESIDENCY | {ev.AdmissionDecided}
"""Every event type the fold understands (the tests check this is all of `AnyEvent`)."""


def evolve(view: FleetView, event: ev.Event, *, seq: int, subject: str) -> FleetView:
    """The view after one event recorded at stream sequence `seq` on `subject` (a misplaced one is
    not applied: see `misplaced`)."""
    why = authority.misplaced(subject, event)
    if why:
        return misplaced(view, event, seq=seq, subject=subject, why=why)
    return _evolve(view, event, seq, subject, _kind(subject))


def _evolve(view: FleetView, event: ev.Event, seq: int, subject: str, kind: str) -> FleetView:
    cls = type(event)
    if cls in _RESIDENCY:
        return _residency(view, event, seq, subject)  # sets seq and updated_at itself
    if isinstance(event, ev.AdmissionDecided):
        out = _admission_decided(view, event, seq, subject)
    else:
        handler = _HANDLERS.get(cls)
        out = (
            handler(view, event, seq)
            if handler is not None
            else _anomaly(view, f"seq {seq}: event type {cls.__name__} is not known to this projector", event.at)
        )
        if out.anomalies != view.anomalies and out.last_anomaly_at is not event.at:
            out = _replace(out, last_anomaly_at=event.at)
        if cls in _RECOVERY:
            out = _decline_over(out, event)
        elif isinstance(event, (ev.ModelDeclared, ev.ModelChanged)):
            out = _anomaly_cleared(out, f"{event.domain}/{event.spec.name}", event.at)
    if kind == "decl":
        return _replace(out, seq=seq, updated_at=event.at, decl_seq=seq)
    if kind == "op":
        return _replace(out, seq=seq, updated_at=event.at, op_seq=seq)
    if kind == "route":
        return _replace(out, seq=seq, updated_at=event.at, route_seq=seq)
    if kind == "weights":
        return _replace(out, seq=seq, updated_at=event.at, weights_seq=seq)
    return _replace(out, seq=seq, updated_at=event.at)


def _stored_on(view: FleetView, seq: int, kind: str) -> FleetView:
    # Something was stored at `seq` on a subject of `kind` without being applied: the view's
    # position moves, and so does the fleet-level subject's last sequence (what a writer expects).
    if kind == "decl":
        return _replace(view, seq=seq, decl_seq=seq)
    if kind == "op":
        return _replace(view, seq=seq, op_seq=seq)
    if kind == "route":
        return _replace(view, seq=seq, route_seq=seq)
    if kind == "weights":
        return _replace(view, seq=seq, weights_seq=seq)
    return _replace(view, seq=seq)


def invalid(view: FleetView, *, seq: int, subject: str, error: str) -> FleetView:
    """The view after a body on one of its subjects that is not a valid event: skipped, counted."""
    first = error.splitlines()[0] if error else "not a valid event"
    return _stored_on(_anomaly(view, f"seq {seq}: body on {subject} skipped: {first}"), seq, _kind(subject))


def misplaced(view: FleetView, event: ev.Event, *, seq: int, subject: str, why: str) -> FleetView:
    """The view after an event that may not stand on `subject` (`haru.core.authority.misplaced` said
    `why`): not applied, counted, and named in `last_anomaly` with its sequence, subject and writer."""
    return _stored_on(_anomaly(view, authority.anomaly(seq, subject, event, why), event.at), seq, _kind(subject))


# ------------------------------------------------------------------------- incremental folding


class Folder:
    """One fleet's view, folded incrementally: `add` events, read `view()` when needed.

    Residency events (the hot path) only stage the model's new state, `seq`, `updated_at` and the
    anomaly count; `view()` applies what is staged (one copy of each touched domain's `models`,
    one of `domains`) and caches the result until the next `add`. Any other event, and a body that
    did not decode, materializes first and is folded by `evolve`/`invalid` as it is. The output is
    equal to `evolve`'s, event for event.
    """

    __slots__ = (
        "fleet",
        "seq",
        "misplaced_seq",
        "_view",
        "_staged",
        "_measured",
        "_at",
        "_anomalies",
        "_last_anomaly",
        "_anomaly_at",
        "_anomaly_about",
        "_anomaly_cleared_at",
        "_dirty",
    )

    def __init__(self, view: FleetView) -> None:
        self.fleet = view.fleet
        self.misplaced_seq = 0  # the sequence of the last misplaced event added (for the shell's log)
        self._reset(view)

    def _reset(self, view: FleetView) -> None:
        self._staged: dict[tuple[str, str], residency.Residency] = {}
        self._measured: dict[tuple[str, str], dict[str, int]] = {}  # `_measured` figures staged with them
        self._set(view)

    def _set(self, view: FleetView) -> None:
        # A view with nothing staged on top (the caller materialized first): take its scalars.
        self._view = view  # the materialized view, without what is staged
        self.seq = view.seq  # the last sequence added (what `add_one` compares against)
        self._at = view.updated_at
        self._anomalies = view.anomalies
        self._last_anomaly = view.last_anomaly
        self._anomaly_at = view.last_anomaly_at
        self._anomaly_about = view.anomaly_about
        self._anomaly_cleared_at = view.anomaly_cleared_at
        self._dirty = False  # something is staged that `_view` does not have

    def reset(self, view: FleetView) -> None:
        """Start over from `view` (an adopted view, a moved checkpoint); drops what is staged."""
        if view.fleet != self.fleet:
            raise ValueError(f"a view of fleet {view.fleet!r} given to the folder of {self.fleet!r}")
        self._reset(view)

    def view(self) -> FleetView:
        """The view after everything added so far."""
        if self._dirty:
            self._materialize()
        return self._view

    def add(self, event: ev.Event, *, seq: int, subject: str) -> None:
        """Fold one event recorded at `seq` on `subject` (like `evolve`: no skipping here)."""
        _, level, place, _ = subjects.read(subject)
        self._add(event, seq, subject, level, place)

    def _add(self, event: ev.Event, seq: int, subject: str, level: str, place: subjects.Where | None) -> None:
        if type(event) in _RESIDENCY:
            # The common case, the authority check inlined: a residency event stands on its own
            # model's subject (`authority.misplaced_at` says why when it does not).
            if (
                place is not None
                and place.kind == "model"
                and event.domain == place.domain  # type: ignore[attr-defined]
                and event.model == place.model  # type: ignore[attr-defined]
            ):
                if self._view.declined and event.domain == self._view.declined_domain:  # type: ignore[attr-defined]
                    self._set(_evolve(self.view(), event, seq, subject, level))  # may clear the decline
                else:
                    self._residency(event, seq, subject)
            else:
                self.add_misplaced(event, seq=seq, subject=subject, why=authority.misplaced_at(place, event))
            return
        why = authority.misplaced_at(place, event)
        if why:
            self.add_misplaced(event, seq=seq, subject=subject, why=why)
        else:
            self._set(_evolve(self.view(), event, seq, subject, level))

    def add_misplaced(self, event: ev.Event, *, seq: int, subject: str, why: str) -> None:
        """An event that may not stand on `subject` (see `misplaced`): counted, not applied."""
        self._set(misplaced(self.view(), event, seq=seq, subject=subject, why=why))
        self.misplaced_seq = seq

    def add_invalid(self, *, seq: int, subject: str, error: str) -> None:
        """A body on one of the fleet's subjects that is not a valid event (see `invalid`)."""
        self._set(invalid(self.view(), seq=seq, subject=subject, error=error))

    def _residency(self, e: Any, seq: int, subject: str) -> None:
        # `_residency` without the copies: the model's current state is the staged one, else the view's.
        key = (e.domain, e.model)
        old = self._staged.get(key)
        if old is None:
            domain = self._view.domains.get(e.domain)
            model = domain.models.get(e.model) if domain is not None else None
            if model is None:
                self._anomalies += 1
                self._last_anomaly = (
                    f"seq {seq}: {ev.tag_of(e)} for model {e.model!r} on domain {e.domain!r}, which is not declared"
                )
                self._anomaly_at, self._anomaly_about, self._anomaly_cleared_at = e.at, f"{e.domain}/{e.model}", None
                self.seq = seq
                self._at = e.at
                self._dirty = True
                return
            old = model.residency
        try:
            state = residency.evolve(old, e, seq=seq, subject=subject)
        except IllegalTransition as exc:
            state = residency.to_state(e, seq=seq)
            self._anomalies += 1
            self._last_anomaly = f"seq {seq}: {exc}"
            self._anomaly_at, self._anomaly_about, self._anomaly_cleared_at = e.at, f"{e.domain}/{e.model}", None
        else:
            if self._anomaly_cleared_at is None and self._anomaly_about == f"{e.domain}/{e.model}":
                self._anomaly_cleared_at = e.at
        if state is not old:
            self._staged[key] = state
            if type(e) is ev.ModelResident:
                measured = _measured(old, e)
                if measured:
                    self._measured.setdefault(key, {}).update(measured)
        self.seq = seq
        self._at = e.at
        self._dirty = True

    def _materialize(self) -> None:
        view = self._view
        staged = self._staged
        if staged:
            domains = dict(view.domains)
            touched: dict[str, dict[str, ModelView]] = {}
            for (d, m), state in staged.items():
                models = touched.get(d)
                if models is None:
                    models = touched[d] = dict(domains[d].models)
                models[m] = _replace(models[m], residency=state, **self._measured.get((d, m), {}))
            for d, models in touched.items():
                domains[d] = _replace(domains[d], models=models)
            staged.clear()
            self._measured.clear()
            view = _replace(view, domains=domains)
        self._view = _replace(
            view,
            seq=self.seq,
            updated_at=self._at,
            anomalies=self._anomalies,
            last_anomaly=self._last_anomaly,
            last_anomaly_at=self._anomaly_at,
            anomaly_about=self._anomaly_about,
            anomaly_cleared_at=self._anomaly_cleared_at,
        )
        self._dirty = False


def add_one(
    folders: dict[str, Folder], event: ev.Event | None, *, seq: int, subject: str, error: str = ""
) -> Folder | None:
    """Fold one event into `folders` (fleet -> Folder, updated in place): what every service folds with.

    Returns the fleet's folder, or None when the event was skipped: its subject names no fleet, or
    the fleet already folded `seq` (a replay from before the view's own checkpoint). `event=None` is
    a body that did not decode (`error` says why): it is counted, not folded.
    """
    fleet, level, place, _ = subjects.read(subject)
    if not fleet:
        return None
    folder = folders.get(fleet)
    if folder is None:
        folder = folders[fleet] = Folder(empty(fleet))
    elif seq <= folder.seq:
        return None
    if event is None:
        folder.add_invalid(seq=seq, subject=subject, error=error)
    else:
        folder._add(event, seq, subject, level, place)
    return folder


def fold(
    entries: Iterable[tuple[int, str, ev.Event | None]], views: Mapping[str, FleetView] | None = None
) -> dict[str, FleetView]:
    """Fold `(seq, subject, event)` entries, in stream order, into views keyed by fleet.

    Starts from `views` (not modified) or from nothing. Entries at or below a fleet's view `seq`
    are skipped, so folding a replay that overlaps the views is idempotent. An entry whose event is
    None (a body that did not decode) is counted in its fleet's anomalies.
    """
    out = dict(views) if views else {}
    folders = {fleet: Folder(view) for fleet, view in out.items()}
    for seq, subject, event in entries:
        add_one(folders, event, seq=seq, subject=subject)
    out.update((fleet, folder.view()) for fleet, folder in folders.items())
    return out
