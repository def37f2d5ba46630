"""Which event caused which: the rules every producer applies to fill an event's `cause`.

Pure: the writers (agent, promoter, `haru apply`, the control API's requests) call these with what
they already know (the sequences they folded or appended) and set `cause` to the answer; `haru why`
and the tests read the same table (`EXPECTED`) to say where a link should exist and is missing.

`cause` is the stream sequence of the event that made this one happen (0 = none). Some events are
roots: an observation (a GPU reading, a runtime's exit, heartbeat silence, a runtime a restarted agent
found and adopted, a pull it started), an operator's request, a declaration, an agent's start. Everything else names
its cause:

| event | cites |
|---|---|
| `admission_decided` | the declaration it judges |
| `model_loading` | the `model_lost`/`model_failed` it restarts after; else the command's step; else `agent_started` |
| `model_resident` | the command's step after a wake; else the `model_loading`/`model_lost` before it |
| `model_waking`, `model_sleeping` | the command's step (`step_started`); else the event before it |
| `model_failed` | the `model_loading` (or `model_pulling`) that failed |
| `model_stopped` | `agent_stopping` on shutdown; else the command's step; else the event before it |
| `model_lost{gpu_detached}` | the `gpu_observed{present: false}` that showed the GPU gone |
| `training_started`, `training_stopped` | the command's step (or the loss a standby's restart makes room for); a trainer's own exit is a root |
| `domain_reachable` | the `domain_unreachable` it ends (or `agent_started`, the first time) |
| `promotion_requested`, `failover_declined` | the loss: `domain_unreachable`, the `model_lost` / `gpu_observed` of a detached GPU, the degraded model's `lost`/`failed` (or, for the faster path, the `model_loading` of its restart); a `failure_signalled` (preemption notice, GPU XID or ECC) for a planned move off a domain about to go; for the first route, the event that made the first domain ready; manual requests are roots |
| `demotion_requested` (automatic) | the residency event that made the standby awake or recovered |
| `replace_requested` (automatic), `teardown_requested` (a retry) | the last step of the operation before it (the failover's, or the failed teardown's) |
| `step_started` | the step event before it, or the request |
| `step_completed`, `step_failed` | their `step_started` |
| `operation_completed`, `operation_aborted`, `eligibility_changed` (settle) | the last step event |
| `route_moved` | the probe step's `step_completed` (the probe results it relied on) |
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from haru.core import events as ev
from haru.core import subjects
from haru.core.residency import Failed, Loading, Lost
from haru.core.views import FleetView, OperationView

# What each event type's cause must be (tags), when it has one. Types not listed are roots.
EXPECTED: dict[str, tuple[str, ...]] = {
    "admission_decided": ("model_declared", "model_changed", "training_declared", "training_changed"),
    "model_loading": ("model_lost", "model_failed", "step_started", "agent_started", "model_stopped"),
    "model_resident": (
        "step_started",
        "model_loading",
        "model_lost",
        "model_waking",
        "model_sleeping",
        "model_adopted",
    ),
    "model_waking": ("step_started", "model_sleeping", "model_adopted"),
    "model_sleeping": ("step_started", "model_resident", "model_waking", "model_loading", "model_adopted"),
    "model_failed": ("model_loading", "model_pulling"),
    "model_stopped": (
        "agent_stopping",
        "step_started",
        "model_resident",
        "model_sleeping",
        "model_loading",
        "model_lost",
        "model_waking",
        "model_failed",
        "model_adopted",
        "model_pulling",
    ),
    "model_lost": ("gpu_observed",),  # only for reason gpu_detached (`expects_cause`)
    "training_started": ("step_started", "agent_started"),
    "training_stopped": ("step_started", "agent_stopping", "model_lost", "model_failed"),
    "domain_reachable": ("domain_unreachable", "agent_started"),
    "promotion_requested": (
        "domain_unreachable",
        "model_lost",
        "model_failed",
        "gpu_observed",
        "model_resident",
        "model_sleeping",
        "model_waking",
        "domain_reachable",
        "failure_signalled",
        "model_loading",
    ),
    "failover_declined": ("domain_unreachable", "model_lost", "model_failed", "gpu_observed"),
    "demotion_requested": ("model_resident", "model_sleeping", "model_loading", "model_waking"),
    "replace_requested": ("step_completed", "step_failed"),
    "teardown_requested": ("step_completed", "step_failed"),
    "step_started": (
        "promotion_requested",
        "demotion_requested",
        "provision_requested",
        "teardown_requested",
        "replace_requested",
        "step_completed",
        "step_failed",
        "step_started",
        "promotion_retargeted",
    ),
    "promotion_retargeted": ("step_failed",),
    "step_completed": ("step_started",),
    "step_failed": ("step_started",),
    "operation_completed": ("step_completed", "step_failed", "step_started"),
    "operation_aborted": (
        "step_completed",
        "step_failed",
        "step_started",
        "promotion_requested",
        "demotion_requested",
        "provision_requested",
        "teardown_requested",
        "replace_requested",
    ),
    "eligibility_changed": ("step_completed", "step_failed", "step_started"),
    "route_moved": ("step_completed",),
}


def expects_cause(event: ev.Event) -> bool:
    """Whether production code must have set this event's cause (False for a root)."""
    tag = ev.tag_of(event)
    if tag not in EXPECTED:
        return False
    if isinstance(event, ev.ModelLost):
        return event.reason == "gpu_detached"
    if isinstance(event, ev.OperationRequested):
        return getattr(event, "reason", "manual") != "manual"
    if isinstance(event, ev.TrainingStopped):
        return event.how != "exited"  # a trainer that ended on its own is a root
    if isinstance(event, ev.TrainingStarted):
        return False  # started by a command, or by the agent's boot: both cited, neither required
    return True


def with_cause(event: ev.Event, cause: int) -> ev.Event:
    """The event with `cause` set (unchanged when it already names one, or when there is none)."""
    if not cause or event.cause:
        return event
    return msgspec.structs.replace(event, cause=cause)


# ------------------------------------------------------------------------------------ declarations


def declaration_seqs(pairs: Iterable[tuple[int, ev.Event]]) -> dict[tuple[str, str, str], int]:
    """(kind, domain, name) -> the sequence of its last declaration, from (seq, event) pairs."""
    out: dict[tuple[str, str, str], int] = {}
    for seq, e in pairs:
        if isinstance(e, (ev.ModelDeclared, ev.ModelChanged)):
            out[("model", e.domain, e.spec.name)] = seq
        elif isinstance(e, (ev.TrainingDeclared, ev.TrainingChanged)):
            out[("training", e.domain, e.spec.slot)] = seq
    return out


def admission_cause(event: ev.Event, declared: Mapping[tuple[str, str, str], int]) -> int:
    """`admission_decided` cites the declaration it judges."""
    if isinstance(event, ev.AdmissionDecided):
        return declared.get((event.kind, event.domain, event.name), 0)
    return 0


# ------------------------------------------------------------------------------------------- agent


def residency_cause(
    event: ev.Event, *, prev_tag: str, prev_seq: int, command: int, gpu_gone: int, agent: int, stopping: bool
) -> int:
    """The cause of a residency event the agent records.

    `prev_tag`/`prev_seq`: the model's last event (its state tag: lost, loading, ...). `command`:
    the `step_started` sequence of the command being answered (0 = none). `gpu_gone`: the
    `gpu_observed{present: false}` of the model's GPU (0 = none recorded). `agent`: the agent
    subject's last sequence (`agent_started`, or `agent_stopping` once `stopping`)."""
    if isinstance(event, ev.ModelLost):
        return gpu_gone if event.reason == "gpu_detached" else 0
    if isinstance(event, ev.ModelLoading):
        if prev_tag in ("lost", "failed") and prev_seq:
            return prev_seq
        return command or agent
    if isinstance(event, ev.ModelResident):
        if prev_tag == "waking" and command:
            return command
        return prev_seq
    if isinstance(event, (ev.ModelWaking, ev.ModelSleeping)):
        return command or prev_seq
    if isinstance(event, ev.ModelFailed):
        return prev_seq
    if isinstance(event, ev.ModelStopped):
        if stopping and agent:
            return agent
        return command or prev_seq
    return 0


def training_cause(event: ev.Event, *, command: int, agent: int, stopping: bool) -> int:
    if isinstance(event, ev.TrainingStopped):
        if event.how == "exited":
            return 0
        return command or (agent if stopping else 0)
    if isinstance(event, ev.TrainingStarted):
        return command or agent
    return 0


# ---------------------------------------------------------------------------------------- promoter


def _health_cause(view: FleetView, domain: str, reason: str, last: Mapping[str, int]) -> int:
    """The event that shows `domain` failed for `reason` (active_health's reasons)."""
    dv = view.domains.get(domain)
    if dv is None:
        return 0
    if reason == "domain_unreachable":
        return last.get(subjects.liveness(view.fleet, domain), 0)
    if reason == "gpu_detached":
        for mv in dv.models.values():
            if isinstance(mv.residency, Lost) and mv.residency.reason == "gpu_detached" and mv.residency.seq:
                return mv.residency.seq
        for gpu in dv.gpus:
            if gpu.present is False:
                return last.get(subjects.gpu(view.fleet, domain, gpu.index), 0)
        return 0
    # degraded: the oldest lost/failed model (the onset active_health measures from)
    worst = None
    for mv in dv.models.values():
        s = mv.residency
        if isinstance(s, (Lost, Failed)) and s.seq and (worst is None or (s.since, s.seq) < (worst.since, worst.seq)):
            worst = s
    if worst is None:  # the faster path: a model loading again after its loss (attempt > 1)
        for mv in dv.models.values():
            s = mv.residency
            if isinstance(s, Loading) and s.attempt > 1 and s.seq:
                return s.seq
    return worst.seq if worst is not None else 0


def _newest_model_seq(view: FleetView, domain: str) -> int:
    dv = view.domains.get(domain)
    if dv is None:
        return 0
    return max((mv.residency.seq for mv in dv.models.values()), default=0)


def _last_step_seq(op: OperationView | None) -> int:
    if op is None:
        return 0
    seqs = [s.seq for s in op.steps if s.seq]
    if not seqs and op.tried:  # a cascading promotion that just moved on: its first step follows the move
        return op.tried[-1].seq or op.seq
    return max(seqs) if seqs else op.seq


def decided_cause(view: FleetView, event: ev.Event, last: Mapping[str, int]) -> int:
    """The cause of an event the promoter's decider returned, from the view it decided on and the
    last sequence of each subject it folded."""
    if isinstance(event, ev.DomainReachable):
        return last.get(subjects.liveness(view.fleet, event.domain), 0) or last.get(
            subjects.agent(view.fleet, event.domain), 0
        )
    if isinstance(event, ev.PromotionRequested):
        if event.reason == "manual":
            return 0
        if event.reason == "initial":
            return _newest_model_seq(view, event.target)
        if event.reason in ev.SIGNAL_SOURCES:
            dv = view.domains.get(event.source)
            return dv.signalled_seq if dv is not None else 0
        return _health_cause(view, event.source, event.reason, last)
    if isinstance(event, ev.FailoverDeclined):
        dv = view.domains.get(event.domain)
        reasons = ("domain_unreachable",) if dv is not None and dv.reachable is False else ("gpu_detached", "degraded")
        for reason in reasons:
            cause = _health_cause(view, event.domain, reason, last)
            if cause:
                return cause
        return 0
    if isinstance(event, ev.DemotionRequested):
        return 0 if event.reason == "manual" else _newest_model_seq(view, event.target)
    if isinstance(event, (ev.ReplaceRequested, ev.TeardownRequested, ev.ProvisionRequested)):
        return 0 if event.reason == "manual" else _last_step_seq(view.last_operation)
    if isinstance(
        event,
        (ev.StepStarted, ev.OperationCompleted, ev.OperationAborted, ev.EligibilityChanged, ev.PromotionRetargeted),
    ):
        op = view.operation
        if op is not None and (not hasattr(event, "op_id") or op.op_id == event.op_id):
            return _last_step_seq(op)
        return 0
    return 0


def flip_cause(op: OperationView) -> int:
    """`route_moved` cites the probe step's outcome: the probe results the flip relied on."""
    for s in op.steps:
        if s.step == "probe" and s.state == "completed":
            return s.seq
    return 0
