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
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from haru.core import authority, subjects
from haru.core import events as ev

__all__ = ["Receipt", "Regression", "compare", "describe", "in_scope", "reading", "regressed"]


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
