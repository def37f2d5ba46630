"""Checking a writer's receipts against the JetStream log (the comparison is `haru.core.receipts`).

    regressions = await check(log, log.receipts())
    log.receipt_guard.found      # what an EventLog's own guard found after reconnects and conflicts

For each subject the writer was acknowledged on: one read of the subject's last message and, when
that is not the receipt's own, one read of the receipt's sequence. Run on reconnect and when an
append meets a conflict whose current sequence is below what this writer was acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import structlog

from haru.core import subjects
from haru.core.errors import LogError
from haru.core.receipts import Receipt, Regression, compare
from haru.log.record import body_hash

if TYPE_CHECKING:
    from haru.log.jetstream import JetStreamClient

__all__ = ["ReceiptGuard", "check"]

_log = structlog.get_logger("haru.log.receipts")


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


class ReceiptGuard:
    """Checks a writer's receipts when its connection comes back (the server may have restarted on a
    store that forgot) and when an append conflict says the log is behind what it acknowledged.

    Each regression found is logged once (`eventlog.log_regressed`, an error line naming the subject
    and the lost range), kept in `found`, and passed to every listener (`on_regression`), so a
    service can re-establish what it knows (re-report, re-decide) instead of carrying on from the
    shorter log."""

    RETRY_S = 0.25  # between checks while the restarted server's JetStream is not answering yet
    WITHIN_S = 30.0  # how long a check keeps trying after a reconnect

    def __init__(self, log: JetStreamClient, receipts: Callable[[], Mapping[str, Receipt]]) -> None:
        self._log = log
        self._receipts = receipts
        self.found: list[Regression] = []
        self.listeners: list[Callable[[Regression], None]] = []
        self._reported: set[tuple[str, int]] = set()
        self._task: asyncio.Task[None] | None = None

    def on_regression(self, listener: Callable[[Regression], None]) -> None:
        self.listeners.append(listener)

    def link_changed(self, up: bool) -> None:
        if up:
            self.schedule()

    def schedule(self) -> None:
        """Check soon, in the background (one check at a time)."""
        if self._task is None or self._task.done():
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to check from
                self._task = asyncio.get_running_loop().create_task(self._check_until_answered())

    async def _check_until_answered(self) -> None:
        deadline = asyncio.get_running_loop().time() + self.WITHIN_S
        while True:
            try:
                await self.check_now()
                return
            except LogError:
                if asyncio.get_running_loop().time() > deadline:
                    _log.warning("eventlog.receipts_unchecked", writer=self._log.writer, within_s=self.WITHIN_S)
                    return
                await asyncio.sleep(self.RETRY_S)

    async def check_now(self) -> list[Regression]:
        """Check every receipt now; report the regressions not reported before. Returns them all."""
        regressions = await check(self._log, self._receipts())
        for r in regressions:
            if (r.subject, r.acknowledged) in self._reported:
                continue
            self._reported.add((r.subject, r.acknowledged))
            self.found.append(r)
            _log.error(
                "eventlog.log_regressed",
                writer=self._log.writer,
                subject=r.subject,
                acknowledged=r.acknowledged,
                held=r.held,
                reason=r.reason,
                lost=f"after {r.held} up to {r.acknowledged}",
                hint="the event store lost events it had acknowledged (docs/operations.md, 'Power loss')",
            )
            for listener in list(self.listeners):
                try:
                    listener(r)
                except Exception as exc:  # noqa: BLE001 - a listener's bug must not stop the others
                    _log.warning("eventlog.regression_listener_failed", error=str(exc))
        return regressions
