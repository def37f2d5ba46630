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

**The catch-up** (`follow` with a synchronous handler, every follower's start: a projector's rebuild).
Before the ordered consumer, the replay reads what the stream already holds through an ephemeral pull
consumer (ack none, memory storage, the replay's filter, from its start; the server removes it
`_CATCH_UP_INACTIVE_S` after its last request, as readers may not delete consumers), `_CATCH_UP_BATCH`
messages a request with the next request sent when half of the last is in, its deliveries handed to
the handler straight from nats-py's read loop (haru/log/nats_direct.py: no `Msg`, no queue hop). It
drains 1.1-2.0x faster than the ordered consumer (bench/projector.py, docs/performance.md). Its deliveries
go through the same checks as the ordered consumer's (a redelivery at or below the last sequence
handled is dropped, a hole in the stream sequences goes to `on_gap`), and each must carry the
consumer sequence after the previous one. The catch-up ends, and the ordered consumer takes over from
the sequence after the last one handled, on the first of: a delivery saying nothing is pending (caught
up), a consumer sequence skipped (a delivery missed: nothing after it was handled), no delivery for
two `_CATCH_UP_SILENCE_S` in a row (a status, the server away, a damaged message it skips; a request
is sent again after the first, as in a cluster the first can be lost while the new consumer's
interest reaches the other servers), or the consumer not made (another nats-py, a refused request).
So anything unusual is left to the reader that handles it today; the catch-up only ever hands over
early.
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
from haru.log import holes, nats_direct
from haru.log.jetstream import translated
from haru.log.record import Record, decode_record
from haru.log.seam import Handler

__all__ = ["Replay"]

_STALL_CHECK_S = 0.5  # a non-follow replay without progress this long asks its consumer whether it is done
_CATCH_UP_BATCH = 10_000  # messages one pull request of the catch-up asks for (the next at half of it)
_CATCH_UP_EXPIRES_S = 5.0  # a pull request's life at the server
_CATCH_UP_SILENCE_S = 1.0  # no delivery for this long: the catch-up hands over to the ordered consumer
_CATCH_UP_INACTIVE_S = 10.0  # the server removes the catch-up's consumer this long after its last request
# The decoder of haru.core.events.decode (same type, no hooks), called directly on the replay's hot path;
# a body it refuses goes through haru.core.events.decode for the error text.
_event_decoder = msgspec.json.Decoder(AnyEvent)
_log = structlog.get_logger("haru.log.eventlog")


def _ignore(rec: Record) -> None:
    return None


class _CatchUp:
    """The state of one catch-up (`Replay._catch_up`): its consumer, the consumer sequence the next
    delivery must carry, the messages asked for, and its end."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.consumer = b""  # the consumer's name as the reply subjects carry it
        self.next_cseq = 1
        self.asked = 0
        self.over = False
        self.ask = asyncio.Event()  # half of the last request is in: ask for the next batch
        self.done: asyncio.Future[Any] = loop.create_future()

    def end(self) -> None:
        self.over = True
        if not self.done.done():
            self.done.set_result(None)


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
                        s = (await self.js.stream_info(subjects.EVENTS_STREAM)).state
            except TimeoutError:
                raise self._too_late() from None
            self.state = holes.StreamState(first_seq=s.first_seq, last_seq=s.last_seq, messages=s.messages)
        if self.follow and not inspect.iscoroutinefunction(self.handler):
            await self._catch_up()
            if self.finished.done():
                self.finished.result()  # the handler failed: raise it
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
                    rec = Record(
                        seq, msg.subject, int(ts), data, decode_event(data), "", msg.headers if headers else None
                    )
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
        """Where a consumer made now starts: after the last sequence handled (the catch-up's, if any)."""
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

    # ------------------------------------------------------------------------- the catch-up

    async def _catch_up(self) -> None:
        """Read what the stream holds through a pull consumer, handled from the read loop, until caught
        up or anything unusual (the module docstring, "The catch-up"); then the ordered consumer goes on."""
        nc = self.js._nc
        catch = _CatchUp(self.loop)
        try:
            direct = await nats_direct.subscribe_direct(nc, nc.new_inbox(), self._on_direct(catch, nc))
        except Exception as exc:  # noqa: BLE001 - NATS away: the ordered consumer's subscribe says so
            _log.info("eventlog.catch_up_skipped", filter=self.subject_filter, error=repr(exc))
            return
        if direct is None:
            return
        try:
            await self._catch_up_with(catch, nc, direct.sub.subject)
        except Exception as exc:  # noqa: BLE001 - a refused or failed request: hand over
            _log.info("eventlog.catch_up_ended", filter=self.subject_filter, after=self.last_handled, error=repr(exc))
        finally:
            catch.end()
            direct.stop()  # nothing more handled from this consumer, before any await
            with contextlib.suppress(Exception):
                await direct.unsubscribe()
            # The consumer is left to the server (`_CATCH_UP_INACTIVE_S`): readers may not delete consumers.

    async def _catch_up_with(self, catch: _CatchUp, nc: Any, inbox: str) -> None:
        """The catch-up's consumer and its pull requests, until it ends (see `_catch_up`)."""
        policy, start = self._start()
        config = api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=policy,
            opt_start_seq=start,
            filter_subject=self.subject_filter,
            mem_storage=True,
            inactive_threshold=_CATCH_UP_INACTIVE_S,
            num_replicas=1,
            headers_only=False,
        )
        async with asyncio.timeout(_CATCH_UP_EXPIRES_S):  # refused or NATS away: `_catch_up` hands over
            info = await self.js.add_consumer(subjects.EVENTS_STREAM, config)
        if not info.num_pending:
            return  # nothing stored past the start: follow
        catch.consumer = info.name.encode()
        ask_subject = f"$JS.API.CONSUMER.MSG.NEXT.{subjects.EVENTS_STREAM}.{info.name}"
        request = msgspec.json.encode({"batch": _CATCH_UP_BATCH, "expires": int(_CATCH_UP_EXPIRES_S * 1e9)})
        for _ in range(2):
            catch.asked += _CATCH_UP_BATCH
            await nc.publish(ask_subject, request, reply=inbox)
        seen, silent = catch.next_cseq, 0
        while True:
            if not catch.ask.is_set():
                asked: asyncio.Future[Any] = asyncio.ensure_future(catch.ask.wait())
                try:
                    await asyncio.wait(
                        {catch.done, asked}, timeout=_CATCH_UP_SILENCE_S, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    asked.cancel()
            if catch.done.done():
                break
            if catch.ask.is_set():
                catch.ask.clear()
                catch.asked += _CATCH_UP_BATCH
                await nc.publish(ask_subject, request, reply=inbox)
                continue
            if catch.next_cseq != seen:
                seen, silent = catch.next_cseq, 0
                continue
            silent += 1
            if silent >= 2:
                break  # silent: the ordered consumer takes it from here
            # Silent once: a request may have been lost (in a cluster, a new consumer's interest in its
            # pull requests reaches the other servers a moment after it is created): ask again.
            catch.asked += _CATCH_UP_BATCH
            await nc.publish(ask_subject, request, reply=inbox)

    def _on_direct(self, catch: _CatchUp, nc: Any) -> nats_direct.DirectCallback:
        """The catch-up's callback, called from nats-py's read loop with the raw subject, reply subject,
        body and header block (haru/log/nats_direct.py): the same checks and `Record` as `_on_msg`, plus
        the consumer sequence, which must follow the previous one."""
        finished, handler, unfiltered, headers = self.finished, self.handler, self.unfiltered, self.headers
        decode_event, header_dict = _event_decoder.decode, nats_direct.header_dict
        invalid = (msgspec.DecodeError, RecursionError)

        def on_msg(subject: bytes, reply: bytes, data: bytes, hdr: bytes | None) -> None:
            if catch.over or not reply:  # over, or a status (an expired request, ...): the silence decides
                return
            try:
                t = reply.split(b".")
                if len(t) == 9:  # v1: $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
                    name, seq, cseq, ts, pending = t[3], int(t[5]), int(t[6]), t[7], t[8]
                else:
                    # v2 $JS.ACK.<domain>.<account>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>.<token>
                    name, seq, cseq, ts, pending = t[5], int(t[7]), int(t[8]), t[9], t[10]
                if name != catch.consumer:
                    return
                if cseq != catch.next_cseq:  # a delivery missed: nothing past it is handled here
                    catch.end()
                    return
                catch.next_cseq = cseq + 1
                if catch.asked - cseq <= _CATCH_UP_BATCH // 2:
                    catch.ask.set()
                last_handled = self.last_handled
                if seq > last_handled:
                    if unfiltered and seq != last_handled + 1:
                        self._gap(last_handled, seq)
                    s = subject.decode()
                    h = header_dict(nc, hdr) if headers and hdr else None
                    try:
                        rec = Record(seq, s, int(ts), data, decode_event(data), "", h)
                    except invalid:  # not a valid event: the slow path, for haru.core.events.decode's error text
                        rec = decode_record(seq, s, int(ts), data, h)
                    handler(rec)
                    self.last_handled = seq
                if pending == b"0":
                    catch.end()  # caught up with the stream as it was at this delivery
            except BaseException as exc:  # the handler's failure ends the replay, raised to the caller
                catch.end()
                if not finished.done():
                    finished.set_exception(exc)

        return on_msg

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
