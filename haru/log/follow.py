"""Following the log: the one follower every service uses (catch up, stall detection, reconnect, resume).

    follower = log.follower(handler, from_seq=position + 1, name="projector")
    await follower.run()            # until cancelled; follower.position = the last sequence handled

    await log.follow(handler, from_seq=position + 1)    # the same, when nobody needs the counters

`handler(record)` (plain or async) is called once per stored message matching `subject_filter`, in
sequence order, from `from_seq`, and then for every new one. The follower:

- **catches up and follows** with one `replay(follow=True)` of the log (on JetStream an ordered push
  consumer: haru/log/js_replay.py);
- **resumes** every new replay after `position`, the last sequence its handler returned from, and
  drops a redelivered record at or below it, so the handler sees each sequence once;
- **restarts on a reconnect**: after the connection to NATS comes back (`on_link_change`) it starts a
  fresh replay at once instead of waiting the ~20 s nats-py's ordered consumer takes to notice its
  gap from missed idle heartbeats;
- **detects a stall**: when the log holds a matching message past `position`, nothing was handled for
  `stall_checks` checks `stall_interval` apart, and the handler is not busy (an async handler still
  running, or `busy()` true: a full queue is a writer's backpressure, not a stall), the replay is
  restarted. When the sequences past `position` are only ones the store cannot serve (a damaged
  tail, unfiltered followers), that is logged once and not restarted for;
- **resets on a rewind**: a log that went backwards (its last matching sequence now below
  `position`: a store that lost power before it fsynced, or was restored from an old backup) or whose
  record at `position` now has other content (the stream refilled the forgotten sequences with other
  events) is never treated as "older, ignore": `on_rewind(head)` tells the owner, which drops what it
  folded and returns the position to follow from (0: read everything again); without `on_rewind` the
  follower goes on after the log's current head and logs an error. Checked before each new replay
  (after a reconnect the store may be another) and whenever the follower is idle;
- **survives the log going away**: a replay that fails with a `LogError` is started again after
  `retry_s` (doubling to `retry_max_s` while nothing is handled); any other exception is the
  handler's or a bug and is raised from `run()`.

The log is any `haru.log.seam.Followable` (`replay`, `last_seq`, `last_seq_matching`, `read_seq`,
`on_link_change`): `haru.log.eventlog.EventLog` and `haru.log.memory.MemoryLog` are, and
tests/integration/test_log_contract.py runs the same follower against both.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from haru.core import subjects
from haru.core.errors import LogError, seq_ranges
from haru.core.restarts import Backoff
from haru.host.tasks import cancel_and_wait
from haru.log.seam import Followable

__all__ = ["Follower"]

_log = structlog.get_logger("haru.log.follow")
_DAMAGED_TAIL_MAX = 16  # more unreadable sequences than this past the position is a stall, not a damaged tail


class Follower:
    """One follower of the log (see the module docstring). `position` is the last sequence handled."""

    def __init__(
        self,
        log: Followable,
        handler: Callable[[Any], Any | Awaitable[Any]],
        *,
        from_seq: int = 1,
        subject_filter: str = subjects.ALL_EVENTS,
        headers: bool = True,
        name: str = "follower",
        stall_interval: float = 1.0,
        stall_checks: int = 2,
        retry_s: float = 1.0,
        retry_max_s: float = 5.0,
        busy: Callable[[], bool] | None = None,
        on_gap: Callable[[list[int]], Any] | None = None,
        on_restart: Callable[[str], Any] | None = None,
        on_rewind: Callable[[int], int] | None = None,
    ) -> None:
        self.log = log
        self.handler = handler
        self.subject_filter = subject_filter
        self.headers = headers
        self.name = name
        self.stall_interval = stall_interval
        self.stall_checks = stall_checks
        self.retry_s = retry_s
        self.retry_max_s = retry_max_s
        self.busy = busy
        self.on_gap = on_gap
        self.on_restart = on_restart  # called with "stalled", "reconnected", "interrupted", "rewound" or "ended"
        self.on_rewind = on_rewind  # (the log's head) -> the position to follow from, after the owner reset
        self.rewinds = 0  # of the restarts: the log went backwards or changed under the position
        self._held: tuple[int, bytes] | None = None  # the last record handled: (seq, body)
        self.position = from_seq - 1  # the last sequence handled
        self.restarts = 0  # replays started again (stalled, reconnected, interrupted)
        self.stalls = 0  # of which: stalled
        self.interruptions = 0  # of which: failed with a LogError
        self._in_handler = False
        self._unreadable_tail: tuple[int, int] | None = None
        self._on = self._async_on if inspect.iscoroutinefunction(handler) else self._sync_on

    # ------------------------------------------------------------------------------ handling

    def _sync_on(self, rec: Any) -> None:
        if rec.seq <= self.position:
            return  # redelivered (a restarted replay, an ordered-consumer reset)
        self.handler(rec)
        self.position = rec.seq
        self._held = (rec.seq, rec.data)

    async def _async_on(self, rec: Any) -> None:
        if rec.seq <= self.position:
            return
        self._in_handler = True
        try:
            await self.handler(rec)
        finally:
            self._in_handler = False
        self.position = rec.seq
        self._held = (rec.seq, rec.data)

    # ----------------------------------------------------------------------------------- run

    async def run(self) -> None:
        """Follow until cancelled; raises what the handler raised (anything but a LogError of the log)."""
        backoff, failures = Backoff(self.retry_s, self.retry_max_s), 0  # interrupted replays in a row
        log = _log.bind(follower=self.name, filter=self.subject_filter)
        first = True
        while True:
            if not first:
                head = await self._rewound_to()
                if head is not None:
                    self._reset(head, log)
            first = False
            started_at = self.position
            came_back = asyncio.Event()
            was_down = False

            def on_link(up: bool, came_back: asyncio.Event = came_back) -> None:
                nonlocal was_down
                if not up:
                    was_down = True
                elif was_down:
                    came_back.set()

            forget = self.log.on_link_change(on_link)
            replay = asyncio.create_task(
                self.log.replay(
                    self._on,
                    from_seq=self.position + 1,
                    subject_filter=self.subject_filter,
                    follow=True,
                    headers=self.headers,
                    on_gap=self.on_gap,
                )
            )
            stalled = asyncio.create_task(self._until_stalled())
            back = asyncio.create_task(came_back.wait())
            try:
                await asyncio.wait({replay, stalled, back}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                forget()
                await cancel_and_wait(replay, stalled, back)
            self.restarts += 1
            if self.position != started_at:
                failures = 0  # that replay got somewhere: start the backoff again
            exc = None if replay.cancelled() or not replay.done() else replay.exception()
            if exc is not None and not isinstance(exc, LogError):
                raise exc
            if exc is not None:
                why = "interrupted"
                self.interruptions += 1
                failures += 1
                log.warning(
                    "follow.interrupted", error=str(exc), position=self.position, retry_in_s=backoff.delay(failures)
                )
            elif (rewound_head := self._result(stalled)) is not None:
                why = "rewound"
                self._reset(rewound_head, log)
            elif stalled.done() and not stalled.cancelled():
                why = "stalled"
                self.stalls += 1
                log.warning(
                    "follow.stalled",
                    position=self.position,
                    detail="the log holds events the replay has not delivered; replaying again from the position",
                )
            elif back.done() and not back.cancelled():
                why = "reconnected"
                log.info("follow.reconnected", position=self.position, detail="replaying again from the position")
            else:
                why = "ended"
                log.info("follow.restarted", position=self.position, detail="the replay ended")
            if self.on_restart is not None:
                self.on_restart(why)
            if exc is not None:
                await asyncio.sleep(backoff.delay(failures))

    async def _head(self) -> int:
        if self.subject_filter == subjects.ALL_EVENTS:
            return await self.log.last_seq()
        return await self.log.last_seq_matching(self.subject_filter)

    @staticmethod
    def _result(task: asyncio.Task[int | None]) -> int | None:
        return task.result() if task.done() and not task.cancelled() else None

    async def _rewound_to(self, *, within_s: float = 10.0) -> int | None:
        """The log's head when it went back behind `position` or holds other content there; else None.
        Asked until the log answers (a restarted server's JetStream takes a moment), for `within_s`."""
        deadline = asyncio.get_running_loop().time() + within_s
        while True:
            try:
                async with asyncio.timeout(max(self.stall_interval, 1.0)):
                    return await self._rewound(await self._head())
            except (LogError, TimeoutError):
                if asyncio.get_running_loop().time() > deadline:
                    return None
                await asyncio.sleep(0.1)

    async def _rewound(self, head: int) -> int | None:
        if head < self.position:
            return head
        held = self._held
        if held is None or held[0] != self.position:
            return None
        rec = await self.log.read_seq(held[0])
        if rec is not None and rec.data != held[1]:
            return head
        return None

    def _reset(self, head: int, log: Any) -> None:
        self.rewinds += 1
        before = self.position
        if self.on_rewind is not None:
            self.position = self.on_rewind(head)
            log.warning(
                "follow.rewound",
                position=before,
                head=head,
                follow_from=self.position + 1,
                detail="the log went back behind what was handled (or changed there): read again, not ignored",
            )
        else:
            self.position = head
            log.error(
                "follow.rewound",
                position=before,
                head=head,
                detail="the log went back behind what was handled; nothing re-reads it here: going on after its head",
            )
        self._held = None

    async def _until_stalled(self) -> int | None:
        """Returns when the follower is stalled (None) or the log was rewound under it (its head)."""
        seen, strikes = self.position, 0
        while True:
            await asyncio.sleep(self.stall_interval)
            now = self.position
            if now != seen or self._in_handler or (self.busy is not None and self.busy()):
                seen, strikes = now, 0
                continue
            try:
                async with asyncio.timeout(self.stall_interval):
                    head = await self._head()
                    rewound = await self._rewound(head)
            except (LogError, TimeoutError):
                continue  # the log is away: nothing to conclude yet
            if rewound is not None:
                return rewound
            if head <= now:
                strikes = 0
                continue
            if await self._damaged_tail(now, head):
                strikes = 0  # not a stall: the store cannot serve what comes next (logged once)
                continue
            strikes += 1
            if strikes >= self.stall_checks:
                return None

    async def _damaged_tail(self, position: int, head: int) -> bool:
        """True when every sequence after `position` up to `head` is one the store cannot serve (a
        damaged block at the tail): a new replay would not get past it either. Unfiltered only (in a
        filtered one the sequences in between belong to other subjects)."""
        first = position + 1
        if self.subject_filter != subjects.ALL_EVENTS or head - first > _DAMAGED_TAIL_MAX:
            return False
        try:
            for seq in range(first, head + 1):
                if await self.log.read_seq(seq) is not None:
                    return False
        except LogError:
            return False
        if self._unreadable_tail != (first, head):
            self._unreadable_tail = (first, head)
            _log.error(
                "follow.unreadable_sequences",
                follower=self.name,
                seqs=seq_ranges(list(range(first, head + 1))),
                fix="restore the store from a backup or a cluster peer (docs/operations.md)",
            )
        return True
