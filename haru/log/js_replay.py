"""One replay of the event stream on JetStream: an ordered push consumer with a callback (the fastest
drain nats-py has), its end, its deadline and its holes. `JetStreamEvents.replay` makes one per call.

A replay never hangs on a damaged store and never passes over a hole in silence (docs/operations.md,
"Damaged or truncated log"). What counts as a hole is haru/log/holes.py's pure arithmetic; this module
only gathers what it needs (the stream's state at the start, the gaps between deliveries, the pending
count of the last one) and asks.

- Without `follow` it ends within its budget or raises `ReplayTimeout`. When a stored message cannot
  be read (a flipped byte in a block file), nats-server skips it but still counts it as pending, so
  the last delivery never says "0 pending": a check every `_STALL_CHECK_S` without progress asks the
  consumer, and when the server has nothing more to send the replay ends.
- Without `follow`, holes raise `LogDamaged` (with the sequence numbers) after the handler has seen
  every readable event. With `follow`, each gap is passed to `on_gap(seqs)` (default: an error in the
  log) and following goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import msgspec
import structlog
from nats.js import api

from haru.core import subjects
from haru.core.errors import LogDamaged, ReplayTimeout, seq_ranges
from haru.core.events import AnyEvent
from haru.log import holes
from haru.log.jetstream import stream_state, translated
from haru.log.record import Record, decode_record, with_absolute_cause
from haru.log.seam import Handler

__all__ = ["Replay"]

_STALL_CHECK_S = 0.5  # a non-follow replay without progress this long asks its consumer whether it is done
# The decoder of haru.core.events.decode (same type, no hooks), called directly on the replay's hot path;
# a body it refuses goes through haru.core.events.decode for the error text.
_event_decoder = msgspec.json.Decoder(AnyEvent)
_log = structlog.get_logger("haru.log.eventlog")


def _ignore(rec: Record) -> None:
    return None


class Replay:
    """One replay (see the module docstring): `await Replay(...).run()` returns the last sequence handled."""

    def __init__(
        self,
        js: Any,
        handler: Handler,
        *,
        from_seq: int,
        subject_filter: str,
        follow: bool,
        headers: bool,
        budget: float | None,
        strict: bool,
        on_gap: Callable[[list[int]], Any] | None,
        rescan: Callable[..., Any],
    ) -> None:
        self.js = js
        self.handler = handler
        self.from_seq = from_seq
        self.subject_filter = subject_filter
        self.follow = follow
        self.headers = headers
        self.budget = budget
        self.strict = strict
        self.unfiltered = subject_filter == subjects.ALL_EVENTS
        self.on_gap = on_gap if on_gap is not None else self._log_gap
        self.rescan = rescan  # the log's own replay, for the unfiltered scan that names a filtered replay's holes
        self.last_handled = from_seq - 1
        self.last_tokens: list[str] = []  # the reply subject tokens of the last message handled
        self.gaps: list[tuple[int, int]] = []  # (first, last) missing, inclusive
        self.state: holes.StreamState | None = None
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.finished: asyncio.Future[None] = loop.create_future()
        self.deadline = None if budget is None else loop.time() + budget  # None: no deadline (asked for)

    def _log_gap(self, seqs: list[int]) -> None:
        _log.error(
            "eventlog.unreadable_sequences",
            seqs=seq_ranges(seqs),
            filter=self.subject_filter,
            fix="restore the store from a backup or a cluster peer (docs/operations.md)",
        )

    def _too_late(self) -> ReplayTimeout:
        end = "unknown" if self.state is None else self.state.last_seq
        return ReplayTimeout(
            f"replaying {self.subject_filter} from {self.from_seq}: not finished after {self.budget:g} s (read up to "
            f"seq {self.last_handled}, the stream ends at {end}); NATS is slow or unreachable: "
            f"retry, or allow longer with --timeout / HARU_REPLAY_TIMEOUT"
        )

    async def run(self) -> int:
        if not self.follow:
            try:
                async with asyncio.timeout_at(self.deadline):
                    with translated("reading the event stream's state"):
                        s = (await stream_state(self.js, subjects.EVENTS_STREAM)).state
            except TimeoutError:
                raise self._too_late() from None
            self.state = holes.StreamState(first_seq=s.first_seq, last_seq=s.last_seq, messages=s.messages)
        sub = await self._subscribe()
        first_pending = await self._drain(sub)
        if self.follow:
            return self.last_handled
        undelivered = holes.pending(self.last_tokens) if self.last_tokens else first_pending
        return await self._check(undelivered)

    def _on_msg(self) -> Callable[[Any], Any]:
        """The consumer's callback: the hot path of every follower (~100k messages/s), with the reply
        subject parsed and the body decoded inline and the pending count compared as text (the server
        writes it without leading zeros)."""
        finished, handler, follow, unfiltered = self.finished, self.handler, self.follow, self.unfiltered
        headers, is_async, decode_event = self.headers, inspect.iscoroutinefunction(self.handler), _event_decoder.decode
        invalid = (msgspec.DecodeError, RecursionError)  # ValidationError is a subclass of DecodeError

        async def on_msg(msg: Any) -> None:
            if finished.done():
                return
            try:
                t = msg.reply.split(".")
                if len(t) == 9:  # v1: $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
                    seq, ts, drained = int(t[5]), t[7], t[8] == "0"
                else:
                    # v2 $JS.ACK.<domain>.<account>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>.<token>
                    seq, ts, drained = int(t[7]), t[9], t[10] == "0"
                last_handled = self.last_handled
                if seq <= last_handled:
                    return  # redelivered after an ordered-consumer reset
                if unfiltered and seq != last_handled + 1:
                    self._gap(last_handled, seq)
                data = msg.data
                try:
                    event = decode_event(data)
                    if event.cause < 0:  # relative, written in an atomic batch (haru.core.record)
                        event = with_absolute_cause(event, seq)
                    rec = Record(seq, msg.subject, int(ts), data, event, "", msg.headers if headers else None)
                except invalid:  # not a valid event: the slow path, for haru.core.events.decode's error text
                    rec = decode_record(seq, msg.subject, int(ts), data, msg.headers if headers else None)
                if is_async:
                    await handler(rec)
                else:
                    handler(rec)
                self.last_handled = seq
                self.last_tokens = t
                if drained and not follow:
                    finished.set_result(None)
            except BaseException as exc:  # the handler's failure ends the replay, raised to the caller
                if not finished.done():
                    finished.set_exception(exc)

        return on_msg

    def _gap(self, last_handled: int, seq: int) -> None:
        hole = holes.gap(last_handled, seq)
        if hole is None:
            return
        self.gaps.append(hole)
        if self.follow:
            self.on_gap(list(range(hole[0], hole[1] + 1)))

    def _start(self) -> tuple[api.DeliverPolicy, int | None]:
        """Where the consumer starts: `from_seq` (from the first stored message when it is 1 or less)."""
        first = max(self.from_seq, self.last_handled + 1)
        if first <= 1:
            return api.DeliverPolicy.ALL, None
        return api.DeliverPolicy.BY_START_SEQUENCE, first

    async def _subscribe(self) -> Any:
        policy, start = self._start()
        config = api.ConsumerConfig(opt_start_seq=start, headers_only=False)
        try:
            async with asyncio.timeout_at(None if self.follow else self.deadline):
                with translated(f"replaying {self.subject_filter} from {start or 1}"):
                    return await self.js.subscribe(
                        self.subject_filter,
                        cb=self._on_msg(),
                        stream=subjects.EVENTS_STREAM,
                        ordered_consumer=True,
                        deliver_policy=policy,
                        config=config,
                        pending_msgs_limit=-1,
                        pending_bytes_limit=-1,
                    )
        except TimeoutError:
            raise self._too_late() from None

    async def _drain(self, sub: Any) -> int:
        """Wait until the replay is done (following: until cancelled); returns the pending count the
        consumer reported at the start (what it will deliver, damaged messages included)."""
        finished = self.finished
        first_pending = 0
        watchdog: asyncio.Task[None] | None = None
        try:
            if self.follow:
                await finished
                return 0
            async with asyncio.timeout_at(self.deadline):
                with translated("reading the replay consumer"):
                    info = await sub.consumer_info()
            first_pending = (info.num_pending or 0) + ((info.delivered.consumer_seq or 0) if info.delivered else 0)
            if info.num_pending == 0 and (info.delivered is None or not info.delivered.consumer_seq):
                if not finished.done():
                    finished.set_result(None)
            watchdog = asyncio.create_task(self._end_of_replay(sub))
            async with asyncio.timeout_at(self.deadline):
                await finished
        except TimeoutError:
            failure = finished.exception() if finished.done() and not finished.cancelled() else None
            if failure is not None:
                raise failure from None
            raise self._too_late() from None
        finally:
            if watchdog is not None:
                watchdog.cancel()
                with contextlib.suppress(BaseException):
                    await watchdog
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return first_pending

    async def _end_of_replay(self, sub: Any) -> None:
        """Ends a replay whose consumer has nothing more to send although its last delivery said
        some was pending (nats-server skips a message it cannot read but keeps it in the count)."""
        finished = self.finished
        seen = None
        while not finished.done():
            await asyncio.sleep(_STALL_CHECK_S)
            tokens = self.last_tokens
            if tokens is not seen:
                seen = tokens
                continue
            try:
                async with asyncio.timeout(max(_STALL_CHECK_S, 1.0)):
                    info = await sub.consumer_info()
            except Exception:  # noqa: BLE001 - NATS is away: the replay's deadline decides
                continue
            delivered = info.delivered.consumer_seq if info.delivered else 0
            if (
                info.num_pending == 0
                and delivered <= holes.consumer_seq(tokens)
                and self.last_tokens is tokens
                and not finished.done()
            ):
                finished.set_result(None)

    async def _check(self, undelivered: int) -> int:
        """Raise `LogDamaged` naming the holes of a finished replay; else return the last sequence handled."""
        state = self.state
        assert state is not None
        end = state.last_seq
        missing: list[int] = []
        if self.unfiltered:
            missing = holes.missing_unfiltered(self.gaps, self.last_handled, self.from_seq, end)
        elif holes.needs_scan(state, self.from_seq, undelivered, self.strict):
            left = None if self.deadline is None else max(0.1, self.deadline - self.loop.time())
            try:
                await self.rescan(_ignore, from_seq=self.from_seq, headers=False, timeout=left)
            except LogDamaged as exc:
                missing = [q for q in exc.missing if q <= end]
        if not missing and not undelivered:
            return self.last_handled
        raise LogDamaged(
            holes.damage_message(self.subject_filter, self.from_seq, missing, undelivered, end, self.unfiltered),
            missing=sorted(set(missing)),
            last=end,
            uncounted=0 if missing else undelivered,
        )
