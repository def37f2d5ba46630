"""The event catalogue: every fact Haru records, as one tagged union of frozen msgspec Structs.

Every event carries the envelope:

- `v`     schema version of the body,
- `at`    when the writer observed it (JetStream's own timestamp is when it was recorded:
          together they make history bi-temporal),
- `by`    the writer's id (`agent:<fleet>/<domain>@<host>`, `promoter:<host>:<pid>`, `cli:<user>`),
- `cause` the stream sequence of the event that caused this one (0 = none),
- `prev`  sha256 hex of the previous message body on the same subject ('' for the first);
          filled in by `EventLog.append`, so each subject is a hash chain.

Tags are explicit, stable snake_case: an event's tag never changes. New fields get defaults;
a field's type never changes. Names are past tense; commands (in `haru.core.commands`) are imperative.

Which subject each event goes to is in `haru.core.subjects`; who writes it is in docs/design.md.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar, Literal

import msgspec

from haru.core.errors import EventDecodeError
from haru.core.specs import DomainSpec, ModelSpec, Policy, TrainingSpec

SCHEMA_VERSION = 1

LostReason = Literal["evicted", "gpu_detached", "process_exited", "unhealthy"]
StopHow = Literal["exited", "terminated", "killed"]
Step = Literal[
    "stop_training",
    "verify_gpu",
    "wake",
    "probe",
    "flip",
    "settle_old_active",
    "sleep",
    "start_training",
    "apply_standby",
    "apply_old_active",
    "launch",
    "join",
    "settle",
    "down",
    "weigh",
    "canary",
]


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """The envelope shared by every event."""

    v: int = SCHEMA_VERSION
    at: datetime
    by: str = ""
    cause: int = 0
    prev: str = ""


# ---------------------------------------------------------------- declarations: haru.evt.<fleet>.decl


class FleetDeclared(Event, frozen=True, kw_only=True, tag="fleet_declared"):
    fleet: str
    policy: Policy
    uuid: str = ""  # the fleet's stable UUID (declared, or derived from its name); '' in older logs


class PolicyChanged(Event, frozen=True, kw_only=True, tag="policy_changed"):
    policy: Policy
    previous: Policy | None = None


class DomainDeclared(Event, frozen=True, kw_only=True, tag="domain_declared"):
    spec: DomainSpec


class DomainChanged(Event, frozen=True, kw_only=True, tag="domain_changed"):
    spec: DomainSpec


class DomainRetired(Event, frozen=True, kw_only=True, tag="domain_retired"):
    domain: str


class ModelDeclared(Event, frozen=True, kw_only=True, tag="model_declared"):
    domain: str
    spec: ModelSpec


class ModelChanged(Event, frozen=True, kw_only=True, tag="model_changed"):
    domain: str
    spec: ModelSpec


class ModelRetired(Event, frozen=True, kw_only=True, tag="model_retired"):
    domain: str
    model: str


class TrainingDeclared(Event, frozen=True, kw_only=True, tag="training_declared"):
    domain: str
    spec: TrainingSpec


class TrainingChanged(Event, frozen=True, kw_only=True, tag="training_changed"):
    domain: str
    spec: TrainingSpec


class TrainingRetired(Event, frozen=True, kw_only=True, tag="training_retired"):
    domain: str
    slot: str


class AdmissionDecided(Event, frozen=True, kw_only=True, tag="admission_decided"):
    """The planner's verdict for one model (kind=model) or training slot (kind=training)."""

    domain: str
    kind: Literal["model", "training"] = "model"
    name: str  # the model id, or the training slot name
    gpu_index: int
    admitted: bool
    vram_bytes: int
    short_by_bytes: int = 0
    capacity_bytes: int = 0  # memory - reserve of that GPU (of host RAM, when that is what it was short of)
    resource: Literal["vram", "host_ram"] = "vram"  # what it was short of
    host_ram_bytes: int = 0  # what it books in host RAM while its domain is standby (sleeping weights, trainer)
    gpu_indexes: list[int] = []  # a model across GPUs: every GPU it spans ([] = gpu_index alone)


# ------------------------------------------------- model files: haru.evt.<fleet>.decl (haru.models)


class FetchedFile(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # the file's name in the materialized model
    digest: str  # sha256:<hex> (or gitsha1:<hex> for a small Hugging Face file kept in git)
    size: int
    fetched: bool = True  # False: it was already in the store and re-hashed right


class ModelFetched(Event, frozen=True, kw_only=True, tag="model_fetched"):
    """`haru pull` (or an agent pulling a layout's reference) put a model's files, verified, in a store.

    Where a model's files came from: `haru why` shows it. On the fleet's decl subject: a fetch is a
    fact about what was declared, not about one runtime's residency."""

    reference: str  # canonical: `ollama:library/qwen3:0.6b`, `hf:ORG/REPO:Q4_K_M@<commit>`
    model: str = ""  # the model id (or the reference as typed) it was pulled for
    domain: str = ""  # the agent's domain that pulled it ('' = the CLI)
    origin: str = ""  # the registry's base URL
    revision: str = ""  # the Ollama tag, or the Hugging Face commit
    format: str = ""  # gguf | safetensors
    path: str = ""  # the materialized path on `host`
    host: str = ""
    files: list[FetchedFile] = []
    fetched_bytes: int = 0
    reused_bytes: int = 0
    healed: list[str] = []  # digests found corrupt in the store and fetched again
    took_ms: int = 0


# ------------------------------------------------- residency: haru.evt.<fleet>.<domain>.model.<model>


class ModelPulling(Event, frozen=True, kw_only=True, tag="model_pulling"):
    """The agent fetches a layout's reference into its store before starting the runtime (haru.models).

    Appended when the pull starts, every few seconds of progress, and once every file is verified
    (`files` then says which, with their digests: where the model's files came from)."""

    domain: str
    model: str
    reference: str
    done_bytes: int = 0
    total_bytes: int = 0
    origin: str = ""
    files: list[FetchedFile] = []


class ModelLoading(Event, frozen=True, kw_only=True, tag="model_loading"):
    """`sleep_mode`: for a vLLM, whether this launch can sleep and how that was learned ("on: ...",
    "off: ..."; a vLLM that cannot sleep is a standby that stays resident); "" for other runtimes."""

    domain: str
    model: str
    endpoint: str = ""
    pid: int = 0
    attempt: int = 1
    # Not spawned yet: what it waits for (its GPU's turn: one cold load at a time per GPU, in
    # declaration order; agents/load_queue.py). "" once its runtime is started.
    waiting_for: str = ""
    sleep_mode: str = ""


class ModelResident(Event, frozen=True, kw_only=True, tag="model_resident"):
    """Loaded AND answering AND accounted for: health passed, listed, and a completion answered.
    `sleeps`: whether this runtime can be put to sleep (False: a vLLM whose platform has no sleep
    mode, learned at launch; a standby keeps it resident, as it keeps a llama-server)."""

    domain: str
    model: str
    endpoint: str = ""
    warmup_ms: int = 0
    sleeps: bool = True


class ModelSleeping(Event, frozen=True, kw_only=True, tag="model_sleeping"):
    """`freed_bytes` as `measured_by` saw it: "process" (NVML's per-process memory of the runtime's
    process tree), "gpu" (the whole GPU's used memory), or "" (nothing could measure: freed_bytes 0
    means unknown, and `detail` says so)."""

    domain: str
    model: str
    level: int = 1
    freed_bytes: int = 0
    measured_by: str = ""
    detail: str = ""


class ModelWaking(Event, frozen=True, kw_only=True, tag="model_waking"):
    domain: str
    model: str


class ModelLost(Event, frozen=True, kw_only=True, tag="model_lost"):
    domain: str
    model: str
    reason: LostReason
    detail: str = ""
    exit_code: int | None = None


class ModelFailed(Event, frozen=True, kw_only=True, tag="model_failed"):
    """The runtime will not load the model; `runtime_said` is what it said."""

    domain: str
    model: str
    runtime_said: str


class ModelAdopted(Event, frozen=True, kw_only=True, tag="model_adopted"):
    """A starting agent found the runtime its predecessor started still serving, and kept it: no load.

    Adopted only when the process is the one recorded (pid and kernel start time), its command line is
    the plan's, `/health` passes and `/v1/models` lists the model. `asleep` says how it was found (a
    sleeping vLLM stays asleep): the model is `sleeping` (at `level`) after it, else `resident`.
    """

    domain: str
    model: str
    pid: int = 0
    endpoint: str = ""
    asleep: bool = False
    sleeps: bool = True  # as `model_resident.sleeps`: whether this runtime can be put to sleep
    level: int = 1
    detail: str = ""


class ModelStopped(Event, frozen=True, kw_only=True, tag="model_stopped"):
    """Unloaded on purpose (agent shutdown, model retired)."""

    domain: str
    model: str
    detail: str = ""


# -------------------------------------------------------- GPUs: haru.evt.<fleet>.<domain>.gpu.<index>


class GpuProcess(msgspec.Struct, frozen=True, kw_only=True):
    pid: int
    used_bytes: int = 0


class GpuUsage(msgspec.Struct, frozen=True, kw_only=True):
    """What one thing Haru started holds on a GPU (its whole process tree), against its plan.

    `planned_bytes` is the model's declared VRAM (its sleep residual while it sleeps), or a training
    slot's budget. `over_plan` (used above planned) is an anomaly, recorded with the figures.
    """

    name: str  # the model id, or the training slot
    kind: Literal["model", "training"] = "model"
    pids: list[int] = []  # the processes of its tree that hold memory on this GPU
    used_bytes: int = 0
    planned_bytes: int = 0
    over_plan: bool = False


class GpuObserved(Event, frozen=True, kw_only=True, tag="gpu_observed"):
    """A GPU's presence and memory, appended only when it changed.

    `present` is None when the host has no NVML: an honest "we cannot know", never a guess.
    `usage` accounts the per-process memory (NVML's compute processes) to the runtimes and trainers
    Haru started; `foreign` is what processes Haru did not start hold (a neighbour on a rented GPU).
    `accounted` says the per-process figures were read (False: no NVML, or it cannot attribute memory).
    """

    domain: str
    index: int
    present: bool | None
    name: str = ""
    memory_total_bytes: int = 0
    memory_used_bytes: int = 0
    processes: list[GpuProcess] = []
    mig: bool = False
    usage: list[GpuUsage] = []
    foreign: list[GpuProcess] = []
    accounted: bool = False


# ---------------------------------------------------- training: haru.evt.<fleet>.<domain>.training.<slot>


class TrainingStarted(Event, frozen=True, kw_only=True, tag="training_started"):
    domain: str
    slot: str
    pid: int
    gpu_index: int


class TrainingStopped(Event, frozen=True, kw_only=True, tag="training_stopped"):
    domain: str
    slot: str
    how: StopHow
    exit_code: int | None = None
    ran_ms: int = 0


# ------------------------------------------------------------- agent: haru.evt.<fleet>.<domain>.agent


class AgentStarted(Event, frozen=True, kw_only=True, tag="agent_started"):
    domain: str
    host: str = ""
    pid: int = 0
    version: str = ""
    serving_url: str = ""
    # The host's RAM as /proc/meminfo said at start (0 = unknown: no /proc): MemTotal, MemAvailable.
    host_ram_total_bytes: int = 0
    host_ram_available_bytes: int = 0


class AgentStopping(Event, frozen=True, kw_only=True, tag="agent_stopping"):
    domain: str
    reason: str = ""


SIGNAL_SOURCES = ("preemption_notice", "gpu_xid", "gpu_ecc")


class FailureSignalled(Event, frozen=True, kw_only=True, tag="failure_signalled"):
    """The agent saw a sign that its host or a GPU is about to go: a provider's preemption notice (the
    domain's `preemption_notice` command or URL), an NVML critical XID, or an ECC fault (double-bit
    errors, pages pending retirement). The promoter moves the route off the domain before it goes.
    A new `agent_started` clears it (an agent that still sees the sign records it again)."""

    domain: str
    source: str  # one of SIGNAL_SOURCES
    gpu_index: int = -1  # the GPU it concerns (-1: the whole host, a preemption notice)
    detail: str = ""


# ------------------------------------------------------- liveness: haru.evt.<fleet>.<domain>.liveness


class DomainUnreachable(Event, frozen=True, kw_only=True, tag="domain_unreachable"):
    domain: str
    silent_ms: int = 0


class DomainReachable(Event, frozen=True, kw_only=True, tag="domain_reachable"):
    domain: str


# -------------------------------------------------------------- operations: haru.evt.<fleet>.op


class OperationRequested(Event, frozen=True, kw_only=True):
    """The base of every operation's request event: one subclass per operation kind (`kind`).

    An operation is requested by one event on `haru.evt.<fleet>.op` naming its id and its target
    domain; its steps (`step_started`/`step_completed`/`step_failed`) and its end
    (`operation_completed`/`operation_aborted`) follow on the same subject. Which steps a kind has
    is the promoter's table (`haru.promoter.decider.KINDS`, `TRANSITIONS`). A new kind is a new
    subclass here, listed in `AnyEvent`; the fold, `haru op`, the console and the Postgres sink
    find it through `OPERATION_REQUESTS`.
    """

    kind: ClassVar[str] = ""
    op_id: str
    target: str  # the domain the operation acts on (the one to make active, for a promotion)


class PromotionRequested(OperationRequested, frozen=True, kw_only=True, tag="promotion_requested"):
    kind: ClassVar[str] = "promotion"
    source: str = ""  # the active domain when it was decided ('' = none)
    reason: str = "manual"  # manual | domain_unreachable | gpu_detached | degraded
    detail: str = ""
    route_revision: int = 0
    # An automatic failover retried after its previous attempt aborted: which attempt this is (1 = first).
    attempt: int = 1
    # Any fit standby may serve (auto-failover, `haru promote` without a target): a target that fails
    # before the flip is left for the next fit standby, in the same operation (`promotion_retargeted`).
    cascade: bool = False


class DemotionRequested(OperationRequested, frozen=True, kw_only=True, tag="demotion_requested"):
    kind: ClassVar[str] = "demotion"
    reason: str = "manual"
    route_revision: int = 0


class RollingRequested(OperationRequested, frozen=True, kw_only=True, tag="rolling_requested"):
    """A layout change that would interrupt a model the active domain serves, rolled through the standby:
    the standby (`target`) applies the declarations up to `decl_seq`, is woken, probed and promoted
    (the usual saga), then the old active (`source`) applies them and becomes the standby."""

    kind: ClassVar[str] = "rolling"
    source: str = ""  # the active domain when it was requested
    reason: str = "manual"  # manual | layout_changed (`haru apply` requested it)
    detail: str = ""  # which changes wait on the active domain (`a/m2`)
    route_revision: int = 0
    decl_seq: int = 0  # the last sequence on haru.evt.<fleet>.decl it rolls out (0: whatever is declared)


class ProvisionRequested(OperationRequested, frozen=True, kw_only=True, tag="provision_requested"):
    """Launch the target's cluster (SkyPilot) or service (SkyServe), wait for its agent, make it the standby."""

    kind: ClassVar[str] = "provision"
    reason: str = "manual"
    detail: str = ""


class TeardownRequested(OperationRequested, frozen=True, kw_only=True, tag="teardown_requested"):
    """Tear down every cluster (or service) of the target domain."""

    kind: ClassVar[str] = "teardown"
    reason: str = "manual"  # manual | teardown_failed (a failed teardown, asked again)
    detail: str = ""


class ReplaceRequested(OperationRequested, frozen=True, kw_only=True, tag="replace_requested"):
    """Replace a failed domain's host: tear the old one down, launch a new one, make it the standby."""

    kind: ClassVar[str] = "replace"
    reason: str = "manual"  # manual | auto_replace (the fleet's policy, after a failover)
    detail: str = ""


class WeightingRequested(OperationRequested, frozen=True, kw_only=True, tag="weighting_requested"):
    """An operator's new traffic weights (haru.core.weights): `weights` is the whole split of `model`'s
    traffic ('' = the fleet's), domain -> percent, summing to 100 ({} = the active takes it all again).
    `target` is the one domain the change gives a share it did not have (it is woken and probed first),
    else the active (nothing to wake). The promoter records the weights (`weights_set`) once it did."""

    kind: ClassVar[str] = "weighting"
    model: str = ""
    weights: dict[str, int] = {}
    reason: str = "manual"  # manual | rolling (a rolling change's canary step)
    detail: str = ""
    route_revision: int = 0


class StepStarted(Event, frozen=True, kw_only=True, tag="step_started"):
    op_id: str
    step: Step
    attempt: int = 1


class StepCompleted(Event, frozen=True, kw_only=True, tag="step_completed"):
    op_id: str
    step: Step
    detail: str = ""
    took_ms: int = 0
    # A best-effort step that did not apply, and why (the old active's GPU is gone: the reason for
    # the failover). Shown as skipped, not as a failure; what follows is what follows a completion.
    skipped: str = ""


class StepFailed(Event, frozen=True, kw_only=True, tag="step_failed"):
    op_id: str
    step: Step
    error_code: str = ""
    error: str = ""
    took_ms: int = 0


class PromotionRetargeted(Event, frozen=True, kw_only=True, tag="promotion_retargeted"):
    """A cascading promotion's target failed before the flip (`step` failed with `error`): the same
    operation moves on to `target`, the next fit standby, from its first step. Routing has not moved."""

    op_id: str
    target: str  # the standby tried next
    previous: str = ""  # the standby that failed
    step: str = ""
    error: str = ""


class OperationCompleted(Event, frozen=True, kw_only=True, tag="operation_completed"):
    op_id: str


class OperationAborted(Event, frozen=True, kw_only=True, tag="operation_aborted"):
    """Failed before the flip: routing did not move."""

    op_id: str
    step: str = ""
    error: str = ""


class FailoverDeclined(Event, frozen=True, kw_only=True, tag="failover_declined"):
    """The active failed but no promotion was started, and why (standby unreachable, lost, ...)."""

    domain: str  # the failed active
    candidate: str = ""
    why: str


class EligibilityChanged(Event, frozen=True, kw_only=True, tag="eligibility_changed"):
    """Whether a domain may serve as standby (its GPU or agent may be gone)."""

    domain: str
    eligible: bool
    why: str = ""


# ------------------------------------------------------------- checkpoints: haru.evt.<fleet>.checkpoint


class ChainHead(msgspec.Struct, frozen=True, kw_only=True):
    """The last event on one subject at a checkpoint: its sequence and the sha256 of its body."""

    subject: str
    seq: int
    hash: str


class Checkpoint(Event, frozen=True, kw_only=True, tag="checkpoint"):
    """Where a fleet's history stood, so readers can start here instead of at sequence 1.

    Every event of the fleet at or below `upto` is folded into `view` (the projector's FleetView,
    as stored in KV, JSON), and `heads` holds every subject's chain head at `upto`: `haru verify
    --since-checkpoint` takes them as the chains' starting points, a projector rebuild takes
    `view` as its starting view. Written by the projector every `checkpoint_every` events."""

    fleet: str
    upto: int
    events: int = 0  # events of the fleet at or below `upto`
    heads: list[ChainHead] = []
    view: dict[str, Any] = {}


# ------------------------------------------------------------------- route: haru.evt.<fleet>.route


class RouteMoved(Event, frozen=True, kw_only=True, tag="route_moved"):
    """The routing pointer. The revision of the route is this event's stream sequence."""

    active: str
    previous: str = ""
    op_id: str = ""


# ----------------------------------------------------------------- weights: haru.evt.<fleet>.weights


class WeightsSet(Event, frozen=True, kw_only=True, tag="weights_set"):
    """The traffic weights of the fleet (`model` '') or of one model: domain -> percent, summing to 100;
    {} = the default (the active domain takes everything). Written only by the promoter, on the fleet's
    weights subject: after a `weighting` operation woke and probed the domains it gives a share
    (`op_id`), or on its own when a canary failed its policy (`reason` canary_rolled_back, `detail` the
    evidence: the error rate the gateways reported, or the probe that failed). A route move resets every
    weight (the new active takes everything)."""

    model: str = ""
    weights: dict[str, int] = {}
    reason: str = "manual"  # manual | rolling | canary_rolled_back
    detail: str = ""
    op_id: str = ""
    domain: str = ""  # the canary domain a rollback is about ('' otherwise)
    requests: int = 0  # the evidence of a rollback: requests and errors the gateways reported in the window
    errors: int = 0
    route_revision: int = 0  # the route revision the weights were decided against


AnyEvent = (
    FleetDeclared
    | PolicyChanged
    | DomainDeclared
    | DomainChanged
    | DomainRetired
    | ModelDeclared
    | ModelChanged
    | ModelRetired
    | TrainingDeclared
    | TrainingChanged
    | TrainingRetired
    | AdmissionDecided
    | ModelFetched
    | ModelPulling
    | ModelLoading
    | ModelResident
    | ModelSleeping
    | ModelWaking
    | ModelLost
    | ModelFailed
    | ModelStopped
    | ModelAdopted
    | GpuObserved
    | TrainingStarted
    | TrainingStopped
    | AgentStarted
    | AgentStopping
    | FailureSignalled
    | DomainUnreachable
    | DomainReachable
    | PromotionRequested
    | DemotionRequested
    | RollingRequested
    | WeightingRequested
    | ProvisionRequested
    | TeardownRequested
    | ReplaceRequested
    | StepStarted
    | StepCompleted
    | StepFailed
    | PromotionRetargeted
    | OperationCompleted
    | OperationAborted
    | FailoverDeclined
    | EligibilityChanged
    | RouteMoved
    | WeightsSet
    | Checkpoint
)

RESIDENCY_EVENTS = (
    ModelPulling,
    ModelLoading,
    ModelResident,
    ModelSleeping,
    ModelWaking,
    ModelLost,
    ModelFailed,
    ModelStopped,
    ModelAdopted,
)

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AnyEvent)


def tag_of(event: Event) -> str:
    """The stable tag of an event (`model_lost`)."""
    return type(event).__struct_config__.tag  # type: ignore[return-value]


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def decode(body: bytes) -> AnyEvent:
    """Decode one event body. Raises EventDecodeError carrying msgspec's path."""
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise EventDecodeError(f"not a valid Haru event: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not a valid Haru event (malformed JSON): {exc}") from exc


def payload(event: Event) -> dict[str, Any]:
    """The event's own fields without the envelope: what `haru why` prints after the tag."""
    out: dict[str, Any] = msgspec.to_builtins(event)
    for key in ("type", "v", "at", "by", "cause", "prev"):
        out.pop(key, None)
    return out


OPERATION_REQUESTS: dict[str, type[OperationRequested]] = {
    cls.kind: cls for cls in AnyEvent.__args__ if issubclass(cls, OperationRequested)
}
"""Operation kind -> its request event, read from `AnyEvent`."""


ALL_TAGS: tuple[str, ...] = tuple(t.__struct_config__.tag for t in AnyEvent.__args__)
