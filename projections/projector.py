"""The projector service: `HARU_EVENTS` -> fleet views in KV `haru_views` and route intents on
`haru.route.<fleet>`. The imperative shell around the pure folds in `haru.core.fold` and
`haru.core.intents`.

    async with EventLog.connect(servers, writer="projector:host:pid") as log:
        await log.ensure()
        await Projector(log).run()          # until cancelled

Start. The fleets of the log are the fleets that have declarations (`haru.evt.*.decl`). Each one's
stored view is read from KV; the replay resumes from the smallest stored `position` + 1, where
position = max(view.seq, view.checkpoint) (from 1 when a declared fleet has no stored view yet).
Events at or below a fleet's own view `seq` are skipped for that fleet
(`haru.core.fold.add_one`), so fleets whose views are further ahead are not folded twice. A
fleet first met during the replay (events but no declaration) starts empty. The checkpoint of a
fleet that has been quiet for `checkpoint_lag` events is advanced (its view rewritten), so one idle
fleet does not pin every restart to its last event.

Follow. A `haru.log.follow.Follower` follows the log until cancelled: when the stream holds messages
past the last one handled and the replay makes no progress for a couple of seconds (nats-py's
ordered consumer takes ~20 s to notice a NATS restart), or the connection comes back, the replay is
restarted after the last sequence handled.

Fold. The replay handler is synchronous: it decodes nothing itself (the log did), folds the record
into the fleet's `haru.core.fold.Folder` (an incremental fold, equal to `evolve`, that builds the
frozen view only when something reads it: a write, a route move's intent), marks the fleet dirty,
and when the record moved the route pointer it snapshots the route intent at that very sequence,
so every pointer move becomes an intent even when writes are coalesced. A body that is not a valid
event is logged, counted in the view's `anomalies`, and skipped; so is an event that may not stand
on the subject it was stored on (`haru.core.authority`: a `route_moved` on an agent's subject, a body
naming another domain than its subject), which is never applied.

Write. A single flusher task wakes whenever the handler folded something and the handler yields
(nats-py runs the handler back to back while messages are queued, so a replay is naturally
batched: one write per fleet per batch, not per event). The dirty fleets are written
concurrently (their subjects and keys are independent: during a rebuild the acks of one fleet's
intents no longer wait behind another's), each fleet's writes in this order:

1. publish the intents snapshotted at route moves, then the current intent if it `changed`, each
   with `expect` = the last intent's stream sequence. On Conflict: read the last intent; if it was
   computed from a view at or after ours (`view_seq`), or says the same, ours is not published;
   otherwise retry on top of it. Intents therefore never go backwards, and two projectors publish
   each pointer move once.
2. write the view with `put_view(key, data, last=revision read)`. On Conflict: read the stored
   view; if its position is at or after ours, adopt it (a view never overwrites a newer one) and the
   fold skips what it covers; otherwise retry on its revision.

Intents go before the view: a crash between the two replays those events on restart, and intents
already published are recognised by `view_seq` and not repeated. A failed write (NATS away) is
retried with backoff while folding goes on.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

import msgspec
import structlog

from haru.core import checkpoints, subjects
from haru.core.errors import Conflict, LogError
from haru.core.events import Checkpoint, RouteMoved
from haru.core.fold import Folder, add_one, empty, fleet_of
from haru.core.intents import changed, intent
from haru.core.record import Record, body_hash
from haru.core.restarts import Backoff
from haru.core.views import FleetView, RouteIntent, intent_decoder, view_decoder, view_encoder
from haru.host import alive
from haru.host.tasks import cancel_and_wait
from haru.log.follow import Follower
from haru.log.seam import Log
from haru.log.waiting import until_available

log_ = structlog.get_logger("haru.projector")


class _ScanDone(Exception):
    """Ends a heads scan at the follower's start."""


CHECKPOINT_LAG = 10_000  # advance an idle fleet's checkpoint when it is this many events behind


def position(view: FleetView) -> int:
    """The stream sequence up to which a view is complete."""
    return max(view.seq, view.checkpoint)


@dataclass
class Stats:
    """What a projector did, for logs, tests and the benchmark."""

    resumed_from: int = 0  # the replay's first sequence
    handled: int = 0  # records folded (skipped ones not counted)
    invalid: int = 0  # bodies that were not valid events
    misplaced: int = 0  # events that may not stand on their subject (haru.core.authority): not applied
    skipped: int = 0  # records at or below their fleet's view seq, or not on a fleet subject
    view_writes: int = 0
    view_conflicts: int = 0
    views_adopted: int = 0
    intents_published: int = 0
    intent_conflicts: int = 0
    last_seq: int = 0  # the last sequence handled
    last_time_ns: int = 0  # when JetStream recorded it (the metrics' lag in seconds)
    flushes: int = 0
    failures: int = 0  # records the fold raised on (a bug): logged and skipped
    replay_restarts: int = 0  # replays started again (stalled, after a NATS reconnect, interrupted)
    log_rewinds: int = 0  # the log found behind what was folded (it lost events): every fleet folded again
    fleets: set[str] = field(default_factory=set)


class Projector:
    """Folds the log into views and intents. One instance per process; many processes may race."""

    def __init__(
        self,
        log: Log,
        *,
        checkpoint_lag: int = CHECKPOINT_LAG,
        stall_interval: float = 1.0,
        stall_checks: int = 2,
        checkpoint_every: int = checkpoints.CHECKPOINT_EVERY,
        from_checkpoint: bool = False,
    ) -> None:
        self.follower: Follower | None = None
        self.log = log
        self.checkpoint_lag = checkpoint_lag
        self.stall_interval = stall_interval
        self.stall_checks = stall_checks
        self._folders: dict[str, Folder] = {}  # each fleet's view, folded incrementally
        # Checkpoints (haru/core/checkpoints.py): every subject's chain head per fleet, as (seq, body or its
        # hash); events of the fleet since its last checkpoint; its count there; the checkpoint
        # subject's last sequence; the fleets whose heads are complete (known since sequence 1).
        self.checkpoint_every = checkpoint_every
        self.from_checkpoint = from_checkpoint
        self._heads: dict[str, dict[str, tuple[int, bytes | str]]] = {}
        self._cp_count: dict[str, int] = {}
        self._cp_events: dict[str, int] = {}
        self._cp_seq: dict[str, int] = {}
        self._heads_ok: set[str] = set()
        self._scans: list[tuple[str, int, int]] = []  # (fleet, first, end): heads to read, see `load`
        self.checkpoints_written = 0
        self.stats = Stats()
        self._revs: dict[str, int] = {}  # KV revision of each fleet's view as last read or written
        self._stored: dict[str, int] = {}  # position of the view stored in KV, as far as we know
        self._dirty: set[str] = set()
        self._pending: dict[str, list[RouteIntent]] = {}  # intents snapshotted at route moves
        self._intents: dict[str, tuple[RouteIntent | None, int]] = {}  # last known intent, its seq
        # Fleets folded again after the log was rewound: their next view and intent replace what is stored,
        # whatever position that claims (it was folded from events the log lost).
        self._overwrite: set[str] = set()
        self._refold_until = 0  # while folding again up to here, nothing is written (no view from half a log)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # set whenever everything folded is written
        self._idle.set()
        self._caught_up_at = 0  # the stream's last seq when we started; logged once reached
        self._started = 0.0
        self.started_wall = time.time()

    @property
    def views(self) -> dict[str, FleetView]:
        """The current view of every fleet (materialized now: for tests and logs, not the hot path)."""
        return {fleet: folder.view() for fleet, folder in self._folders.items()}

    # ------------------------------------------------------------------------------- start

    def _load_retried(self, exc: Exception) -> None:
        log_.warning("projector.load_retried", error=str(exc), detail="the log is between leaders: asking again")

    async def load(self) -> int:
        """Read the stored views of every declared fleet; return the sequence to replay from."""
        fleets = {fleet_of(subject) for subject in await self.log.subject_counts("haru.evt.*.decl")}
        fleets.discard("")
        cps = {fleet: await self._last_checkpoint(fleet) for fleet in sorted(fleets)}
        for fleet in sorted(fleets):
            await self._load_view(fleet, cps[fleet])
        from_seq = min((position(v) for v in self.views.values()), default=0) + 1
        self.stats.resumed_from = from_seq
        # The chain heads a checkpoint needs: the last checkpoint's, then what lies between it and
        # where the replay starts (about `checkpoint_every` events of the fleet; the whole fleet once,
        # the first time a fleet without any checkpoint is met), read by `run` beside the follower.
        self._scans = []
        for fleet, cp in cps.items():
            start = 1
            if cp is not None:
                self._heads[fleet] = {s: (q, h) for s, (q, h) in checkpoints.heads_of(cp).items()}
                self._cp_events[fleet] = cp.events
                start = cp.upto + 1
            if start < from_seq:
                self._scans.append((fleet, start, from_seq))
            else:
                self._heads_ok.add(fleet)
        return from_seq

    async def _scan_heads(self) -> None:
        """For each fleet whose heads are incomplete: read its events from its last checkpoint up to
        where the follower started (the follower counts the rest), then the fleet may checkpoint."""
        for fleet, start, end in self._scans:
            heads = self._heads.setdefault(fleet, {})

            def track(rec: Record, heads=heads, fleet=fleet, end=end) -> None:
                if rec.seq >= end:
                    raise _ScanDone
                prior = heads.get(rec.subject)
                if prior is None or prior[0] < rec.seq:
                    heads[rec.subject] = (rec.seq, rec.data)
                self._cp_count[fleet] = self._cp_count.get(fleet, 0) + 1

            try:
                await self.log.replay(track, from_seq=start, subject_filter=subjects.fleet_events(fleet), headers=False)
            except _ScanDone:
                pass
            except LogError as exc:
                log_.warning(
                    "projector.heads_scan_failed",
                    fleet=fleet,
                    error=str(exc),
                    detail="no checkpoint for this fleet until the projector restarts",
                )
                continue
            self._heads_ok.add(fleet)
            log_.info("projector.heads_scanned", fleet=fleet, from_seq=start, to_seq=end - 1, subjects=len(heads))
        self._scans = []
        self._wake.set()  # a checkpoint may be due now

    async def _last_checkpoint(self, fleet: str) -> Checkpoint | None:
        rec = await self.log.last(subjects.checkpoint(fleet))
        if rec is None:
            return None
        self._cp_seq[fleet] = rec.seq
        e = rec.event
        if not isinstance(e, Checkpoint) or e.fleet != fleet:
            log_.warning(
                "projector.checkpoint_unreadable", fleet=fleet, seq=rec.seq, error=rec.error or "not a checkpoint"
            )
            return None
        return e

    async def _load_view(self, fleet: str, cp: Checkpoint | None = None) -> FleetView:
        key = subjects.view_key(fleet)
        got = await self.log.get_view(key)
        view = empty(fleet)
        rev = 0
        stored = False
        if got is not None:
            data, rev = got
            try:
                view = view_decoder.decode(data)
                stored = True
            except Exception as exc:  # a view written by an incompatible version: rebuild it
                log_.warning("projector.view_unreadable", fleet=fleet, revision=rev, error=str(exc))
                view = empty(fleet)
        if cp is not None and (self.from_checkpoint or not stored):
            from_cp = checkpoints.view_of(cp)
            if from_cp is not None:
                log_.info("projector.from_checkpoint", fleet=fleet, upto=cp.upto, events=cp.events)
                view = from_cp
        self._folders[fleet] = Folder(view)
        self._revs[fleet] = rev
        self._stored[fleet] = position(view)
        return view

    async def run(self, *, from_seq: int | None = None) -> None:
        """Load, replay from the checkpoint and follow the log until cancelled."""
        self._started = time.monotonic()
        if from_seq is None:
            from_seq = await until_available(self.load, on_retry=self._load_retried)  # each try reads it all again
        else:
            self.stats.resumed_from = from_seq
        self._caught_up_at = await until_available(self.log.last_seq)
        log_.info(
            "projector.resume",
            from_seq=from_seq,
            fleets=sorted(self._folders),
            views={f: position(v) for f, v in sorted(self.views.items())},
            stream_last_seq=self._caught_up_at,
        )
        if self._caught_up_at < from_seq - 1:
            # The views have folded events the stream no longer has: it was cut (or restored from an
            # older copy). Following from here would skip the next events written at those numbers.
            log_.error(
                "projector.store_behind_views",
                stream_last_seq=self._caught_up_at,
                views_folded_up_to=from_seq - 1,
                message=f"the store ends at {self._caught_up_at} but the views have folded up to {from_seq - 1}: "
                f"events {self._caught_up_at + 1}..{from_seq - 1} are missing; run `haru verify` and "
                f"restore the store (docs/operations.md, 'Damaged or truncated log')",
            )
        if self._caught_up_at < from_seq:
            self._log_caught_up()
        self.stats.last_seq = max(self.stats.last_seq, from_seq - 1)
        flusher = asyncio.create_task(self._flusher(), name="projector-flusher")
        replay = asyncio.create_task(self._replay(from_seq), name="projector-replay")
        # the gateway's /healthz hears this (haru/host/alive.py): a projector that is not running is down
        beating = asyncio.create_task(alive.beat(self.log.bus, "projector", self.log.writer), name="projector-alive")
        scanning = asyncio.create_task(self._scan_heads(), name="projector-heads")
        try:
            done, _ = await asyncio.wait({flusher, replay}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raise what ended it
        finally:
            await cancel_and_wait(replay, flusher, beating, scanning)
            # Whatever was folded and not yet written: write it (best effort, bounded).
            try:
                async with asyncio.timeout(5.0):
                    await self.flush()
            except Exception as exc:  # noqa: BLE001 - leaving anyway; the next start replays it
                log_.warning("projector.final_flush_failed", error=str(exc))
            log_.info("projector.stopped", **self._stats_dict())

    async def _replay(self, from_seq: int) -> None:
        """Follow the log from `from_seq` (haru/log/follow.py: a stalled replay, or one that NATS's restart
        left behind, is started again after the last sequence folded; a damaged tail is logged once)."""
        # headers=False: the fold reads none, and parsing the two every append writes was ~1.2 us a record.
        self.follower = self.log.follower(
            self.fold_record,
            from_seq=from_seq,
            name="projector",
            stall_interval=self.stall_interval,
            stall_checks=self.stall_checks,
            on_restart=self._replay_restarted,
            on_rewind=self._rewound,
            headers=False,
        )
        await self.follower.run()

    def _rewound(self, head: int) -> int:
        """The log went back behind what was folded (haru/log/follow.py): every view is folded again from
        sequence 1, and written over what KV and the intents' stream hold, even where those say they are
        further along (they folded events the log no longer has)."""
        log_.warning(
            "projector.rewound",
            folded_up_to=self.stats.last_seq,
            stream_last_seq=head,
            fleets=sorted(self._folders),
            detail="the event log lost events it had; folding every fleet again from sequence 1",
        )
        self.stats.log_rewinds += 1
        self._overwrite |= set(self._folders)
        for state in (self._folders, self._heads, self._cp_count, self._cp_events, self._cp_seq, self._stored):
            state.clear()
        self._heads_ok.clear()
        self._scans = []
        self._intents.clear()
        self._pending.clear()
        self._dirty.clear()
        self.stats.resumed_from = 1
        self.stats.last_seq = 0
        self._refold_until = head
        return 0

    def _replay_restarted(self, why: str) -> None:
        self.stats.replay_restarts += 1

    # -------------------------------------------------------------------------------- fold

    def fold_record(self, rec: Record) -> None:
        """The replay handler (synchronous: nats-py calls it back to back while messages are
        queued, and the flusher runs whenever the queue is drained). The hot path of a rebuild:
        each record is also its subject's chain head (for checkpoints), tracked on the fleet the fold read."""
        seq = rec.seq
        subject = rec.subject
        stats = self.stats
        stats.last_seq = seq
        stats.last_time_ns = rec.time_ns
        event = rec.event
        try:
            folder = add_one(self._folders, event, seq=seq, subject=subject, error=rec.error)
        except Exception as exc:  # a bug in the fold must not stop projection of everything else
            stats.failures += 1
            log_.exception("projector.fold_failed", seq=seq, subject=subject, error=str(exc))
            folder = None
        if folder is None:
            fleet = fleet_of(subject)
            if event is None and not fleet:
                stats.invalid += 1
                log_.warning("projector.invalid_event", seq=seq, subject=subject, error=rec.error)
            stats.skipped += 1
        else:
            fleet = folder.fleet
            if event is None:
                stats.invalid += 1
                log_.warning("projector.invalid_event", seq=seq, subject=subject, error=rec.error)
            stats.handled += 1
            if self._refold_until:
                pass  # folding again after a rewind: written once the fold is back at the log's head
            elif fleet not in self._dirty:
                # Only when the fleet becomes dirty: while it is dirty the flusher has not taken it
                # yet, so `_idle` is still clear and `_wake` still set (the flusher clears `_wake`
                # before it takes the dirty fleets, with no await in between).
                self._dirty.add(fleet)
                stats.fleets.add(fleet)
                self._idle.clear()
                self._wake.set()
            if folder.misplaced_seq == seq:
                stats.misplaced += 1
                log_.warning(
                    "projector.misplaced_event",
                    seq=seq,
                    subject=subject,
                    by=getattr(event, "by", ""),
                    anomaly=folder.view().last_anomaly,
                )
            elif type(event) is RouteMoved:
                self._pending.setdefault(fleet, []).append(intent(folder.view()))
        if fleet:  # the chain head of its subject, and one more event towards the fleet's next checkpoint
            heads = self._heads.get(fleet)
            if heads is None:
                heads = self._heads[fleet] = {}
            prior = heads.get(subject)
            if prior is None or prior[0] < seq:
                heads[subject] = (seq, rec.data)
                cp_count = self._cp_count
                cp_count[fleet] = cp_count.get(fleet, 0) + 1
        if self._caught_up_at and seq >= self._caught_up_at:
            self._log_caught_up()
        if self._refold_until and seq >= self._refold_until:
            self._refolded()

    def _refolded(self) -> None:
        """Folded again up to where the log stood when it was found rewound: write every fleet now."""
        self._refold_until = 0
        self._dirty |= set(self._folders)
        self.stats.fleets |= set(self._folders)
        self._idle.clear()
        self._wake.set()
        log_.warning("projector.refolded", seq=self.stats.last_seq, fleets=sorted(self._folders))

    def _log_caught_up(self) -> None:
        self._caught_up_at = 0
        log_.info(
            "projector.caught_up",
            took_ms=int((time.monotonic() - self._started) * 1000),
            **self._stats_dict(),
        )

    def _stats_dict(self) -> dict:
        s = self.stats
        return dict(
            resumed_from=s.resumed_from,
            last_seq=s.last_seq,
            handled=s.handled,
            skipped=s.skipped,
            invalid=s.invalid,
            misplaced=s.misplaced,
            failures=s.failures,
            view_writes=s.view_writes,
            view_conflicts=s.view_conflicts,
            views_adopted=s.views_adopted,
            intents_published=s.intents_published,
            intent_conflicts=s.intent_conflicts,
            flushes=s.flushes,
            replay_restarts=s.replay_restarts,
            log_rewinds=s.log_rewinds,
        )

    # ------------------------------------------------------------------------------- write

    async def _flusher(self) -> None:
        backoff, failures = Backoff(0.25, 5.0), 0  # failed writes in a row
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.flush()
                failures = 0
            except LogError as exc:
                # NATS restarting, a stream leader election: keep folding, write when it is back.
                failures += 1
                log_.warning("projector.write_failed", error=str(exc), retry_in_s=backoff.delay(failures))
                await asyncio.sleep(backoff.delay(failures))
                self._wake.set()

    async def flush(self) -> None:
        """Write every dirty fleet: its intents, then its view. Fleets are written concurrently
        (their subjects and keys are independent), each one's own writes in order."""
        while self._dirty:
            self.stats.flushes += 1
            # Fleets with a pointer move first: routers wait on those, views can wait a write longer.
            # Take the pending pointer moves and the view of every fleet together (no await in
            # between): a move folded while we publish is after this view, and is published next pass.
            work = []
            for fleet in sorted(self._dirty, key=lambda f: (f not in self._pending, f)):
                work.append((fleet, self._pending.pop(fleet, []), self._folders[fleet].view()))
            self._dirty.clear()
            # return_exceptions: every fleet's writes end (written, or put back) before a failure
            # is raised, so no write of this pass is still running when the flusher retries.
            results = await asyncio.gather(*(self._flush_fleet(*w) for w in work), return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        await self._checkpoint_idle_fleets()
        await self._write_checkpoints()
        if not self._dirty:
            self._idle.set()

    async def _flush_fleet(self, fleet: str, pending: list[RouteIntent], view: FleetView) -> None:
        if fleet in self._overwrite:
            pending = []  # folded again after a rewind: only where the route is now, not each move on the way
        try:
            for ri in pending:
                await self._publish(fleet, ri)
            await self._publish(fleet, intent(view))
            await self._write_view(fleet, view)
        except BaseException:
            # Not written: put it back (publishing is idempotent by view_seq) and let the caller retry.
            self._dirty.add(fleet)
            self._pending[fleet] = pending + self._pending.get(fleet, [])
            raise

    async def _checkpoint_idle_fleets(self) -> None:
        """Move the checkpoint of fleets that saw no event for a while, so they do not pin the
        resume point of a restart to their last event. Everything up to `done` is folded, and a
        fleet that is not dirty has nothing unwritten: its view is complete up to `done`."""
        done = self.stats.last_seq
        for fleet in list(self._folders):
            if fleet in self._dirty or done - self._stored.get(fleet, 0) < self.checkpoint_lag:
                continue
            folder = self._folders[fleet]
            view = folder.view()
            if position(view) >= done:
                continue
            view = msgspec.structs.replace(view, checkpoint=done)
            folder.reset(view)
            await self._write_view(fleet, view)

    async def _write_checkpoints(self) -> None:
        """A `checkpoint` for every fleet with `checkpoint_every` events since its last one, whose
        view is written and whose chain heads are complete (haru/core/checkpoints.py)."""
        for fleet, count in list(self._cp_count.items()):
            if count < self.checkpoint_every or fleet in self._dirty or fleet not in self._folders:
                continue
            if fleet not in self._heads_ok and (self.stats.resumed_from != 1 or fleet in self._folders_scanning()):
                continue  # heads not complete yet (being read, or met during a replay that did not start at 1)
            # One snapshot, no await in between: the view, the heads and the position agree.
            upto = self.stats.last_seq
            view = self._folders[fleet].view()
            raw = dict(self._heads.get(fleet, {}))
            events = self._cp_events.get(fleet, 0) + count
            self._cp_count[fleet] = 0
            heads = {s: (q, d if isinstance(d, str) else body_hash(d)) for s, (q, d) in raw.items()}
            cp = checkpoints.build(fleet, upto=upto, events=events, heads=heads, view=view, now=datetime.now(UTC))
            subject = subjects.checkpoint(fleet)
            try:
                expect = self._cp_seq.get(fleet)
                if expect is None:
                    expect = await self.log.last_seq_of(subject)
                self._cp_seq[fleet] = await self.log.append(subject, cp, expect=expect)
            except Conflict as exc:  # another projector wrote one: ours is not needed
                self._cp_seq[fleet] = exc.current or 0
                continue
            except LogError:
                self._cp_count[fleet] = self._cp_count.get(fleet, 0) + count  # try again next flush
                raise
            self._cp_events[fleet] = events
            self.checkpoints_written += 1
            log_.info(
                "projector.checkpoint",
                fleet=fleet,
                upto=upto,
                seq=self._cp_seq[fleet],
                events=events,
                subjects=len(heads),
            )

    def _folders_scanning(self) -> set[str]:
        return {fleet for fleet, _, _ in self._scans}

    async def wait_idle(self, timeout: float | None = None) -> None:
        """Wait until everything folded so far is written (tests, benchmark)."""
        async with asyncio.timeout(timeout):
            await self._idle.wait()

    async def _last_intent(self, fleet: str) -> tuple[RouteIntent | None, int]:
        known = self._intents.get(fleet)
        if known is None:
            got = await self.log.last_intent(fleet)
            known = (None, 0) if got is None else (self._decode_intent(fleet, got[0]), got[1])
            self._intents[fleet] = known
        return known

    @staticmethod
    def _decode_intent(fleet: str, body: bytes) -> RouteIntent | None:
        try:
            return intent_decoder.decode(body)
        except Exception as exc:  # noqa: BLE001 - an unreadable last intent is superseded by ours
            log_.warning("projector.intent_unreadable", fleet=fleet, error=str(exc))
            return None

    async def _publish(self, fleet: str, ri: RouteIntent) -> None:
        last, seq = await self._last_intent(fleet)
        while True:
            if (
                last is not None
                and fleet not in self._overwrite
                and (last.view_seq >= ri.view_seq or not changed(last, ri))
            ):
                return
            data = view_encoder.encode(ri)
            try:
                new_seq = await self.log.publish_intent(fleet, data, expect=seq)
            except Conflict:
                self.stats.intent_conflicts += 1
                got = await self.log.last_intent(fleet)
                if got is None:  # pragma: no cover - a conflict means something is there
                    last, seq = None, 0
                else:
                    last, seq = self._decode_intent(fleet, got[0]), got[1]
                self._intents[fleet] = (last, seq)
                continue
            self._intents[fleet] = (ri, new_seq)
            self.stats.intents_published += 1
            log_.info(
                "projector.intent_published",
                fleet=fleet,
                seq=new_seq,
                revision=ri.revision,
                active=ri.active.domain if ri.active else "",
                view_seq=ri.view_seq,
            )
            return

    async def _write_view(self, fleet: str, view: FleetView) -> None:
        key = subjects.view_key(fleet)
        pos = position(view)
        if self._stored.get(fleet, 0) >= pos and self._revs.get(fleet, 0) and fleet not in self._overwrite:
            return  # already stored (or a newer one was adopted)
        data = view_encoder.encode(view)
        rev = self._revs.get(fleet, 0)
        while True:
            try:
                self._revs[fleet] = await self.log.put_view(key, data, last=rev)
                self._stored[fleet] = pos
                self._overwrite.discard(fleet)
                self.stats.view_writes += 1
                return
            except Conflict:
                self.stats.view_conflicts += 1
                got = await self.log.get_view(key)
                if got is None:
                    rev = 0
                    continue
                body, rev = got
                self._revs[fleet] = rev
                try:
                    stored = view_decoder.decode(body)
                except Exception:  # noqa: BLE001 - unreadable: ours replaces it
                    continue
                stored_pos = position(stored)
                self._stored[fleet] = stored_pos
                if fleet in self._overwrite:
                    continue  # folded from events the log lost: ours replaces it
                if stored_pos >= pos:
                    current = self._folders.get(fleet)
                    if current is None or stored_pos > position(current.view()):
                        self._folders[fleet] = Folder(stored)  # adopt: the fold now skips what it covers
                        self.stats.views_adopted += 1
                    return


__all__ = ["Projector", "Stats"]
