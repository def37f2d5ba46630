"""Checking a writer's receipts against the JetStream log (the comparison is `haru.core.receipts`).

    regressions = await check(log, log.receipts())
    log.receipt_guard.found      # what an EventLog's own guard found after reconnects and conflicts
    log.receipt_guard.record_as(domain="a")   # an agent: found regressions become domain_log_regressed
    log.receipt_guard.record_as()             # the promoter: log_regressed on each fleet's integrity subject
    registry.register(RegressionCollector(log.receipt_guard))   # haru_log_regressions_total on /metrics

For each subject the writer was acknowledged on: one read of the subject's last message and, when
that is not the receipt's own, one read of the receipt's sequence. Run on reconnect and when an
append meets a conflict whose current sequence is below what this writer was acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import structlog
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from haru.core import subjects
from haru.core.errors import Conflict, LogError
from haru.core.receipts import Receipt, Regression, compare, regressed
from haru.log.record import body_hash

if TYPE_CHECKING:
    from haru.log.jetstream import JetStreamClient
    from haru.log.js_events import JetStreamEvents

__all__ = ["RegressionCollector", "ReceiptGuard", "check", "record_regressions"]

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

    def __init__(self, log: JetStreamEvents, receipts: Callable[[], Mapping[str, Receipt]]) -> None:
        self._log = log
        self._receipts = receipts
        self.found: list[Regression] = []
        self.listeners: list[Callable[[Regression], None]] = []
        self._reported: set[tuple[str, int]] = set()
        self._task: asyncio.Task[None] | None = None
        self._recorder: Callable[[list[Regression]], Awaitable[None]] | None = None
        self.recorded: list[int] = []  # stream sequences of the regression events this writer appended

    def record_as(self, *, domain: str = "") -> None:
        """Record what is found as events on a subject this writer owns (`record_regressions`): an
        agent passes its `domain`, the promoter nothing. Without this the guard only logs and counts."""

        async def record(found: list[Regression]) -> None:
            self.recorded += await record_regressions(self._log, found, domain=domain)

        self._recorder = record

    @property
    def role(self) -> str:
        """The writer's role: its writer id up to the first ':' (`agent:default/a@host` -> agent)."""
        return self._log.writer.split(":", 1)[0]

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
        new: list[Regression] = []
        for r in regressions:
            if (r.subject, r.acknowledged) in self._reported:
                continue
            self._reported.add((r.subject, r.acknowledged))
            self.found.append(r)
            new.append(r)
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
        if new and self._recorder is not None:
            await self._recorder(new)
        return regressions


async def record_regressions(log: JetStreamEvents, found: list[Regression], *, domain: str = "") -> list[int]:
    """Append what was found (`haru.core.receipts.regressed`: one event per fleet on the writer's own
    integrity subject), each sequence-checked against the subject's current last sequence and retried
    on a conflict (another replica recording too). Returns the appended events' stream sequences."""
    seqs = []
    for subject, event in regressed(found, at=datetime.now(UTC), domain=domain):
        for _ in range(5):
            try:
                seq = await log.append(subject, event, expect=await log.last_seq_of(subject))
            except Conflict:
                continue
            seqs.append(seq)
            _log.error(
                "eventlog.regression_recorded", writer=log.writer, subject=subject, seq=seq, lost=len(event.lost)
            )
            break
        else:
            _log.error("eventlog.regression_unrecorded", writer=log.writer, subject=subject, lost=len(event.lost))
    return seqs


class RegressionCollector(Collector):
    """`haru_log_regressions_total{fleet, subject_kind, writer}`: acknowledged ranges this process found
    the log had lost, by the fleet and kind of the subject and the writer's role (the part of its writer
    id before ':': agent, promoter, projector, gateway). Read from the guard at scrape time."""

    def __init__(self, guard: ReceiptGuard) -> None:
        self.guard = guard

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "haru_log_regressions",
            "Acknowledged event ranges the event log no longer held when this writer checked its receipts "
            "(power loss with lazy fsync, a damaged or restored store).",
            labels=["fleet", "subject_kind", "writer"],
        )
        writer = self.guard.role
        counts: dict[tuple[str, str], int] = {}
        for r in self.guard.found:
            where = subjects.where(r.subject)
            key = (subjects.fleet_of(r.subject), where.kind if where is not None else "")
            counts[key] = counts.get(key, 0) + 1
        for (fleet, kind), n in sorted(counts.items()):
            family.add_metric([fleet, kind, writer], n)
        yield family
