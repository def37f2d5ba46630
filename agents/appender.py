"""The agent's one way to append to the event log: with the subject's expected sequence, continued from
the subject's tip after a conflict (nobody else writes this domain's subjects: the claim made sure, so a
conflict is a stale tip of the agent's own), and never holding the observer up while the log is away.

    append = Appender(log, stopping=life.stopping, logger=logger, buffer=1000)
    seq = await append(subject, event, expect)      # a stored sequence, or a ref (negative) while cut off
    life.spawn(append.run(), "backlog")             # appends what waits, in order, when the log is back

**Cut off, the agent keeps observing.** An append that the log does not acknowledge within `attempt_s`
(no connection, or a NATS node without a stream majority: the publish times out) goes to a backlog
(agents/backlog.py) and the writer gets a ref to keep in place of the sequence; so does every append
made while anything waits, so each subject keeps its order. `run()` appends the backlog oldest first,
each entry with its subject's expected sequence and its causes resolved, retrying the same event (same
body, same `Nats-Msg-Id`) until acknowledged: an attempt whose outcome was unknown (timed out, cut) is
recognised by the log as already stored, never written twice. Such an entry is never coalesced away:
nats-py keeps what it could not send in its reconnect buffer and sends it once the connection is back,
so only that event's own retry keeps the subject's sequence (a later event of the same state would be
stored beside it, and the next append would find the subject moved). Lines: `appends buffered` when the first
waits, `buffered appends recorded` when the last is in. When the backlog is full it coalesces (a loop
of states on a subject, older GPU snapshots) and says so (`backlog coalesced`, with how many); when
nothing coalesces, the writer waits for room (unless its event closes a loop, which makes room).
Metrics: `haru_agent_backlog_events`, `haru_agent_backlog_buffered_total`,
`haru_agent_backlog_coalesced_total`.

With `buffer=0` there is no backlog: an append retries in place while the log is away (the simulated
hosts, whose callers keep every sequence they were given). Once the agent is stopping, what waits is
appended in place first, and an append gives up after a few tries: a stopping agent is not held.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from haru.agents.backlog import Backlog, Pending
from haru.core.errors import Conflict, LogError, LogUnavailable
from haru.core.events import Event
from haru.log.seam import EventStore

__all__ = ["Appender", "Append"]

# append(subject, event, expected last sequence) -> the event's sequence (or a ref, agents/backlog.py)
Append = Callable[[str, Event, int], Awaitable[int]]

_RETRY_MAX_S = 5.0


class Appender:
    def __init__(
        self,
        log: EventStore,
        *,
        stopping: Callable[[], bool],
        logger: Any,
        buffer: int = 0,
        attempt_s: float = 3.0,
    ) -> None:
        self.log = log
        self.stopping = stopping
        self.logger = logger
        self.attempt_s = attempt_s
        self.backlog: Backlog | None = Backlog(buffer) if buffer > 0 else None
        self.buffered_total = 0  # appends that went through the backlog, since the start
        self._waiting = asyncio.Event()  # something was buffered: run() appends it
        self._room = asyncio.Event()  # the backlog has room again
        self._head = asyncio.Lock()  # one head entry appended at a time (run() or a stopping writer)
        self._gave_up = False  # stopping, the log did not take the backlog: later appends fail at once

    # ------------------------------------------------------------------------------- writing

    async def __call__(self, subject: str, event: Event, expect: int) -> int:
        backlog = self.backlog
        if backlog is None:
            return await self._retried(subject, event, expect)
        if self.stopping():
            if not await self.flush():
                raise LogUnavailable(f"appending to {subject}: earlier appends still wait and the agent stops")
            return await self._retried(subject, self._resolved(event), self._expect(subject, expect))
        if backlog:
            return await self._buffer(subject, event, expect)
        try:
            async with asyncio.timeout(self.attempt_s):
                return await self._once(subject, self._resolved(event), self._expect(subject, expect))
        except (LogUnavailable, TimeoutError) as exc:
            # Not acknowledged in time: maybe stored, maybe not; the backlog's retry is the same event,
            # which the log recognises if it was.
            self.logger.warning(
                "appends buffered: the event log does not acknowledge",
                subject=subject,
                error=str(exc) or type(exc).__name__,
            )
            return await self._buffer(subject, event, expect, sent=True)

    async def _buffer(self, subject: str, event: Event, expect: int, *, sent: bool = False) -> int:
        backlog = self.backlog
        assert backlog is not None
        while backlog.full and not backlog.absorbs(subject, event):
            self.logger.warning("backlog full: the observer waits for room", events=len(backlog))
            self._room.clear()
            await self._room.wait()
        before = backlog.coalesced
        ref = backlog.add(subject, event, expect, sent=sent)
        self.buffered_total += 1
        if backlog.coalesced > before:
            self.logger.warning(
                "backlog coalesced: loops of states and older GPU snapshots dropped",
                dropped=backlog.coalesced - before,
                coalesced_total=backlog.coalesced,
                events=len(backlog),
            )
        self._waiting.set()
        return ref

    async def _retried(self, subject: str, event: Event, expect: int) -> int:
        tries = 0
        while True:
            tries += 1
            try:
                return await self._once(subject, event, expect)
            except LogUnavailable as exc:
                if self.stopping() and tries >= 3:
                    raise
                self.logger.warning("event log unavailable; retrying the append", subject=subject, error=str(exc))
                await asyncio.sleep(min(0.5 * tries, _RETRY_MAX_S))

    async def _once(self, subject: str, event: Event, expect: int) -> int:
        try:
            return await self.log.append(subject, event, expect=expect)
        except Conflict as exc:
            self.logger.error(
                "subject moved under the agent; continuing from its tip",
                subject=subject,
                expected=expect,
                current=exc.current,
            )
            return await self.log.append(subject, event, expect=await self.log.last_seq_of(subject))

    # --------------------------------------------------------------------------- the backlog

    def _expect(self, subject: str, expect: int) -> int:
        seq = self.backlog.resolve(expect) if self.backlog is not None else expect
        if seq is None:  # cannot happen: an entry is appended only after every entry before it
            raise RuntimeError(f"the expected sequence of {subject} is still waiting in the backlog")
        return seq

    def _resolved(self, event: Event) -> Event:
        """`event` with a cause that is a ref replaced by the sequence it was stored at (0 if never)."""
        if event.cause >= 0 or self.backlog is None:
            return event
        return msgspec.structs.replace(event, cause=self.backlog.resolve(event.cause) or 0)

    async def _append_head(self, head: Pending) -> int:
        return await self._once(head.subject, self._resolved(head.event), self._expect(head.subject, head.expect))

    async def run(self) -> None:
        """Append what waits, oldest first, until cancelled; each entry retried until acknowledged."""
        backlog = self.backlog
        if backlog is None:
            return
        tries = 0
        while True:
            await self._waiting.wait()
            async with self._head:
                head = backlog.head()
                if head is None:
                    self._waiting.clear()
                    continue
                try:
                    seq = await self._append_head(head)
                except LogUnavailable as exc:
                    tries += 1
                    if tries == 1 or tries % 20 == 0:
                        self.logger.info("backlog waits for the event log", events=len(backlog), error=str(exc))
                    wait = min(0.25 * tries, 2.0)
                except LogError as exc:
                    # A refusal this agent does not expect. The entry stays at the head and is asked again: ending
                    # the task would leave everything after it unrecorded while the agent went on as if it were.
                    tries += 1
                    if tries == 1 or tries % 20 == 0:
                        self.logger.error(
                            "backlog append refused; asking again",
                            subject=head.subject,
                            events=len(backlog),
                            error=str(exc),
                        )
                    wait = min(0.25 * tries, 2.0)
                else:
                    tries, wait = 0, 0.0
                    backlog.done(head.ref, seq)
                    self._room.set()
                    if not backlog:
                        self.logger.info(
                            "buffered appends recorded", buffered_total=self.buffered_total, coalesced=backlog.coalesced
                        )
            if wait:
                await asyncio.sleep(wait)

    async def flush(self, within_s: float = 10.0) -> bool:
        """Append what waits now, in place (a stopping agent); False when the log did not take it all
        (then, and from then on: the first failure says what stays unrecorded, once)."""
        backlog = self.backlog
        if not backlog:
            return True
        if self._gave_up:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        async with self._head:
            while (head := backlog.head()) is not None:
                try:
                    async with asyncio.timeout(max(0.1, deadline - loop.time())):
                        seq = await self._append_head(head)
                except (LogUnavailable, TimeoutError) as exc:
                    self.logger.error(
                        "buffered appends not recorded: the event log is away and the agent stops",
                        events=len(backlog),
                        error=str(exc),
                    )
                    self._gave_up = True
                    return False
                backlog.done(head.ref, seq)
        self._room.set()
        return True
