"""Checking a writer's receipts against the JetStream log (the comparison is `haru.core.receipts`).

    regressions = await check(log, log.receipts())

For each subject the writer was acknowledged on: one read of the subject's last message and, when
that is not the receipt's own, one read of the receipt's sequence. Run on reconnect and when an
append meets a conflict whose current sequence is below what this writer was acknowledged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from haru.core import subjects
from haru.core.receipts import Receipt, Regression, compare
from haru.log.record import body_hash

if TYPE_CHECKING:
    from haru.log.jetstream import JetStreamClient

__all__ = ["check"]


async def check(log: JetStreamClient, receipts: Mapping[str, Receipt]) -> list[Regression]:
    """Every subject where the log now holds less than `receipts` say it acknowledged."""
    found = []
    for subject, receipt in sorted(receipts.items()):
        last = await log._last_raw(subjects.EVENTS_STREAM, subject)
        last_seq = last[0] if last is not None else 0
        if last is not None and last_seq == receipt.seq:
            held: str | None = body_hash(last[1])
        elif last_seq < receipt.seq:
            held = None
        else:
            at = await log._get_seq(subjects.EVENTS_STREAM, receipt.seq)
            held = body_hash(at[1]) if at is not None and at[0] == subject else None
        regression = compare(subject, receipt, last_seq=last_seq, hash_at_receipt=held)
        if regression is not None:
            found.append(regression)
    return found
