"""Checking a writer's receipts against the JetStream log (the comparison is `haru.core.receipts`).

    regressions = await check(log, log.receipts())
    log.receipt_guard.found      # what an EventLog's own guard found after reconnects and conflicts
    log.receipt_guard.record_as(domain="a")   # an agent: found regressions become domain_log_regressed
    log.receipt_guard.record_as()             # the promoter: log_regressed on each fleet's integrity subject
    registry.register(RegressionCollector(log.receipt_guard))   # haru_log_regressions_total on /metrics
    log.receipt_guard.persist(state_dir / "receipts.json")   # an agent: receipts that outlive the process

For each subject the writer was acknowledged on: one read of the subject's last message and, when
that is not the receipt's own, one read of the receipt's sequence. Run on reconnect and when an
append meets a conflict whose current sequence is below what this writer was acknowledged.

A writer whose receipts must outlive its process (an agent: the log may lose power while the agent is
down) keeps them in a file (`persist`): read at start and checked against the log at once, rewritten
after appends (a temp file, fsync, rename, fsync of the directory: never half a file), at most every
`SAVE_EVERY_S` and once more at close. A receipt whose loss was recorded is dropped (the writer
re-establishes that subject), so a restart does not report the same loss again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
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

__all__ = [
    "RECEIPTS_FILE",
    "ReceiptGuard",
    "RegressionCollector",
    "check",
    "load_receipts",
    "record_regressions",
    "save_receipts",
]

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


_FILE_VERSION = 1
RECEIPTS_FILE = "receipts.json"  # an agent's, in its state_dir


class _ReceiptFile(msgspec.Struct, frozen=True):
    v: int
    writer: str
    receipts: dict[str, Receipt]


_file_decoder = msgspec.json.Decoder(_ReceiptFile)
_file_encoder = msgspec.json.Encoder()


def load_receipts(path: Path) -> dict[str, Receipt]:
    """The receipts a previous run kept at `path` ({} when there is none, or when it cannot be read:
    logged, never fatal: without them the writer only checks what it appends from now on)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        _log.warning("eventlog.receipts_unreadable", path=str(path), error=str(exc))
        return {}
    try:
        return dict(_file_decoder.decode(data).receipts)
    except msgspec.DecodeError as exc:
        _log.warning(
            "eventlog.receipts_unreadable",
            path=str(path),
            error=str(exc),
            hint="the file is rewritten at the next append; losses before it cannot be told",
        )
        return {}


def save_receipts(path: Path, writer: str, receipts: Mapping[str, Receipt]) -> None:
    """Write the receipts atomically and durably: temp file, fsync, rename, fsync of the directory."""
    data = _file_encoder.encode(_ReceiptFile(_FILE_VERSION, writer, dict(receipts)))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ReceiptGuard:
    """Checks a writer's receipts when its connection comes back (the server may have restarted on a
    store that forgot) and when an append conflict says the log is behind what it acknowledged.

    Each regression found is logged once (`eventlog.log_regressed`, an error line naming the subject
    and the lost range), kept in `found`, and passed to every listener (`on_regression`), so a
    service can re-establish what it knows (re-report, re-decide) instead of carrying on from the
    shorter log."""

    RETRY_S = 0.25  # between checks while the restarted server's JetStream is not answering yet
    WITHIN_S = 30.0  # how long a check keeps trying after a reconnect
    SAVE_EVERY_S = 0.05  # a persisted guard rewrites its file at most this often (appends in between share it)

    def __init__(self, log: JetStreamEvents, receipts: Callable[[], Mapping[str, Receipt]]) -> None:
        self._log = log
        self._receipts = receipts
        self.found: list[Regression] = []
        self.listeners: list[Callable[[Regression], None]] = []
        self._reported: set[tuple[str, int]] = set()
        self._task: asyncio.Task[None] | None = None
        self._recorder: Callable[[list[Regression]], Awaitable[None]] | None = None
        self._then: list[Callable[[list[Regression]], Awaitable[None]]] = []
        self.recorded: list[int] = []  # stream sequences of the regression events this writer appended
        self._path: Path | None = None
        self._dirty: asyncio.Event | None = None
        self._saver: asyncio.Task[None] | None = None

    def persist(self, path: Path) -> None:
        """Keep this writer's receipts in `path` across restarts: adopt the ones a previous run left
        there (subjects this run has not appended to yet), check them against the log now, and keep the
        file current from here on. Call from the running event loop, before the writer's first append."""
        kept = load_receipts(path)
        self._log.adopt_receipts(kept)
        self._path = path
        self._dirty = asyncio.Event()
        self._saver = asyncio.get_running_loop().create_task(self._save_when_changed())
        if kept:
            _log.info("eventlog.receipts_loaded", writer=self._log.writer, path=str(path), subjects=len(kept))
            self.schedule()

    def changed(self) -> None:
        """A receipt changed (an append was acknowledged): a persisted guard rewrites its file soon."""
        if self._dirty is not None:
            self._dirty.set()

    async def _save_when_changed(self) -> None:
        assert self._dirty is not None
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            await self._save()
            await asyncio.sleep(self.SAVE_EVERY_S)

    async def _save(self) -> None:
        if self._path is None:
            return
        try:
            await asyncio.to_thread(save_receipts, self._path, self._log.writer, self._receipts())
        except OSError as exc:
            _log.error("eventlog.receipts_unsaved", path=str(self._path), error=str(exc))

    async def close(self) -> None:
        """Stop checking; a persisted guard writes its file one last time."""
        for task in (self._task, self._saver):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._path is not None and self._dirty is not None and self._dirty.is_set():
            await self._save()

    def record_as(self, *, domain: str = "") -> None:
        """Record what is found as events on a subject this writer owns (`record_regressions`): an
        agent passes its `domain`, the promoter nothing. Without this the guard only logs and counts."""

        async def record(found: list[Regression]) -> None:
            self.recorded += await record_regressions(self._log, found, domain=domain)

        self._recorder = record

    def after_recording(self, then: Callable[[list[Regression]], Awaitable[None]]) -> None:
        """Once what was found is recorded, `await then(found)`: the writer re-establishes what it knows
        (an agent re-reports its models and GPUs on the subjects that lost events)."""
        self._then.append(then)

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
            # Recorded: the writer re-establishes these subjects; their old receipts would only report
            # the same loss again (after a restart, from the file).
            for r in new:
                self._log.forget_receipt(r.subject, r.acknowledged)
            self.changed()
            for then in list(self._then):
                try:
                    await then(new)
                except LogError as exc:  # the log went away again: the next reconnect checks once more
                    _log.warning("eventlog.reestablish_failed", writer=self._log.writer, error=str(exc))
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
