"""The projected read side: `FleetView` (stored in KV `haru_views`, key `fleet.<slug>`) and
`RouteIntent` (published on `haru.route.<fleet>`, stream HARU_ROUTE).

A FleetView is a fact sheet folded from the log by `haru.core.fold` (the `Folder`; `evolve` specifies it); it carries
`seq`, the last HARU_EVENTS sequence it folded, so a stale projector cannot overwrite a newer view.
A RouteIntent is a pure function of a FleetView (`haru.core.intents.intent`): the provider-neutral
answer that routers act on.

All values are frozen msgspec Structs, JSON on the wire, so `nats kv get haru_views fleet.default`
is readable.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec

from haru.core.adapters import AdapterView
from haru.core.events import GpuProcess, GpuUsage
from haru.core.residency import UNKNOWN, Answer, Residency
from haru.core.specs import AdapterProbe, Policy

_EMPTY_POLICY = Policy()


class GpuView(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    memory_bytes: int = 0  # declared
    reserve_bytes: int = 0  # declared
    name: str = ""
    present: bool | None = None  # observed (None = never observed, or no NVML)
    memory_total_bytes: int = 0  # observed
    memory_used_bytes: int = 0  # observed
    processes: list[int] = []  # observed compute PIDs
    mig: bool = False
    observed_at: datetime | None = None
    usage: list[GpuUsage] = []  # observed: what each runtime/trainer holds vs its plan (over_plan = anomaly)
    foreign: list[GpuProcess] = []  # observed: memory held by processes Haru did not start
    accounted: bool = False  # the per-process figures were read (False: no NVML or not attributable)


class ModelView(msgspec.Struct, frozen=True, kw_only=True):
    """One model on one domain: what was declared, what the planner said, and its residency."""

    name: str
    slot: str = ""
    gpu_index: int = 0
    runtime: str = "vllm"
    vram_bytes: int = 0
    port: int = 0
    url: str = ""  # for `serve: direct` domains and `external` runtimes: where to reach it
    adapters: list[str] = []  # its LoRA adapters' names: served by its runtime, routed as the model is
    admitted: bool | None = None  # None = no admission decided yet
    short_by_bytes: int = 0
    residency: Residency = UNKNOWN
    # Measured, from the log: the last wake and probe (a `model_resident` after `model_waking`) and the
    # last cold load until it answered (a `model_resident` after `model_loading`), in ms (0 = never seen).
    wake_ms: int = 0
    load_ms: int = 0
    short_of: str = "vram"  # what a refused model was short of: vram | host_ram
    host_ram_bytes: int = 0  # what it books in host RAM asleep (its weights), as the planner said
    gpu_indexes: list[int] = []  # a model across GPUs: every GPU it spans
    max_loras: int = 0  # adapters its runtime may hold at once, loaded at run time (0 = none)
    adapter_probes: dict[str, list[AdapterProbe]] = {}  # adapter -> its evaluation probe (the promoter's gate)


class TrainingView(msgspec.Struct, frozen=True, kw_only=True):
    slot: str
    gpu_index: int = 0
    vram_bytes: int = 0
    admitted: bool | None = None
    short_by_bytes: int = 0
    short_of: str = "vram"
    host_ram_bytes: int = 0
    running: bool = False
    pid: int = 0
    since: datetime | None = None  # started at, or stopped at
    last_stop: str = ""  # exited | terminated | killed
    last_exit_code: int | None = None


class AgentView(msgspec.Struct, frozen=True, kw_only=True):
    running: bool = False
    host: str = ""
    pid: int = 0
    version: str = ""
    serving_url: str = ""
    since: datetime | None = None
    host_ram_total_bytes: int = 0  # /proc/meminfo at the agent's start (0 = unknown)
    host_ram_available_bytes: int = 0


class DomainView(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    provider: str = "static"
    region: str = ""
    serving_url: str = ""
    serve: str = "agent"
    gpus: list[GpuView] = []
    models: dict[str, ModelView] = {}  # in declaration order
    training: dict[str, TrainingView] = {}
    agent: AgentView = AgentView()
    reachable: bool | None = None  # None: no liveness verdict yet
    reachability_since: datetime | None = None
    eligible: bool = True  # may serve as standby (set by eligibility_changed)
    ineligible_why: str = ""
    host_ram_bytes: int = 0  # declared (0 = not planned)
    host_ram_reserve_bytes: int = 0
    eligibility_since: datetime | None = None  # `at` of the last eligibility_changed: how old the verdict is
    # A sign the domain is about to go (`failure_signalled`: preemption notice, GPU XID or ECC), until
    # its agent starts again: `source: detail`, when, and the event's sequence.
    signalled: str = ""
    signalled_at: datetime | None = None
    signalled_seq: int = 0
    # The route revision at which this domain stopped being the active (0 = never): it then ranks
    # after the standbys that never lost the role (haru.core.ranking), the old active rejoining last.
    left_active_seq: int = 0


# `skipped`: a best-effort step that did not apply for a known reason (the old active's GPU is gone:
# the very reason for the failover); `detail` says why. It counts as completed for what follows.
StepState = Literal["started", "completed", "failed", "skipped"]


class StepView(msgspec.Struct, frozen=True, kw_only=True):
    step: str
    state: StepState
    attempt: int = 1
    detail: str = ""
    error_code: str = ""
    error: str = ""
    took_ms: int = 0
    at: datetime | None = None
    seq: int = 0


class TriedView(msgspec.Struct, frozen=True, kw_only=True):
    """A standby a promotion tried before it moved on to the next one (`promotion_retargeted`)."""

    target: str
    step: str = ""  # the step that failed on it
    attempt: int = 0  # that step's attempt
    error: str = ""
    at: datetime | None = None
    seq: int = 0  # the promotion_retargeted event


class OperationView(msgspec.Struct, frozen=True, kw_only=True):
    op_id: str
    kind: str  # promotion | demotion | ... (haru.core.events.OPERATION_REQUESTS)
    target: str
    source: str = ""
    reason: str = "manual"
    detail: str = ""
    state: Literal["running", "completed", "aborted"] = "running"
    steps: list[StepView] = []
    error: str = ""
    requested_at: datetime | None = None
    finished_at: datetime | None = None
    seq: int = 0  # sequence of the request event
    route_revision: int = 0  # the route revision it was decided against
    decl_seq: int = 0  # a rolling change: the declarations it rolls out
    model: str = ""  # a weighting: the model whose traffic it splits ('' = the fleet's)
    weights: dict[str, int] = {}  # a weighting: the split it sets (domain -> percent; {} = the active takes all)
    attempt: int = 1  # an automatic failover retried after an abort: which attempt (PromotionRequested.attempt)
    # A promotion onto whichever standby can serve (auto-failover, `haru promote` without a target): when
    # its target fails before the flip it moves on to the next fit standby (`promotion_retargeted`);
    # `tried` lists the ones it left, in order, and `steps` are those of the current target.
    cascade: bool = False
    tried: list[TriedView] = []


class WeightsChange(msgspec.Struct, frozen=True, kw_only=True):
    """The last `weights_set` folded: what changed the weights, why, and its evidence."""

    model: str = ""
    weights: dict[str, int] = {}
    reason: str = ""
    detail: str = ""
    op_id: str = ""
    domain: str = ""
    requests: int = 0
    errors: int = 0
    by: str = ""
    at: datetime | None = None
    seq: int = 0


class FleetView(msgspec.Struct, frozen=True, kw_only=True):
    fleet: str
    uuid: str = ""  # the fleet's stable UUID (fleet_declared's, else derived from the name)
    policy: Policy = _EMPTY_POLICY
    domains: dict[str, DomainView] = {}
    active: str = ""  # the routing pointer ('' = no route_moved yet)
    route_revision: int = 0  # sequence of the last route_moved
    route_moved_at: datetime | None = None
    operation: OperationView | None = None  # the one in flight, if any
    last_operation: OperationView | None = None  # the last one that finished
    # The last failover_declined, while its cause lasts: cleared by the route moving, a promotion
    # being requested, or the declined domain (the failed active) being healthy again.
    declined: str = ""
    declined_at: datetime | None = None
    declined_domain: str = ""
    seq: int = 0  # the last HARU_EVENTS sequence folded into this view
    updated_at: datetime | None = None  # `at` of that event
    # Last sequence on each fleet-level subject: writers still re-read before appending.
    decl_seq: int = 0
    op_seq: int = 0
    route_seq: int = 0
    # Events the fold could not apply as written (an illegal residency transition, an event about
    # an undeclared model): folded leniently or skipped, and counted here so `haru status` says so.
    anomalies: int = 0  # how many, in all of history (never goes down)
    last_anomaly: str = ""
    last_anomaly_at: datetime | None = None  # when the last one was observed (its event's `at`)
    # What the last anomaly is about, when a later event can clear it: `<domain>/<model>` for a
    # residency anomaly (an illegal transition, an event for an undeclared model), cleared by that
    # model's next legal transition or its declaration. '' for a misplaced or undecodable event:
    # those stay in the log for good (`haru verify` names them).
    anomaly_about: str = ""
    anomaly_cleared_at: datetime | None = None  # set when its cause cleared (the text stays, as history)
    # The stream sequence up to which this view is complete (0 = just `seq`). A projector advances
    # it on idle fleets now and then, so a restart resumes from min(max(seq, checkpoint)) + 1
    # across fleets instead of from the last event of the quietest fleet.
    checkpoint: int = 0
    # Traffic weights (haru.core.weights), from `weights_set` on haru.evt.<fleet>.weights: the fleet's
    # split and per-model splits, domain -> percent; {} = the active takes everything. A route move resets them.
    weights: dict[str, int] = {}
    model_weights: dict[str, dict[str, int]] = {}
    weights_change: WeightsChange | None = None  # the last change (a canary rollback names its evidence)
    weights_seq: int = 0  # last sequence on haru.evt.<fleet>.weights
    # LoRA adapters served at run time (haru.core.adapters): served id `<base>:<adapter>` -> its versions,
    # which one serves, and what each domain's runtime holds.
    adapters: dict[str, AdapterView] = {}

    def standby(self) -> str:
        """The first-ranked standby (`haru.core.ranking.rank`: fit first, then declared order, then
        measured fitness); '' when the fleet has no other domain."""
        from haru.core.ranking import rank  # the ranking reads these views: imported when asked

        ranked = rank(self)
        return ranked[0].domain if ranked else ""


class RankedStandby(msgspec.Struct, frozen=True, kw_only=True):
    """One standby in the order a failover would promote it (haru.core.ranking)."""

    domain: str
    rank: int  # 1 = promoted first
    fit: bool = True  # may be promoted now
    why: str = ""  # why it sits where it does: fitness, declared order, measured wake
    wake_ms: int = 0  # the slowest last measured wake of the models it would serve (0 = never measured)


class Target(msgspec.Struct, frozen=True, kw_only=True):
    """One domain as routers see it."""

    domain: str
    serving_url: str = ""
    serve: str = "agent"
    reachable: bool | None = None
    eligible: bool = True
    why: str = ""  # why not eligible / degraded
    degraded: bool = False
    degraded_since: datetime | None = None
    model_urls: dict[str, str] = {}  # `serve: direct`: per-model URLs


class Weighted(msgspec.Struct, frozen=True, kw_only=True):
    """A domain other than the active one that carries a share of traffic: where it is, and its answers."""

    target: Target
    answers: dict[str, Answer] = {}


class RouteIntent(msgspec.Struct, frozen=True, kw_only=True):
    """The provider-neutral routing answer for one fleet."""

    fleet: str
    revision: int = 0  # sequence of the last route_moved (0 = never routed)
    active: Target | None = None
    standby: Target | None = None
    answers: dict[str, Answer] = {}  # one per model on the active domain
    operation: str = ""  # op_id of the operation in flight
    view_seq: int = 0  # the view it was computed from
    # Every standby, ranked (`standby` above is the first of them), and whether any is fit to take
    # over: 'protected', 'unprotected' (no fit standby: one more failure and nothing serves), or ''
    # (no route yet, or a single-domain fleet).
    standbys: list[RankedStandby] = []
    protection: str = ""
    # Traffic weights (haru.core.weights): {} = the active takes all (100). `model_weights` override
    # `weights` for one model; `weighted` holds every other domain with a share (its target and answers).
    weights: dict[str, int] = {}
    model_weights: dict[str, dict[str, int]] = {}
    weighted: dict[str, Weighted] = {}


view_encoder = msgspec.json.Encoder()
view_decoder = msgspec.json.Decoder(FleetView)
intent_decoder = msgspec.json.Decoder(RouteIntent)
