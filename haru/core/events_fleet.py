"""The fleet-wide events: operations and their steps (`.op`), checkpoints, the route pointer and the
weights. Import them from `haru.core.events`, whose union and codecs they belong to.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

import msgspec

from haru.core.events_base import Event, LostRange, Step

__all__ = [
    "ChainHead",
    "Checkpoint",
    "ClusterCost",
    "DemotionRequested",
    "EligibilityChanged",
    "FailoverDeclined",
    "LogRegressed",
    "ModelTokens",
    "OperationAborted",
    "OperationCompleted",
    "OperationRequested",
    "PromotionRequested",
    "PromotionRetargeted",
    "ProvisionRequested",
    "ReplaceRequested",
    "RollingRequested",
    "RouteMoved",
    "StepCompleted",
    "StepFailed",
    "StepStarted",
    "TeardownRequested",
    "TokensCounted",
    "WeightingRequested",
    "WeightsSet",
]


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


class ClusterCost(msgspec.Struct, frozen=True, kw_only=True):
    """One cluster's line of SkyPilot's cost report, read before it was torn down: `total` (a decimal
    string) over `seconds` of life, in `currency` (SkyPilot reports USD)."""

    cluster: str
    total: str
    seconds: float = 0.0  # 0: the report gave no duration (no hourly price can be made of it)
    currency: str = "USD"


class StepStarted(Event, frozen=True, kw_only=True, tag="step_started"):
    op_id: str
    step: Step
    attempt: int = 1


class StepCompleted(Event, frozen=True, kw_only=True, tag="step_completed"):
    op_id: str
    step: Step
    detail: str = ""
    took_ms: int = 0  # the agents' own measure of the work (their replies' took_ms), else the promoter's wall time
    # The promoter's wall time from the step's first command to its last reply: the work and the round
    # trips to the agent (0: no command, or a record from before this field)
    wall_ms: int = 0
    # A best-effort step that did not apply, and why (the old active's GPU is gone: the reason for
    # the failover). Shown as skipped, not as a failure; what follows is what follows a completion.
    skipped: str = ""
    # A `down` step: what SkyPilot's cost report said each torn-down cluster cost (docs/cost.md).
    costs: list[ClusterCost] = []


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
    """The routing pointer. The revision of the route is this event's stream sequence.

    `previous_silent`: the promoter had judged the previous active unreachable (`domain_unreachable`,
    its heartbeats went silent) when it moved the route off it. A router that follows the route subject
    learns it with the move, before any view says so, and fails what it has in flight there (a partition
    closes no connection)."""

    active: str
    previous: str = ""
    op_id: str = ""
    previous_silent: bool = False


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


# -------------------------------------------------------------- integrity: haru.evt.<fleet>.integrity


class LogRegressed(Event, frozen=True, kw_only=True, tag="log_regressed"):
    """The promoter found the event log behind what it was acknowledged on the fleet's subjects it writes
    (route, op, weights, liveness): each of `lost` names a subject, the sequence acknowledged, the hash
    expected there and what the log holds now. The log forgot acknowledged events (a power loss with
    lazy fsync, a damaged block file, a store restored from an old backup); the promoter then re-decides
    what those events said. Folded as an anomaly; `haru verify` fails on it."""

    fleet: str
    lost: list[LostRange] = []


# ------------------------------------------------------------------- usage: haru.evt.<fleet>.usage


class ModelTokens(msgspec.Struct, frozen=True, kw_only=True):
    """One model's tokens, as the responses' `usage` reported them, and how many responses carried one."""

    model: str
    prompt: int = 0
    completion: int = 0
    responses: int = 0


class TokensCounted(Event, frozen=True, kw_only=True, tag="tokens_counted"):
    """What one gateway served a fleet since its previous `tokens_counted` (a delta, never a total):
    appended every `usage_flush_ms` while there is something to count, and when the gateway stops.
    Summing a period's deltas gives its tokens (docs/cost.md)."""

    fleet: str
    gateway: str
    since: datetime | None = None  # the start of what this delta counts (None: the gateway's start)
    models: list[ModelTokens] = []
