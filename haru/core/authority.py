"""The subject is the authority, not the body: which events may stand on which subjects.

NATS grants permissions per subject, so the one thing a writer cannot lie about is where its event
was stored. `PLACES` says, for each subject kind, which event types may appear there and which
NATS role writes it (deploy/nats/gen_users.py grants exactly these, and a test holds the two
together); a body's fleet, domain, model, GPU index and slot, where it carries them, must equal
the subject's. Pure: no I/O.

    kind       subject                                    written by (NATS role)          events
    decl       haru.evt.<fleet>.decl                      operator (`haru apply`)         declarations, admission
    route      haru.evt.<fleet>.route                     promoter                        route_moved
    checkpoint haru.evt.<fleet>.checkpoint                projector                       checkpoint
    weights    haru.evt.<fleet>.weights                   promoter                        weights_set
    op         haru.evt.<fleet>.op                        promoter, gateway, operator     operations, decisions
    agent      haru.evt.<fleet>.<domain>.agent            that domain's agent             agent_started/stopping
    liveness   haru.evt.<fleet>.<domain>.liveness         promoter                        domain_(un)reachable
    model      haru.evt.<fleet>.<domain>.model.<model>    that domain's agent             residency
    gpu        haru.evt.<fleet>.<domain>.gpu.<index>      that domain's agent             gpu_observed
    training   haru.evt.<fleet>.<domain>.training.<slot>  that domain's agent             training_started/stopped
    integrity  haru.evt.<fleet>.integrity                 promoter                        log_regressed
    domain_integrity haru.evt.<fleet>.<domain>.integrity  that domain's agent             domain_log_regressed
    usage      haru.evt.<fleet>.usage                     gateway                         tokens_counted

    why = misplaced(subject, event)     # '' when the event may stand there, else why not
    line = anomaly(seq, subject, event, why)   # "seq 12: route_moved on ... by ... not applied: ..."

Every fold (`haru.core.fold`, the promoter, `haru apply`, the Postgres rows, `haru why` and
`as-of`) and `haru verify` call `misplaced` before applying an event: a misplaced event is not
applied, and is reported with its sequence, subject and writer (`by`). A follower that reads an
event subject directly (a router following `haru.evt.<fleet>.route`) calls it too.

Each event type is allowed on exactly one subject kind (tests/unit/test_authority.py checks this
and that every event type is placed).
"""

from __future__ import annotations

from dataclasses import dataclass

from haru.core import events as ev
from haru.core.subjects import Where, where

__all__ = [
    "ALLOWED",
    "PLACES",
    "Place",
    "anomaly",
    "kind_of",
    "misplaced",
    "misplaced_at",
    "table_markdown",
    "writers_of",
]


@dataclass(frozen=True, slots=True)
class Place:
    """One subject kind: its subject pattern, the NATS roles that may write it, the events it holds."""

    kind: str
    subject: str
    writers: tuple[str, ...]
    events: tuple[type[ev.Event], ...]


PLACES: tuple[Place, ...] = (
    Place(
        "decl",
        "haru.evt.<fleet>.decl",
        ("operator",),
        (
            ev.FleetDeclared,
            ev.PolicyChanged,
            ev.DomainDeclared,
            ev.DomainChanged,
            ev.DomainRetired,
            ev.ModelDeclared,
            ev.ModelChanged,
            ev.ModelRetired,
            ev.TrainingDeclared,
            ev.TrainingChanged,
            ev.TrainingRetired,
            ev.AdmissionDecided,
            ev.ModelFetched,
            ev.PriceDeclared,
        ),
    ),  # fmt: skip
    Place("route", "haru.evt.<fleet>.route", ("promoter",), (ev.RouteMoved,)),
    Place("checkpoint", "haru.evt.<fleet>.checkpoint", ("projector",), (ev.Checkpoint,)),
    Place("weights", "haru.evt.<fleet>.weights", ("promoter",), (ev.WeightsSet, ev.AdapterRouted)),
    Place(
        "op",
        "haru.evt.<fleet>.op",
        ("promoter", "gateway", "operator"),
        (
            *ev.OPERATION_REQUESTS.values(),
            ev.StepStarted,
            ev.StepCompleted,
            ev.StepFailed,
            ev.PromotionRetargeted,
            ev.OperationCompleted,
            ev.OperationAborted,
            ev.FailoverDeclined,
            ev.EligibilityChanged,
        ),
    ),  # fmt: skip
    Place(
        "agent", "haru.evt.<fleet>.<domain>.agent", ("agent",), (ev.AgentStarted, ev.AgentStopping, ev.FailureSignalled)
    ),
    Place("liveness", "haru.evt.<fleet>.<domain>.liveness", ("promoter",), (ev.DomainUnreachable, ev.DomainReachable)),
    Place(
        "model", "haru.evt.<fleet>.<domain>.model.<model>", ("agent",), (*ev.RESIDENCY_EVENTS, ev.AdapterStateChanged)
    ),
    Place("gpu", "haru.evt.<fleet>.<domain>.gpu.<index>", ("agent",), (ev.GpuObserved,)),
    Place(
        "training",
        "haru.evt.<fleet>.<domain>.training.<slot>",
        ("agent",),
        (ev.TrainingStarted, ev.TrainingStopped, ev.AdapterPublished),
    ),
    Place("integrity", "haru.evt.<fleet>.integrity", ("promoter",), (ev.LogRegressed,)),
    Place("domain_integrity", "haru.evt.<fleet>.<domain>.integrity", ("agent",), (ev.DomainLogRegressed,)),
    Place("usage", "haru.evt.<fleet>.usage", ("gateway",), (ev.TokensCounted,)),
)
"""The table. `agent` as a writer means the agent of the subject's own domain (NATS user
`agent.<fleet>.<domain>`); `admin` may write anything and is nobody's day-to-day identity."""

ALLOWED: dict[type, str] = {cls: p.kind for p in PLACES for cls in p.events}
"""Event type -> the one subject kind it may appear on."""

_BY_KIND: dict[str, Place] = {p.kind: p for p in PLACES}

# What a subject of each kind names, and the body field that must agree with it where the body
# carries one (GpuObserved calls its GPU `index`; TrainingStarted's `gpu_index` is not the subject's).
_PARTS: dict[str, tuple[str, ...]] = {
    "decl": ("fleet",),
    "route": ("fleet",),
    "checkpoint": ("fleet",),
    "weights": ("fleet",),
    "op": ("fleet",),
    "agent": ("fleet", "domain"),
    "liveness": ("fleet", "domain"),
    "model": ("fleet", "domain", "model"),
    "gpu": ("fleet", "domain", "gpu_index"),
    "training": ("fleet", "domain", "slot"),
    "integrity": ("fleet",),
    "domain_integrity": ("fleet", "domain"),
    "usage": ("fleet",),
}
_BODY_FIELD = {"fleet": "fleet", "domain": "domain", "model": "model", "gpu_index": "index", "slot": "slot"}
_NOUN = {"fleet": "fleet", "domain": "domain", "model": "model", "gpu_index": "GPU index", "slot": "slot"}

# Event type -> (its kind, ((body field, Where attribute), ...)): what `misplaced_at` compares.
_RULES: dict[type, tuple[str, tuple[tuple[str, str], ...]]] = {
    cls: (
        kind,
        tuple(
            (_BODY_FIELD[part], part)
            for part in _PARTS[kind]
            if _BODY_FIELD[part] in getattr(cls, "__struct_fields__", ())
        ),
    )
    for cls, kind in ALLOWED.items()
}


def kind_of(event_type: type) -> str:
    """The subject kind an event type belongs on ('' for something that is not a Haru event)."""
    return ALLOWED.get(event_type, "")


def writers_of(kind: str) -> tuple[str, ...]:
    """The NATS roles that may write subjects of `kind`."""
    return _BY_KIND[kind].writers


def misplaced_at(place: Where | None, event: object) -> str:
    """`misplaced` for a subject already parsed by `where` (None: not an event subject)."""
    rule = _RULES.get(type(event))
    if rule is None or not isinstance(event, ev.Event):
        return f"{type(event).__name__} is not a Haru event type"
    kind, checks = rule
    if place is None:
        return "its subject is not a Haru event subject (haru.evt.<fleet>.<kind>...)"
    if place.kind != kind:
        p = _BY_KIND[kind]
        here = _BY_KIND[place.kind].subject
        return f"{ev.tag_of(event)} belongs on {p.subject} (written by {', '.join(p.writers)}), not on {here}"
    for field, part in checks:
        said = getattr(event, field)
        if said != getattr(place, part):
            return f"its body says {_NOUN[part]} {said!r}, its subject says {getattr(place, part)!r}"
    return ""


def misplaced(subject: str, event: object) -> str:
    """Why `event` may not stand on `subject` ('' when it may): the wrong subject kind for its type,
    or a fleet/domain/model/GPU index/slot in its body that is not the subject's."""
    return misplaced_at(where(subject), event)


def anomaly(seq: int, subject: str, event: object, why: str) -> str:
    """The one line that reports a misplaced event: its sequence, type, subject, writer, and why."""
    tag = ev.tag_of(event) if isinstance(event, ev.Event) else type(event).__name__
    by = getattr(event, "by", "") or "an unnamed writer"
    return f"seq {seq}: {tag} on {subject} by {by} not applied: {why}"


def table_markdown() -> str:
    """The table as Markdown, for docs/security.md (a unit test checks the doc carries it)."""
    lines = [
        "| subject | written by (NATS role) | events | a body's fields that must equal the subject's |",
        "|---|---|---|---|",
    ]
    for p in PLACES:
        writers = ", ".join(f"`{w}`" + (" of that domain" if w == "agent" else "") for w in p.writers)
        tags = ", ".join(f"`{cls.__struct_config__.tag}`" for cls in p.events)
        fields = ", ".join(f"`{_BODY_FIELD[part]}`" for part in _PARTS[p.kind])
        lines.append(f"| `{p.subject}` | {writers} | {tags} | {fields} (where the body has them) |")
    return "\n".join(lines)
