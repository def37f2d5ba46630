"""The event catalogue: every fact Haru records, as one tagged union of frozen msgspec Structs.

Every event carries the envelope:

- `v`     schema version of the body,
- `at`    when the writer observed it (JetStream's own timestamp is when it was recorded:
          together they make history bi-temporal),
- `by`    the writer's id (`agent:<fleet>/<domain>@<host>`, `promoter:<host>:<pid>`, `cli:<user>`),
- `cause` the stream sequence of the event that caused this one (0 = none); written negative, relative,
          when that event is an earlier one of the same atomic batch (haru.core.record.with_absolute_cause),
          and resolved to the sequence by every read,
- `prev`  sha256 hex of the previous message body on the same subject ('' for the first);
          filled in by `EventLog.append`, so each subject is a hash chain.

Tags are explicit, stable snake_case: an event's tag never changes. New fields get defaults;
a field's type never changes. Names are past tense; commands (in `haru.core.commands`) are imperative.

The structs live in sibling modules by the subjects they go to (`events_base`: the envelope;
`events_declarations`, `events_domain`, `events_fleet`) and are re-exported here: import them from
this module, which holds the union, the codecs and the tables read from the union.

Which subject each event goes to is in `haru.core.subjects`; who writes it is in docs/design.md.
"""

from __future__ import annotations

from typing import Any

import msgspec

from haru.core.errors import EventDecodeError
from haru.core.events_adapters import AdapterRouted, AdapterStateChanged
from haru.core.events_base import (
    SCHEMA_VERSION,
    Event,
    LostRange,
    LostReason,
    Step,
    StopHow,
)
from haru.core.events_declarations import (
    AdmissionDecided,
    DomainChanged,
    DomainDeclared,
    DomainRetired,
    FetchedFile,
    FleetDeclared,
    ModelChanged,
    ModelDeclared,
    ModelFetched,
    ModelRetired,
    PolicyChanged,
    PriceDeclared,
    TrainingChanged,
    TrainingDeclared,
    TrainingRetired,
)
from haru.core.events_domain import (
    SIGNAL_SOURCES,
    AdapterPublished,
    AgentStarted,
    AgentStopping,
    DomainLogRegressed,
    DomainReachable,
    DomainUnreachable,
    FailureSignalled,
    GpuObserved,
    GpuProcess,
    GpuUsage,
    ModelAdopted,
    ModelFailed,
    ModelLoading,
    ModelLost,
    ModelPulling,
    ModelResident,
    ModelSleeping,
    ModelStopped,
    ModelWaking,
    TrainingStarted,
    TrainingStopped,
)
from haru.core.events_fleet import (
    ChainHead,
    Checkpoint,
    ClusterCost,
    DemotionRequested,
    EligibilityChanged,
    FailoverDeclined,
    LogRegressed,
    ModelTokens,
    OperationAborted,
    OperationCompleted,
    OperationRequested,
    PromotionRequested,
    PromotionRetargeted,
    ProvisionRequested,
    ReplaceRequested,
    RollingRequested,
    RouteMoved,
    StepCompleted,
    StepFailed,
    StepStarted,
    TeardownRequested,
    TokensCounted,
    WeightingRequested,
    WeightsSet,
)

__all__ = [
    "AdapterPublished",
    "AdapterRouted",
    "AdapterStateChanged",
    "ALL_TAGS",
    "AdmissionDecided",
    "AgentStarted",
    "AgentStopping",
    "AnyEvent",
    "ChainHead",
    "Checkpoint",
    "ClusterCost",
    "DemotionRequested",
    "DomainChanged",
    "DomainDeclared",
    "DomainLogRegressed",
    "DomainReachable",
    "DomainRetired",
    "DomainUnreachable",
    "EligibilityChanged",
    "Event",
    "FailoverDeclined",
    "FailureSignalled",
    "FetchedFile",
    "FleetDeclared",
    "GpuObserved",
    "GpuProcess",
    "GpuUsage",
    "LogRegressed",
    "LostRange",
    "LostReason",
    "ModelAdopted",
    "ModelChanged",
    "ModelDeclared",
    "ModelFailed",
    "ModelFetched",
    "ModelLoading",
    "ModelLost",
    "ModelPulling",
    "ModelResident",
    "ModelRetired",
    "ModelSleeping",
    "ModelStopped",
    "ModelTokens",
    "ModelWaking",
    "OPERATION_REQUESTS",
    "OperationAborted",
    "OperationCompleted",
    "OperationRequested",
    "PolicyChanged",
    "PriceDeclared",
    "PromotionRequested",
    "PromotionRetargeted",
    "ProvisionRequested",
    "RESIDENCY_EVENTS",
    "ReplaceRequested",
    "RollingRequested",
    "RouteMoved",
    "SCHEMA_VERSION",
    "SIGNAL_SOURCES",
    "Step",
    "StepCompleted",
    "StepFailed",
    "StepStarted",
    "StopHow",
    "TeardownRequested",
    "TokensCounted",
    "TrainingChanged",
    "TrainingDeclared",
    "TrainingRetired",
    "TrainingStarted",
    "TrainingStopped",
    "WeightingRequested",
    "WeightsSet",
    "decode",
    "encode",
    "payload",
    "tag_of",
]

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
    | AdapterPublished
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
    | AdapterStateChanged
    | AdapterRouted
    | LogRegressed
    | DomainLogRegressed
    | PriceDeclared
    | TokensCounted
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
