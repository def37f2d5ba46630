"""Receipts: what a writer was acknowledged, compared with what the log holds now.

A writer that appended to a subject and got an acknowledgement keeps a receipt: the stream sequence
of its last acknowledged event there and the sha256 of that event's body (the same hash the next
event's `prev` carries). A log that lost acknowledged writes (a power cut with lazy fsync, a damaged
block file, a store restored from an old backup) gives itself away against a receipt:

- *behind*: the subject's last sequence is below the receipt's (the tail after `held` is gone);
- *rewritten*: the sequence exists but holds another body, or another subject's event (the log was
  recreated and refilled, so old sequence numbers now name new events).

Either way the events after `held` up to the receipt's sequence are lost. Pure: the caller reads
the log and passes what it found.

    events = regressed(regressions, at=now, domain="a")   # [(subject, event)]: what the writer records

A writer records what it found as an event on a subject it owns: an agent `domain_log_regressed` on
`haru.evt.<fleet>.<domain>.integrity`, the promoter `log_regressed` on `haru.evt.<fleet>.integrity`
(one per fleet). `in_scope` is what a fold believes of such an event: only the ranges on subjects
its writer (known from the subject it stands on) may write.

    event = restated(model_state, domain="a", model="m", at=now)   # what an agent re-reports

A writer then re-establishes what it still knows to be true instead of carrying on from the shorter
log: an agent appends, on each model subject that lost events, the event that establishes the state
the model is in now (`restated`; a resident model: `model_resident` again); the promoter, whose
route pointer the log rewound to a revision it knew was superseded, moves it back to the domain it
had decided (`route_to_restore`) through the normal sequence-checked append, when that domain is
still fit to serve and no operation is in flight.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec

from haru.core import authority, fold_anomalies, residency, subjects
from haru.core import events as ev
from haru.core.views import FleetView

__all__ = [
    "Receipt",
    "Regression",
    "compare",
    "describe",
    "in_scope",
    "reading",
    "regressed",
    "restated",
    "route_to_restore",
]


class Receipt(msgspec.Struct, frozen=True):
    """The last event a writer was acknowledged on one subject."""

    seq: int
    hash: str


class Regression(msgspec.Struct, frozen=True):
    """The log holds less than it acknowledged on `subject`: events after `held` up to
    `acknowledged` (stream sequences) are lost. `reason`: behind | rewritten."""

    subject: str
    acknowledged: int
    held: int
    reason: str
    expected: str = ""  # the hash of the body acknowledged at `acknowledged`

    def describe(self) -> str:
        what = (
            f"its last event there is now {self.held}"
            if self.reason == "behind"
            else f"sequence {self.acknowledged} now holds other content"
        )
        return (
            f"the event log lost acknowledged events on {self.subject}: it acknowledged sequence "
            f"{self.acknowledged}, {what} (lost: after {self.held} up to {self.acknowledged})"
        )


def compare(subject: str, receipt: Receipt, *, last_seq: int, hash_at_receipt: str | None) -> Regression | None:
    """None when the log still holds the receipt's event; else what was lost.

    `last_seq`: the subject's last stream sequence now (0 when empty). `hash_at_receipt`: the body
    hash of the message now at the receipt's sequence when it is on `subject`, else None."""
    if hash_at_receipt == receipt.hash:
        return None
    if last_seq < receipt.seq:
        return Regression(subject, receipt.seq, last_seq, "behind", receipt.hash)
    # The sequence is there again but is not ours: everything we knew on the subject is suspect.
    return Regression(subject, receipt.seq, 0, "rewritten", receipt.hash)


def reading(held_seq: int, held_body: bytes, seq: int, body: bytes) -> str:
    """What a reader that holds (held_seq, held_body) does with a message at `seq`: "next" (newer:
    take it), "same" (a redelivery of what it holds: nothing to do) or "reset" (the sequence went
    backwards, or the one it holds now has other content: the log was rewound, so what the reader
    holds may be something the log forgot; take this one and re-read, never ignore it as older)."""
    if seq > held_seq:
        return "next"
    if seq == held_seq and body == held_body:
        return "same"
    return "reset"


def _lost(r: Regression) -> ev.LostRange:
    return ev.LostRange(
        subject=r.subject,
        acknowledged=r.acknowledged,
        held=r.held,
        reason="behind" if r.reason == "behind" else "rewritten",
        expected=r.expected,
    )


def regressed(
    regressions: list[Regression], *, at: datetime, domain: str = ""
) -> list[tuple[str, ev.LogRegressed | ev.DomainLogRegressed]]:
    """The events a writer records for what it found, with the subjects they go to: with `domain` (an
    agent) one `domain_log_regressed` per fleet on that domain's integrity subject; without (the
    promoter) one `log_regressed` per fleet on the fleet's. Regressions on subjects that are not Haru
    event subjects are left out (nothing could say whose they are)."""
    by_fleet: dict[str, list[ev.LostRange]] = {}
    for r in regressions:
        fleet = subjects.fleet_of(r.subject)
        if fleet and subjects.where(r.subject) is not None:
            by_fleet.setdefault(fleet, []).append(_lost(r))
    out: list[tuple[str, ev.LogRegressed | ev.DomainLogRegressed]] = []
    for fleet, lost in sorted(by_fleet.items()):
        if domain:
            out.append(
                (subjects.domain_integrity(fleet, domain), ev.DomainLogRegressed(at=at, domain=domain, lost=lost))
            )
        else:
            out.append((subjects.integrity(fleet), ev.LogRegressed(at=at, fleet=fleet, lost=lost)))
    return out


def in_scope(subject: str, lost: ev.LostRange) -> bool:
    """Whether the writer of a regression event stored on `subject` could have been acknowledged on
    `lost.subject`: the same fleet and, for an agent (a domain's integrity subject), its own domain's
    subjects; for the promoter the fleet's subjects the promoter writes. The subject is the authority:
    a range on anybody else's subject is not believed."""
    here, there = subjects.where(subject), subjects.where(lost.subject)
    if here is None or there is None or here.fleet != there.fleet:
        return False
    if here.kind == "domain_integrity":
        return there.domain == here.domain and "agent" in authority.writers_of(there.kind)
    return "promoter" in authority.writers_of(there.kind)


def describe(lost: list[ev.LostRange]) -> str:
    """`<subject> after <held> up to <acknowledged> (expected <hash[:12]>)`, joined: the ranges lost."""
    return "; ".join(
        f"{r.subject} after {r.held} up to {r.acknowledged}" + (f" (expected {r.expected[:12]})" if r.expected else "")
        for r in lost
    )


def restated(state: residency.Residency, *, domain: str, model: str, at: datetime) -> ev.Event | None:
    """The residency event that establishes `state` again (None for `unknown` and `not_admitted`,
    which no agent event states): what an agent re-reports on a model subject the log rewound."""
    about: dict[str, Any] = {"at": at, "domain": domain, "model": model}
    if isinstance(state, residency.Resident):
        return ev.ModelResident(**about, endpoint=state.endpoint, warmup_ms=state.warmup_ms, sleeps=state.sleeps)
    if isinstance(state, residency.Sleeping):
        return ev.ModelSleeping(**about, level=state.level, detail="re-reported after the event log lost events")
    if isinstance(state, residency.Loading):
        return ev.ModelLoading(**about, endpoint=state.endpoint, attempt=state.attempt, waiting_for=state.waiting_for)
    if isinstance(state, residency.Waking):
        return ev.ModelWaking(**about)
    if isinstance(state, residency.Lost):
        return ev.ModelLost(**about, reason=state.reason, detail=state.detail)
    if isinstance(state, residency.Failed):
        return ev.ModelFailed(**about, runtime_said=state.runtime_said)
    if isinstance(state, residency.Stopped):
        return ev.ModelStopped(**about, detail=state.detail)
    if isinstance(state, residency.Pulling):
        return ev.ModelPulling(
            **about, reference=state.reference, done_bytes=state.done_bytes, total_bytes=state.total_bytes
        )
    return None


def route_to_restore(view: FleetView, known_active: str, *, at: datetime) -> ev.RouteMoved | None:
    """The `route_moved` that puts the pointer back where the promoter had moved it before the log forgot
    (`known_active`), folded into `view` from the shorter log; None when the log already says so, an
    operation is in flight (its saga resumes from the log and flips by its own step), or that domain is
    no longer declared or not fit to serve (unreachable, a GPU gone, a served model lost or failed: then
    the ordinary decisions take over)."""
    if not known_active or view.active == known_active or view.operation is not None:
        return None
    domain = view.domains.get(known_active)
    if domain is None or not fold_anomalies.recovered(domain):
        return None
    return ev.RouteMoved(at=at, active=known_active, previous=view.active or "")
