"""Reading history back: chain verification, a model's causal story, and its state as of a point.

Pure: these functions take `Record`s (already read from the log) and return values or text.

- `Verifier` walks every subject's hash chain: each body must decode as an event, its `prev` must
  be the sha256 of the previous body on the same subject ('' for the first), and its Nats-Msg-Id
  must be the one `EventLog.append` derives, so a message published around `append` is caught.
  It also reports every event that may not stand on its subject (`haru.core.authority`: a
  `route_moved` on an agent's subject, a body naming another domain than its subject) as
  `misplaced`, with its sequence, subject and writer: intact chains of misplaced events are still
  a failed verify, because no fold applies them. And it collects every `log_regressed` /
  `domain_log_regressed` that stands where it may (`regressed`): a writer found the log had lost
  events it was acknowledged, so history is not intact even where every remaining chain holds.
- `story(records, model)` selects what explains a model: its declaration and admission, its
  residency on each domain, and the operations and route moves its losses caused.
- `as_of(records, model, seq=..., time=...)` is the model's state at that point.
- `misplaced_records(records)` are the records every fold skips, with why, for the CLI to report.

Misplaced events are never part of a story nor of a state as of a point: the folds do not apply them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec

from haru.core import authority, receipts, residency, subjects
from haru.core import events as ev
from haru.core.views import FleetView, RouteIntent
from haru.log.eventlog import MSG_ID, Record, body_hash, msg_id
from haru.log.record import BATCH_ID

# ------------------------------------------------------------------------------------------ verify


@dataclass(frozen=True, slots=True)
class Break:
    """One place where history does not verify."""

    seq: int
    subject: str
    what: str

    def __str__(self) -> str:
        return f"seq {self.seq} on {self.subject}: {self.what}"


@dataclass(frozen=True, slots=True)
class Misplaced:
    """An event stored on a subject it may not stand on (`haru.core.authority`): no fold applies it."""

    seq: int
    subject: str
    type: str
    by: str
    why: str

    def __str__(self) -> str:
        by = self.by or "an unnamed writer"
        return f"seq {self.seq} on {self.subject}: {self.type} by {by} is misplaced: {self.why}"


def misplaced_of(rec: Record) -> Misplaced | None:
    """The record as a `Misplaced`, or None when its event may stand on its subject (or did not decode)."""
    e = rec.event
    if e is None:
        return None
    why = authority.misplaced(rec.subject, e)
    if not why:
        return None
    return Misplaced(rec.seq, rec.subject, ev.tag_of(e), e.by, why)


def misplaced_records(records: list[Record]) -> list[Misplaced]:
    """Every record whose event may not stand on its subject, in order."""
    return [m for m in map(misplaced_of, records) if m is not None]


@dataclass(frozen=True, slots=True)
class Regressed:
    """A writer's record that the log lost acknowledged events (`log_regressed`, `domain_log_regressed`),
    with only the ranges its writer could have been acknowledged (`haru.core.receipts.in_scope`)."""

    seq: int
    subject: str
    by: str
    lost: tuple[ev.LostRange, ...]

    def __str__(self) -> str:
        return (
            f"seq {self.seq} on {self.subject}: the log lost acknowledged events "
            f"({self.by or 'an unnamed writer'} noticed): {receipts.describe(list(self.lost))}"
        )


@dataclass(slots=True)
class Verifier:
    """Feed it every record of the event stream in order; then read `breaks` and `misplaced`."""

    events: int = 0
    tips: dict[str, tuple[int, str]] = field(default_factory=dict)  # subject -> (last seq, body hash)
    breaks: list[Break] = field(default_factory=list)
    misplaced: list[Misplaced] = field(default_factory=list)
    regressed: list[Regressed] = field(default_factory=list)
    # subject -> (atomic batch id, the subject's last sequence before that batch): a message after another of
    # its own batch on the same subject is named by the position the batch checked (haru.log.js_events)
    batched: dict[str, tuple[str, int]] = field(default_factory=dict)

    def add(self, rec: Record) -> None:
        self.events += 1
        prev_seq, prev_hash = self.tips.get(rec.subject, (0, ""))
        self.tips[rec.subject] = (rec.seq, body_hash(rec.data))
        position = prev_seq
        batch = (rec.headers or {}).get(BATCH_ID, "")
        held = self.batched.get(rec.subject)
        if batch and held is not None and held[0] == batch:
            position = held[1]
        elif batch:
            self.batched[rec.subject] = (batch, prev_seq)
        elif held is not None:
            del self.batched[rec.subject]
        if rec.event is None:
            self.breaks.append(Break(rec.seq, rec.subject, f"the body is not a valid event ({rec.error})"))
            return
        wrong = misplaced_of(rec)
        if wrong is not None:
            self.misplaced.append(wrong)
        else:
            self.note_regressed(rec)
        if rec.event.prev != prev_hash:
            if prev_seq == 0:
                want = "'' (it is the first event on its subject)"
            else:
                want = f"sha256 of seq {prev_seq} = {prev_hash[:16]}…"
            got = rec.event.prev[:16] + "…" if rec.event.prev else "''"
            self.breaks.append(Break(rec.seq, rec.subject, f"prev is {got}, expected {want}: the chain is broken here"))
            return
        expected_id = msg_id(rec.subject, position, rec.data)
        got_id = (rec.headers or {}).get(MSG_ID, "")
        if got_id != expected_id:
            self.breaks.append(
                Break(
                    rec.seq,
                    rec.subject,
                    "was not written by an optimistic append (its Nats-Msg-Id "
                    + ("is missing" if not got_id else "does not match its position and body")
                    + ")",
                )
            )

    def note_regressed(self, rec: Record) -> None:
        """Keep `rec` in `regressed` when it is a writer's record of a lost range (placed where it may
        stand; only the ranges its writer could have been acknowledged)."""
        e = rec.event
        if isinstance(e, (ev.LogRegressed, ev.DomainLogRegressed)) and not authority.misplaced(rec.subject, e):
            lost = tuple(r for r in e.lost if receipts.in_scope(rec.subject, r))
            if lost and all(r.seq != rec.seq for r in self.regressed):
                self.regressed.append(Regressed(rec.seq, rec.subject, e.by, lost))

    @property
    def subjects(self) -> int:
        return len(self.tips)

    @property
    def ok(self) -> bool:
        return not self.breaks and not self.misplaced and not self.regressed

    def summary(self) -> str:
        if self.ok:
            return f"verify ok — {self.events} events on {self.subjects} subjects, history intact"
        found = []
        if self.breaks:
            found.append(f"{len(self.breaks)} break(s)")
        if self.misplaced:
            found.append(f"{len(self.misplaced)} misplaced event(s), not applied by any fold")
        if self.regressed:
            ranges = sum(len(r.lost) for r in self.regressed)
            found.append(f"{ranges} range(s) of acknowledged events the log lost")
        return f"verify FAILED — {' and '.join(found)} in {self.events} events on {self.subjects} subjects"


# ------------------------------------------------------------------------------ truncation witnesses
#
# The chains prove nothing was rewritten in the middle; they cannot prove the newest events were not
# cut off (a cut stream is a shorter valid stream). The projector's views and route intents live
# outside HARU_EVENTS (KV haru_views, stream HARU_ROUTE) and name the HARU_EVENTS sequences they
# folded: they are the witnesses `haru verify` holds the stream against.


@dataclass(frozen=True, slots=True)
class Witness:
    """A HARU_EVENTS sequence recorded outside the stream, and what the event there must be."""

    source: str  # e.g. "view fleet.default (last folded)"
    seq: int
    subject: str = ""  # the subject the event must be on; ending in "." = any subject under it
    at: datetime | None = None  # the event's `at`, when the witness kept it


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str  # "truncated" | "replaced"
    seq: int
    what: str

    def __str__(self) -> str:
        return self.what


def view_witnesses(key: str, view: FleetView) -> list[Witness]:
    """What a FleetView (haru.core.views) says it folded."""
    prefix = f"{subjects.EVT}.{view.fleet}."
    out = [Witness(f"view {key} (last folded)", view.seq, prefix, view.updated_at)] if view.seq else []
    for name, seq, subject in (
        ("decl_seq", view.decl_seq, subjects.decl(view.fleet)),
        ("op_seq", view.op_seq, subjects.op(view.fleet)),
        ("route_seq", view.route_seq, subjects.route(view.fleet)),
        ("route_revision", view.route_revision, subjects.route(view.fleet)),
    ):
        if seq:
            out.append(Witness(f"view {key} ({name})", seq, subject))
    if view.checkpoint:
        out.append(Witness(f"view {key} (checkpoint)", view.checkpoint))
    return out


def intent_witnesses(intent: RouteIntent) -> list[Witness]:
    """What a RouteIntent says: the route_moved it follows and the view it was computed from."""
    out = []
    if intent.revision:
        out.append(Witness(f"route intent of {intent.fleet} (revision)", intent.revision, subjects.route(intent.fleet)))
    if intent.view_seq:
        out.append(
            Witness(f"route intent of {intent.fleet} (view_seq)", intent.view_seq, f"{subjects.EVT}.{intent.fleet}.")
        )
    return out


def check_witnesses(
    stream_last: int, witnesses: list[Witness], stored: dict[int, tuple[str, datetime | None]]
) -> list[Finding]:
    """Hold the stream against its witnesses. `stored` maps each witnessed sequence the stream has
    to (subject, `at` of its event or None when unreadable). A witness past the stream's end means
    the newest events were cut; a witnessed sequence holding another event means they were cut and
    the stream written on (a chain can be intact across such a cut)."""
    findings: list[Finding] = []
    ahead = [w for w in witnesses if w.seq > stream_last]
    if ahead:
        top = max(ahead, key=lambda w: w.seq)
        first = stream_last + 1
        span = f"{first}..{top.seq}" if top.seq > first else str(first)
        findings.append(
            Finding(
                "truncated",
                top.seq,
                f"the store ends at {stream_last} but the views have folded up to {top.seq} ({top.source}): "
                f"events {span} are missing; the newest events were cut from the store",
            )
        )
    for w in witnesses:
        if w.seq > stream_last or w.seq not in stored or not w.subject and w.at is None:
            continue
        subject, at = stored[w.seq]
        wrong_subject = bool(w.subject) and (
            not subject.startswith(w.subject) if w.subject.endswith(".") else subject != w.subject
        )
        wrong_time = w.at is not None and at is not None and at != w.at
        if wrong_subject or wrong_time:
            findings.append(
                Finding(
                    "replaced",
                    w.seq,
                    f"seq {w.seq} is not the event {w.source} folded (it is on {subject}"
                    + (
                        f" at {at.isoformat()}, the view's was at {w.at.isoformat()}"
                        if wrong_time and at and w.at
                        else ""
                    )
                    + "): events were cut from the store and others written in their place",
                )
            )
    return findings


# ------------------------------------------------------------------------------------------- story

# How `haru why` names events: hearth's words where hearth has them.
SHORT_NAMES: dict[str, str] = {
    "model_declared": "declared",
    "model_changed": "changed",
    "model_retired": "retired",
    "admission_decided": "admitted",
    "model_pulling": "pulling",
    "model_loading": "loading",
    "model_resident": "resident",
    "model_sleeping": "asleep",
    "model_waking": "waking",
    "model_lost": "lost",
    "model_failed": "failed",
    "model_stopped": "unloaded",
    "model_fetched": "fetched",
    "model_adopted": "adopted",
}

_DECL_FOR_MODEL = (ev.ModelDeclared, ev.ModelChanged, ev.ModelRetired)


def _concerns_model(rec: Record, model: str, domain: str) -> bool:
    e = rec.event
    if e is None:
        return False
    if isinstance(e, _DECL_FOR_MODEL):
        name = e.spec.name if isinstance(e, (ev.ModelDeclared, ev.ModelChanged)) else e.model
        return name == model and (not domain or e.domain == domain)
    if isinstance(e, ev.AdmissionDecided):
        return e.kind == "model" and e.name == model and (not domain or e.domain == domain)
    if isinstance(e, ev.RESIDENCY_EVENTS):
        return e.model == model and (not domain or e.domain == domain)
    if isinstance(e, ev.ModelFetched):  # where its files came from (haru.models)
        return model in (e.model, e.reference) and (not domain or e.domain in ("", domain))
    return False


# Operation-level facts that concern every model of the fleet: a promotion moves the route for all.
_FLEET_STORY = (ev.OperationRequested, ev.OperationCompleted, ev.OperationAborted, ev.FailoverDeclined, ev.RouteMoved)


def story(records: list[Record], model: str, *, domain: str = "") -> list[Record]:
    """The records that explain `model`, oldest first: its declarations and residency, the fleet's
    operations and route moves once the model exists, and any other event caused by one of those."""
    picked: list[Record] = []
    seqs: set[int] = set()
    for rec in records:
        e = rec.event
        if e is None or authority.misplaced(rec.subject, e):
            continue
        if _concerns_model(rec, model, domain):
            picked.append(rec)
            seqs.add(rec.seq)
        elif seqs and (isinstance(e, _FLEET_STORY) or (e.cause and e.cause in seqs)):
            picked.append(rec)
            seqs.add(rec.seq)
    return picked


def _payload_for_display(e: ev.Event) -> dict[str, Any]:
    out = ev.payload(e)
    out.pop("model", None)
    if isinstance(e, (ev.ModelDeclared, ev.ModelChanged)):
        spec = e.spec
        out = {"runtime": spec.runtime, "gpu_index": spec.gpu_index, "vram_bytes": spec.vram_bytes}
    elif isinstance(e, ev.ModelFetched):
        out = {
            "reference": e.reference,
            "origin": e.origin,
            "fetched_bytes": e.fetched_bytes,
            "files": [f"{f.name} {f.digest[:19]} {f.size}" for f in e.files],
            "took_ms": e.took_ms,
        }
    elif isinstance(e, ev.AdmissionDecided):
        out = {"admitted": e.admitted, "vram_bytes": e.vram_bytes}
        if not e.admitted:
            out["short_by_bytes"] = e.short_by_bytes
    return {k: v for k, v in out.items() if k != "domain" and v not in ("", None, [], {})}


# ------------------------------------------------------------------------------------------- as-of


@dataclass(frozen=True, slots=True)
class AsOf:
    domain: str
    state: str
    seq: int  # the event that made it (0 = none)
    payload: dict[str, Any]


def as_of(
    records: list[Record], model: str, *, seq: int | None = None, time: datetime | None = None, domain: str = ""
) -> dict[str, AsOf]:
    """The model's residency on each domain as of stream sequence `seq` or recorded time `time`."""
    states: dict[str, AsOf] = {}
    for rec in records:
        if seq is not None and rec.seq > seq:
            break
        if time is not None and rec.time > time:
            break
        e = rec.event
        if e is None or not _concerns_model(rec, model, domain) or authority.misplaced(rec.subject, e):
            continue
        d: str = getattr(e, "domain")  # noqa: B009 (every event `_concerns_model` keeps names its domain)
        if isinstance(e, (ev.ModelDeclared, ev.ModelChanged)):
            states.setdefault(d, AsOf(d, "unknown", rec.seq, {}))
            continue
        if isinstance(e, ev.ModelRetired):
            states[d] = AsOf(d, "retired", rec.seq, {})
            continue
        if isinstance(e, ev.AdmissionDecided):
            if not e.admitted:
                states[d] = AsOf(d, "not_admitted", rec.seq, _payload_for_display(e))
            elif d not in states or states[d].state == "not_admitted":
                states[d] = AsOf(d, "unknown", rec.seq, _payload_for_display(e))
            continue
        state = residency.to_state(e, rec.seq)
        states[d] = AsOf(d, residency.state_name(state), rec.seq, _payload_for_display(e))
    return states


# ------------------------------------------------------------------------------------- causal tree


@dataclass(slots=True)
class Node:
    """One event of a causal tree: its record, the events it caused, and what is wrong with its link."""

    rec: Record
    children: list[Node] = field(default_factory=list)
    missing: str = ""  # '' = its link is whole; else why it is not


def missing_link(rec: Record, have: dict[int, Record]) -> str:
    """Why the record's link to its cause is not whole ('' when it is, or when it is a root)."""
    from haru.core import causes

    e = rec.event
    if e is None:
        return ""
    if not e.cause:
        return (
            "no cause recorded, though this kind of event has one: a link is missing" if causes.expects_cause(e) else ""
        )
    cause = have.get(e.cause)
    if cause is None:
        return f"its cause, seq {e.cause}, could not be read"
    if cause.event is None:
        return f"its cause, seq {e.cause}, is not a valid event"
    want = causes.EXPECTED.get(ev.tag_of(e), ())
    if want and ev.tag_of(cause.event) not in want:
        return f"its cause, seq {e.cause}, is a {ev.tag_of(cause.event)}, not one of {', '.join(want)}"
    return ""


def causal_tree(records: dict[int, Record]) -> list[Node]:
    """The records as a forest: each event under the event it names as its cause; roots (no cause, or a
    cause not among `records`) newest first, children oldest first."""
    nodes = {seq: Node(rec, missing=missing_link(rec, records)) for seq, rec in sorted(records.items())}
    roots: list[Node] = []
    for seq, node in nodes.items():
        e = node.rec.event
        parent = nodes.get(e.cause) if e is not None and e.cause and e.cause != seq else None
        if parent is not None and e is not None and e.cause < seq:
            parent.children.append(node)
        else:
            roots.append(node)
    return list(reversed(roots))


def _name(e: ev.Event) -> str:
    tag = ev.tag_of(e)
    if isinstance(e, ev.AdmissionDecided) and not e.admitted:
        return "not_admitted"
    if isinstance(e, (ev.StepStarted, ev.StepCompleted, ev.StepFailed)):
        return f"{tag}:{e.step}"
    return SHORT_NAMES.get(tag, tag)


def _line(rec: Record, width: int) -> str:
    e = rec.event
    assert e is not None
    where = getattr(e, "domain", "") or getattr(e, "target", "") or getattr(e, "active", "") or "-"
    body = msgspec.json.encode(_payload_for_display(e)).decode()
    return f"seq {rec.seq:>7}  {_name(e):<{width}} {where:<8} {body}"


def render_tree(roots: list[Node]) -> str:
    """The forest, one event a line: a root with `●`, what it caused beneath it with `├─`/`└─`, and a
    `! ` line under any event whose link to its cause is missing or broken."""
    widths: list[int] = []

    def walk(n: Node) -> None:
        if n.rec.event is not None:
            widths.append(len(_name(n.rec.event)))
        for c in n.children:
            walk(c)

    for r in roots:
        walk(r)
    width = max([14, *widths])
    lines: list[str] = []

    def emit(n: Node, lead: str, rest: str) -> None:
        lines.append(lead + _line(n.rec, width))
        if n.missing:
            lines.append(rest + "   ! " + n.missing)
        for i, c in enumerate(n.children):
            last = i == len(n.children) - 1
            emit(c, rest + ("└─ " if last else "├─ "), rest + ("   " if last else "│  "))

    for r in roots:
        emit(r, "● ", "  ")
    return "\n".join(lines)


def tree_json(roots: list[Node]) -> list[dict[str, Any]]:
    def one(n: Node) -> dict[str, Any]:
        r = n.rec
        return {
            "seq": r.seq,
            "time": r.time.isoformat(),
            "subject": r.subject,
            "type": ev.tag_of(r.event) if r.event is not None else None,
            "cause": r.event.cause if r.event is not None else 0,
            "event": msgspec.to_builtins(r.event) if r.event is not None else None,
            "missing_link": n.missing or None,
            "caused": [one(c) for c in n.children],
        }

    return [one(n) for n in roots]


def concerns_model(rec: Record, model: str, domain: str = "") -> bool:
    """Whether the record is the model's own: its declaration, admission or residency."""
    return _concerns_model(rec, model, domain)
