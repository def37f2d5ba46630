"""The events on a domain's subjects (`haru.evt.<fleet>.<domain>.*`): each model's residency, GPUs,
training runs, the agent's life and signals, and liveness as the promoter sees it.
Import them from `haru.core.events`, whose union and codecs they belong to.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from haru.core.events_base import Event, LostRange, LostReason, StopHow
from haru.core.events_declarations import FetchedFile

__all__ = [
    "AdapterPublished",
    "AgentStarted",
    "AgentStopping",
    "DomainReachable",
    "DomainLogRegressed",
    "DomainUnreachable",
    "FailureSignalled",
    "GpuObserved",
    "GpuProcess",
    "GpuUsage",
    "ModelAdopted",
    "ModelFailed",
    "ModelLoading",
    "ModelLost",
    "ModelPulling",
    "ModelResident",
    "ModelSleeping",
    "ModelStopped",
    "ModelWaking",
    "SIGNAL_SOURCES",
    "TrainingStarted",
    "TrainingStopped",
]


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


class AdapterPublished(Event, frozen=True, kw_only=True, tag="adapter_published"):
    """A training run finished and published a LoRA adapter for one of the fleet's declared models.

    Its files are one object, `object_name`, in the `haru_adapters` JetStream object store (a tar of the
    adapter's directory: `adapter_config.json`, `adapter_model.safetensors`), checked by `digest` (sha256
    of the object's bytes) so every domain in every region can fetch the same bytes. Appended by the agent
    of the domain whose training slot ran it, on that slot's subject: the subject says who trained it.
    Served as the OpenAI model id `<base_model>:<adapter>`; `version` is the run that produced it.
    """

    domain: str
    slot: str
    base_model: str  # the declared model id it was trained on
    adapter: str  # its name; the served id is `<base_model>:<adapter>`
    version: str  # the run's id, unique per adapter
    object_name: str  # in the haru_adapters object store
    digest: str  # sha256:<hex> of the object's bytes
    size_bytes: int
    rank: int  # the LoRA rank (what vLLM's --max-lora-rank must admit)
    data: str = ""  # what it trained on: a path or dataset id, with its digest
    metrics: dict[str, float] = {}  # the trainer's final metrics (loss, held-out loss, steps)


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


# ----------------------------------------------------- integrity: haru.evt.<fleet>.<domain>.integrity


class DomainLogRegressed(Event, frozen=True, kw_only=True, tag="domain_log_regressed"):
    """The domain's agent found the event log behind what it was acknowledged on its own subjects (its
    models' residency, GPUs, training, its life): `lost` names each subject and range (`LostRange`). The
    agent then re-reports its models' and GPUs' current states. Folded as an anomaly; `haru verify`
    fails on it."""

    domain: str
    lost: list[LostRange] = []
