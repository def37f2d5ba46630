"""The declared shape of a fleet, as frozen values.

These are what an operator declares (parsed and validated by `haru.core.layout`) and what the
declaration events carry (`haru.core.events`). Sizes are bytes. Nothing here does I/O.
"""

from __future__ import annotations

import uuid as _uuid
from typing import Annotated, Literal

import msgspec

from haru.core.prices import Price
from haru.core.sizes import GiB, MiB

# Ranges the decoder refuses with the value's path (`Expected `int` >= 0 - at `$.policy.wake_timeout_ms``).
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(gt=0)]
PortNumber = Annotated[int, msgspec.Meta(ge=1, le=65535)]

Runtime = Literal["vllm", "llama_server", "external"]

# Which runtimes have a sleep mode (weights out of VRAM, process kept). One without it serves the
# standby role resident: asking it to sleep is a no-op, and an awake model of such a runtime is not a
# reason to demote a standby. `agents.runtimes` classes carry the same bit (`can_sleep`; a unit test
# holds them to this table).
SLEEP_MODE: dict[str, bool] = {"vllm": True, "llama_server": False, "external": False}


def can_sleep(runtime: str) -> bool:
    return SLEEP_MODE.get(runtime, False)


Provider = Literal["static", "skypilot", "skyserve"]
Serve = Literal["agent", "direct"]


class Policy(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=False):
    """A fleet's policy. Every wait in Haru has its bound here (except Loading, which reports)."""

    auto_failover: bool = True
    # Heartbeat silence past this makes the promoter write `domain_unreachable`.
    heartbeat_timeout_ms: NonNegative = 5_000
    # A degraded active (a served model lost for a reason other than gpu_detached) is failed after this.
    degraded_grace_ms: NonNegative = 60_000
    # Default SIGTERM-to-SIGKILL grace for training slots that do not declare their own.
    training_grace_ms: NonNegative = 10_000
    # Restart backoff for a runtime whose process exited: initial, doubled per attempt, capped.
    restart_backoff_ms: NonNegative = 1_000
    restart_backoff_max_ms: NonNegative = 30_000
    # How often an agent probes resident models.
    probe_interval_ms: NonNegative = 5_000
    # What a sleeping runtime keeps resident on its GPU (CUDA context and allocator residue).
    sleep_residual_bytes: NonNegative = 512 * MiB
    # Bound on one command round trip from the promoter to an agent.
    command_timeout_ms: NonNegative = 30_000
    # Bound on waking a runtime (level-1 wake of a 235B model is ~6 s; leave room).
    wake_timeout_ms: NonNegative = 120_000
    # Bound on a one-token probe completion.
    probe_timeout_ms: NonNegative = 30_000
    # Bound on a rolling change's apply steps: a domain reloading the models the layout changed
    # (a cold load of a real vLLM model took 21-98 s here; leave room).
    apply_timeout_ms: NonNegative = 600_000
    # Provisioning (docs/provisioning.md). After a failover, replace the failed domain's host (a
    # skypilot/skyserve domain) with a new one, made the standby. Off by default.
    auto_replace: bool = False
    # At most this many automatic launches per fleet in any hour (0 = no cap). Manual requests are not capped.
    max_launches_per_hour: NonNegative = 0
    # After a provisioning operation aborted, no automatic replace for this long (0 = the usual retry backoff).
    launch_cooldown_ms: NonNegative = 0
    # Bounds of the provisioning steps: launch (every placement tried), join (agent heard, models
    # loaded), down (every cluster of the domain torn down).
    # An automatic failover that aborted while the active is still unfit is retried after
    # failover_retry_ms, doubled per attempt and capped at failover_retry_max_ms, at most
    # failover_retry_attempts times; then the slower retry of any aborted operation applies
    # (max(degraded_grace_ms, heartbeat_timeout_ms)), and the giving-up is recorded (failover_declined).
    failover_retry_ms: NonNegative = 500
    failover_retry_max_ms: NonNegative = 8_000
    failover_retry_attempts: NonNegative = 5
    # verify_gpu polls this long, at most, for the GPU memory a stopped trainer held to be released
    # (a driver frees a killed process's memory a moment late); its detail says how long it took.
    verify_settle_ms: NonNegative = 5_000
    launch_timeout_ms: NonNegative = 3_600_000
    join_timeout_ms: NonNegative = 1_800_000
    teardown_timeout_ms: NonNegative = 900_000
    # The gateway's hold (docs/gateway.md, "A failover the clients do not see"): while the active is
    # unfit and a failover is under way or about to start, new requests wait for the new active this
    # long at most. 0 = from the standby's measured wake and probe, plus the heartbeat timeout when the
    # active's silence has yet to be noticed; never beyond `hold_max_ms` (0 = never hold).
    hold_ms: NonNegative = 0
    hold_max_ms: NonNegative = 30_000
    # At most this many requests, and this many body bytes, held per fleet and gateway; beyond: answered at once.
    hold_max_requests: NonNegative = 1024
    hold_max_bytes: NonNegative = 64 * MiB
    # After a planned flip, the old active's in-flight requests finish (this long at most) before it sleeps.
    drain_ms: NonNegative = 30_000
    # The faster path (docs/promoter.md) before a standby's wake was ever measured: its models' declared
    # VRAM at this rate, plus `probe_estimate_ms` (a model already resident needs the probe alone). vLLM's
    # published level-1 wakes are ~0.8 s for 8 GB and ~2.9 s for 60 GB: 8 GiB/s leaves room.
    wake_estimate_bytes_per_s: NonNegative = 8 * GiB
    probe_estimate_ms: NonNegative = 500
    # Standbys' declared order (most preferred first), before measured fitness (haru.core.ranking).
    # Empty: the layout's domain order. Domains not named rank after those named, by measured fitness.
    standby_order: list[str] = []
    # Canaries (haru.core.weights): a domain other than the active with a share of traffic is rolled back
    # (its share returned to the active) when, over the last `canary_window_ms`, the gateways reported at
    # least `canary_min_requests` requests to it with an error rate (5xx, unreachable, timeouts) above
    # `canary_max_error_rate`, or at once when its probe fails (a served model no longer resident, the
    # domain unreachable or ineligible).
    canary_max_error_rate: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.05
    canary_min_requests: NonNegative = 20
    canary_window_ms: Positive = 60_000
    # `haru apply`'s rolling change: before the flip, give the standby this share of traffic (0 = no
    # canary step) for `rolling_canary_ms`; rolled back, the change aborts with routing unmoved.
    rolling_canary_weight: Annotated[int, msgspec.Meta(ge=0, le=99)] = 0
    rolling_canary_ms: NonNegative = 30_000
    # A new version of a LoRA adapter (docs/adapters.md): once its evaluation probe passed it takes this share
    # of the adapter's requests for `adapter_canary_ms`, then all of them while its probe and error rate hold
    # (the canary_* figures above); failing either, it is rolled back to the version before it.
    adapter_canary_percent: Annotated[int, msgspec.Meta(ge=1, le=100)] = 10
    adapter_canary_ms: NonNegative = 60_000
    # After a flip, the old active is put to sleep only once every router that follows the fleet
    # (`haru route follow`, reporting on haru.router.<fleet>.<router>) applied the new route, or is gone,
    # or this long has passed.
    router_ack_timeout_ms: NonNegative = 10_000


class GpuSpec(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    memory_bytes: int
    reserve_bytes: int = 0
    name: str = ""


class AdapterProbe(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One case of an adapter's evaluation probe: a greedy, fixed-seed answer to `prompt` must contain `expect`."""

    prompt: str
    expect: str
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=256)] = 16


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One model, served by its own runtime process on one GPU, or on several (tensor parallel)."""

    name: str  # the OpenAI model id clients send, matched exactly
    slot: str
    gpu_index: int  # the slot's GPU; a tensor-parallel model's first
    runtime: Runtime = "vllm"  # the layout infers it from `source` when not named (haru.core.launch.runtime_for)
    vram_bytes: int = 0
    context_length: int = 0
    port: int = 0  # the runtime's loopback port (or the remote port for `external`)
    # What the runtime loads: a HF repo or directory for vLLM, a GGUF path for llama-server.
    source: str = ""
    # For `external`: the base URL of an already-running OpenAI-compatible endpoint.
    url: str = ""
    # The executable, when not the default (`vllm`, `llama-server`); the simulator is used this way.
    binary: list[str] = []
    args: list[str] = []
    env: dict[str, str] = {}
    # LoRA adapters served beside the base model: adapter name (a model id clients may send) -> path.
    adapters: dict[str, str] = {}
    # llama-server: how many layers to offload to the GPU; -1 = all of them (`-ngl 999`).
    gpu_layers: int = -1
    # Tensor parallel: every GPU the model spans, the slot's first ([] = the slot's GPU alone). Its
    # `vram_bytes` is booked on EACH of them (vLLM shards the weights and gives each GPU the same
    # memory fraction).
    gpu_indexes: list[NonNegative] = []
    # Host RAM its level-1 sleep keeps (the weights, offloaded to CPU RAM); 0 = its `vram_bytes`, an
    # upper bound (the weights are never more than the VRAM it holds). Runtimes that cannot sleep keep none.
    host_ram_bytes: NonNegative = 0
    # LoRA adapters loaded at run time (docs/adapters.md): how many versions its runtime may hold at once
    # (vLLM's --max-loras; 0 = none are loaded at run time) and the highest rank it admits (--max-lora-rank).
    max_loras: NonNegative = 0
    max_lora_rank: Annotated[int, msgspec.Meta(ge=1, le=512)] = 16
    # An adapter's evaluation probe (adapter name -> its cases): every case must pass before a version of
    # it takes traffic, and again while it is a canary.
    adapter_probes: dict[str, list[AdapterProbe]] = {}


def model_gpus(spec: ModelSpec) -> list[int]:
    """Every GPU `spec` runs on: its tensor-parallel GPUs, or its slot's GPU alone."""
    return list(spec.gpu_indexes) or [spec.gpu_index]


class TrainingSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A preemptible training workload that runs only while its domain is standby."""

    slot: str
    gpu_index: int
    command: list[str]
    checkpoint_dir: str
    vram_bytes: int = 0
    grace_ms: int = 0  # 0 = the policy's training_grace_ms
    host_ram_bytes: NonNegative = 0  # host RAM it uses (declared; planned beside sleeping weights)


# What an agent's serving port answers without the token, for a load balancer's readiness probe
# (agents/serving.py, agents/portholder.py): 200 while the host is a fit member of its domain, else 503.
READY_PATH = "/ready"


class ServiceSpec(msgspec.Struct, frozen=True, kw_only=True):
    """SkyServe's part of a `provider: skyserve` domain: replicas and the readiness probe."""

    replicas: int = 1
    # SkyServe's probe sends no header, so it must be READY_PATH: every other path needs the token.
    readiness_path: str = READY_PATH
    # How long SkyServe waits before probing a new replica: the agent's set-up and model loads.
    initial_delay_s: int = 1200


class ProvisionSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How a `provider: skypilot | skyserve` domain is launched (haru.provision turns it into YAML).

    Clouds, regions and zones are placement constraints handed to SkyPilot; Haru calls no cloud SDK.
    Secrets are named here, never valued: their values come from the launching process's
    environment at launch time and reach SkyPilot as `--secret NAME`.
    """

    cloud: str = ""  # "aws", "gcp", ...; "" = any cloud SkyPilot has credentials for
    regions: list[str] = []  # tried in order (a capacity error moves to the next); [] = the domain's region
    zones: list[str] = []  # tried in order instead of regions when given
    accelerators: str = ""  # SkyPilot's form: "L4:1", "A100-80GB:8"
    use_spot: bool = False
    disk_size_gb: NonNegative = 0  # 0 = SkyPilot's default
    image_id: str = ""  # e.g. "docker:vllm/vllm-openai:v0.8.5" or a cloud image id
    cpus: str = ""  # "8", "8+"
    memory: str = ""  # GB: "32", "32+"
    ports: list[PortNumber] = []  # [] = the agent's serving port
    setup: str = ""  # "" = install haru (haru.provision.skypilot.DEFAULT_SETUP)
    run: str = ""  # "" = write the agent config from $HARU_AGENT_CONFIG and exec `haru agent`
    envs: dict[str, str] = {}
    secrets: list[str] = []  # names of environment variables passed as SkyPilot secrets
    nats_url: str = ""  # the NATS URL(s) as the launched host reaches them (the agent's nats_url)
    cluster: str = ""  # "" = haru-<fleet>-<domain>; the SkyServe service name for skyserve
    launch_timeout_s: Positive = 1800
    status_timeout_s: Positive = 120
    down_timeout_s: Positive = 900
    service: ServiceSpec = ServiceSpec()


NoticeProvider = Literal["aws", "gcp", "azure"]


class PreemptionNotice(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where a domain's provider announces that it takes the host back, polled by the agent every
    `interval_ms`. Exactly one of:

    - `provider`: the provider's own metadata service, read with its documented protocol (AWS IMDSv2's
      token, then `spot/instance-action` and the rebalance recommendation; GCP's `instance/preempted`
      and `instance/maintenance-event` with `Metadata-Flavor: Google`; Azure's Scheduled Events with
      `Metadata: true`, `Preempt` and `Terminate` events for this VM only). `endpoint` overrides the
      metadata service's address (tests, proxies); empty means the provider's documented one.
    - `url`: any other endpoint; a notice is an answer 200 with a body other than empty/`FALSE`/`false`/
      `none` (headers go in `headers`). Not for Azure, whose answer is a JSON document even when empty.
    - `command`: a notice is exit status 0 with something on stdout (what it printed is the detail)."""

    provider: NoticeProvider | None = None
    endpoint: str = ""
    url: str = ""
    headers: dict[str, str] = {}
    command: list[str] = []
    interval_ms: int = 5_000


class DomainSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One failure domain: its provider, where it serves, and its GPUs (slots are declared apart)."""

    name: str
    provider: Provider = "static"
    region: str = ""
    serving_url: str = ""
    serve: Serve = "agent"
    gpus: list[GpuSpec] = []
    # Host RAM (0 = not declared: not planned). Level-1 sleep keeps every standby model's weights there
    # and trainers use it too; the planner books those against host_ram - host_ram_reserve.
    host_ram_bytes: NonNegative = 0
    host_ram_reserve_bytes: NonNegative = 0
    # For provider skypilot/skyserve: how to launch it (None for static hosts, and for a cloud domain
    # declared before provisioning was wired in: `haru provision` then says what to add).
    provision: ProvisionSpec | None = None
    # A provider's preemption notice, polled by the agent (a planned move off the domain before it goes).
    preemption_notice: PreemptionNotice | None = None


class Domain(msgspec.Struct, frozen=True, kw_only=True):
    """A domain with its models and training slots, as a layout declares it."""

    spec: DomainSpec
    models: list[ModelSpec] = []
    training: list[TrainingSpec] = []


# A fleet's UUID, when its layout declares none: derived from its name, so the same fleet has the same UUID
# on every machine and after every re-apply (uuid5 of the name in this namespace). Recorded with the
# fleet's first declaration (`fleet_declared.uuid`); the control API takes it wherever it takes the name.
FLEET_UUID_NAMESPACE = _uuid.UUID("6d2a0c1e-3f7b-5b8e-9a43-68617275666c")


def fleet_uuid(fleet: str) -> str:
    """The UUID derived from a fleet's name (stable: a pure function of the name)."""
    return str(_uuid.uuid5(FLEET_UUID_NAMESPACE, fleet))


def as_uuid(text: str) -> str:
    """`text` as a canonical UUID string, or '' when it is not one."""
    try:
        return str(_uuid.UUID(text))
    except (ValueError, AttributeError, TypeError):
        return ""


class Layout(msgspec.Struct, frozen=True, kw_only=True):
    fleet: str
    uuid: str = ""  # declared ('' = none: the fleet's UUID is then fleet_uuid(fleet))
    policy: Policy = Policy()
    domains: list[Domain] = []
    # Each domain's hourly price (haru.core.prices): recorded as `price_declared`; a domain not here is unpriced.
    prices: dict[str, Price] = {}

    def domain(self, name: str) -> Domain | None:
        for d in self.domains:
            if d.spec.name == name:
                return d
        return None
