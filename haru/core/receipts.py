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
"""

from __future__ import annotations

import msgspec

__all__ = ["Receipt", "Regression", "compare", "reading"]


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
        return Regression(subject, receipt.seq, last_seq, "behind")
    # The sequence is there again but is not ours: everything we knew on the subject is suspect.
    return Regression(subject, receipt.seq, 0, "rewritten")


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
