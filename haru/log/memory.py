"""The event log and the bus in memory: the seam's Protocols (`haru.log.seam.Log`, `haru.log.bus.Bus`) as
`haru.log.eventlog.EventLog` and `haru.log.bus.NatsBus` implement them,
for tests of service logic that is not about NATS (the promoter's decisions and steps, the projector's
fold and writes). tests/integration/test_log_contract.py runs one suite against these and the real ones.

    log = MemoryLog(writer="promoter:test")
    seq = await log.append(subjects.model("default", "a", "m"), event, expect=0)
    await log.follow(handler, from_seq=1)           # haru.log.follow.Follower, as on JetStream
    reply = await send(log.bus, "default", "b", "wake", Command())   # a MemoryBus subscriber answers

What it keeps as JetStream does: one dense stream sequence for every event subject; appends checked
against the subject's last sequence (`expect`, 0 = empty) raising `Conflict` with the current one;
the hash chain (`prev`) and `by`; the deterministic `Nats-Msg-Id`, so a retried append of the same
(subject, expect, body) returns the stored sequence; per-subject history; NATS wildcards (`*`, `>`)
in filters; the route intents' own stream with expected-sequence appends; the views' KV bucket with
compare-and-swap revisions. `drop_link()` / `restore_link()` play a lost and regained connection
(`on_link_change` listeners, `connected`, `bus.connected`).

What it does not pretend: damaged stores, leader elections, timeouts, lost acks. Those are facts only
a server shows, and the real-server tests keep them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Self

import msgspec

from haru.core import subjects
from haru.core.errors import Conflict, LogUnavailable, NoResponders, RequestTimeout
from haru.core.events import Event, encode
from haru.log.bus import Answer, Answering, Endpoint, Handler, Msg, Service
from haru.log.follow import Follower
from haru.log.record import (
    BATCH_ID,
    BATCH_SEQ,
    EXPECTED_LAST_SUBJECT_SEQ,
    MSG_ID,
    Record,
    body_hash,
    decode_record,
    msg_id,
    stage_batch,
    with_absolute_cause,
)

__all__ = ["MemoryBus", "MemoryLog", "subject_matches"]

_YIELD_EVERY = 256  # a replay lets other tasks run this often, as a delivery batch from NATS would


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, a final `>` is one or more."""
    p = pattern.split(".")
    s = subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


class _Sub:
    def __init__(self, bus: MemoryBus, pattern: str, handler: Handler) -> None:
        self.bus, self.pattern, self.handler = bus, pattern, handler
        self.is_async = inspect.iscoroutinefunction(handler)

    async def unsubscribe(self) -> None:
        with contextlib.suppress(ValueError):
            self.bus._subs.remove(self)


class MemoryBus:
    """Core NATS in one process: publish, subscribe (wildcards), request/reply with no-responders."""

    def __init__(self) -> None:
        self._subs: list[_Sub] = []
        self._inboxes = itertools.count(1)
        self.connected = True

    async def publish(
        self, subject: str, data: bytes, *, headers: dict[str, str] | None = None, reply: str = ""
    ) -> None:
        if not self.connected:
            return  # as nats-py while reconnecting: buffered, and here simply lost (core NATS is at most once)
        msg = Msg(subject, data, dict(headers) if headers else None, reply)
        for sub in [s for s in self._subs if subject_matches(s.pattern, subject)]:
            if sub.is_async:
                asyncio.get_running_loop().create_task(sub.handler(msg))  # type: ignore[arg-type]
            else:
                sub.handler(msg)

    async def subscribe(self, subject: str, handler: Handler) -> _Sub:
        sub = _Sub(self, subject, handler)
        self._subs.append(sub)
        return sub

    async def request(self, subject: str, data: bytes, *, timeout: float, headers: dict[str, str] | None = None) -> Msg:
        if not any(subject_matches(s.pattern, subject) for s in self._subs) or not self.connected:
            raise NoResponders(f"nothing is subscribed to {subject}")
        inbox = f"_INBOX.memory.{next(self._inboxes)}"
        answer: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()

        def on_reply(msg: Msg) -> None:
            if not answer.done():
                answer.set_result(msg)

        sub = await self.subscribe(inbox, on_reply)
        try:
            await self.publish(subject, data, headers=headers, reply=inbox)
            async with asyncio.timeout(timeout):
                return await answer
        except TimeoutError:
            raise RequestTimeout(f"no reply on {subject} within {timeout:g} s") from None
        finally:
            await sub.unsubscribe()

    async def serve(self, service: Service, endpoints: Sequence[Endpoint]) -> _MemoryServed:
        """Each endpoint answers its subject (one answer at a time per service's queue group, as here there is
        one process); nothing answers `$SRV` discovery."""
        answering = Answering()
        subs: list[_Sub] = []
        for ep in endpoints:

            def on_request(msg: Msg, answer: Answer = ep.answer) -> None:
                if msg.reply:
                    answering.start(answer, msg.data, functools.partial(self.publish, msg.reply))

            subs.append(await self.subscribe(ep.subject, on_request))
        return _MemoryServed(subs, answering)


class _MemoryServed:
    def __init__(self, subs: list[_Sub], answering: Answering) -> None:
        self.subs, self.answering = subs, answering

    async def stop(self) -> None:
        for sub in self.subs:
            await sub.unsubscribe()
        await self.answering.stop()


class _Stream:
    """One stream's messages, by sequence (dense, from 1), and each subject's sequences."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.by_subject: dict[str, list[int]] = {}
        self._grew = asyncio.Event()

    def poke(self) -> None:
        """Wake whoever waits for the next message (a new one, or a dropped link)."""
        grew, self._grew = self._grew, asyncio.Event()
        grew.set()

    async def wait(self) -> None:
        await self._grew.wait()

    @property
    def last_seq(self) -> int:
        return len(self.records)

    def last_of(self, subject: str) -> Record | None:
        seqs = self.by_subject.get(subject)
        return self.records[seqs[-1] - 1] if seqs else None

    async def add(self, subject: str, data: bytes, headers: dict[str, str], event: Any) -> Record:
        seq = len(self.records) + 1
        if event is None:
            rec = decode_record(seq, subject, time.time_ns(), data, headers)
        else:
            rec = Record(seq, subject, time.time_ns(), data, with_absolute_cause(event, seq), "", headers)
        self.records.append(rec)
        self.by_subject.setdefault(subject, []).append(seq)
        self.poke()
        return rec


class _Kv:
    """The views' bucket: values with one revision counter, and who waits for a change."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[bytes, int]] = {}
        self.revision = 0
        self.changed = asyncio.Event()


class _MemoryClient:
    """One client of the in-memory log: its writer, the shared streams, views and bus, and the link."""

    def __init__(self, *, writer: str = "memory", timeout: float = 5.0) -> None:
        self.writer = writer
        self.timeout = timeout
        self.bus = MemoryBus()
        self._events = _Stream()
        self._intents = _Stream()
        self._kv = _Kv()
        self._listeners: list[Callable[[bool], None]] = []

    def connect(self, writer: str) -> Self:
        """Another client of this log, appending as `writer`."""
        other = type(self).__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.writer = writer
        return other

    # ------------------------------------------------------------------------ connection state

    @property
    def connected(self) -> bool:
        return self.bus.connected

    def on_link_change(self, listener: Callable[[bool], None]) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def drop_link(self) -> None:
        """Play a lost connection: reads and writes raise LogUnavailable, listeners hear False."""
        self.bus.connected = False
        self._events.poke()  # a waiting follow sees it and raises LogUnavailable
        for listener in list(self._listeners):
            listener(False)

    def restore_link(self) -> None:
        self.bus.connected = True
        for listener in list(self._listeners):
            listener(True)

    def _up(self, what: str) -> None:
        if not self.bus.connected:
            raise LogUnavailable(f"{what}: the in-memory log's link is down (drop_link)")

    async def ensure(self, *, replicas: int | None = None) -> None:
        return None

    async def close(self) -> None:
        return None


class MemoryEvents(_MemoryClient):
    """The event stream in memory: appends and reads (`haru.log.seam.EventStore`)."""

    async def append(self, subject: str, event: Event, *, expect: int) -> int:
        self._up(f"appending to {subject}")
        last = self._events.last_of(subject)
        current = 0 if last is None else last.seq
        at_expect = None if expect == 0 or expect > self._events.last_seq else self._events.records[expect - 1]
        if expect != 0 and (at_expect is None or at_expect.subject != subject):
            raise Conflict(subject, expect, current)
        prev = "" if at_expect is None else body_hash(at_expect.data)
        if event.prev != prev or not event.by:
            event = msgspec.structs.replace(event, prev=prev, by=event.by or self.writer)
        data = encode(event)
        mid = msg_id(subject, expect, data)
        if current != expect:
            # ours, stored before the ack was lost (the same Msg-Id is the same event), or someone else's
            if last is not None and (last.headers or {}).get(MSG_ID) == mid:
                return last.seq
            raise Conflict(subject, expect, current)
        headers = {EXPECTED_LAST_SUBJECT_SEQ: str(expect), MSG_ID: mid}
        rec = await self._events.add(subject, data, headers, event)
        return rec.seq

    async def append_batch(self, appends: Sequence[tuple[str, Event]], *, expect: Mapping[str, int]) -> list[int]:
        self._up(f"appending a batch of {len(appends)}")
        if not appends:
            return []
        missing = sorted({s for s, _ in appends} - set(expect))
        if missing:
            raise ValueError(f"append_batch: no expected sequence for {', '.join(missing)}")
        tips: dict[str, tuple[int, str]] = {}  # subject -> (the sequence the batch expects, prev for the next)
        for subject in dict.fromkeys(s for s, _ in appends):
            want = expect[subject]
            at_expect = None if want == 0 or want > self._events.last_seq else self._events.records[want - 1]
            if want != 0 and (at_expect is None or at_expect.subject != subject):
                last = self._events.last_of(subject)
                raise Conflict(subject, want, 0 if last is None else last.seq)
            tips[subject] = (want, "" if at_expect is None else body_hash(at_expect.data))
        batch = uuid.uuid4().hex  # the headers JetStream stores with a batch's messages (haru.log.history reads them)
        staged = stage_batch(appends, tips, self.writer)
        for i, (_, _, headers, _) in enumerate(staged, 1):
            headers.update({BATCH_ID: batch, BATCH_SEQ: str(i)})
        for subject in tips:
            last = self._events.last_of(subject)
            current = 0 if last is None else last.seq
            if current != expect[subject]:
                # a retry of a batch that was stored before its ack was lost, or someone else's append
                subject_n, _, headers_n, _ = staged[-1]
                stored = self._events.last_of(subject_n)
                if stored is not None and (stored.headers or {}).get(MSG_ID) == headers_n[MSG_ID]:
                    return list(range(stored.seq - len(staged) + 1, stored.seq + 1))
                raise Conflict(subject, expect[subject], current)
        # no await between the adds: nothing else is stored in between, and a reader sees all or none
        return [(await self._events.add(subject, data, headers, event)).seq for subject, data, headers, event in staged]

    async def append_raw(self, subject: str, data: bytes) -> int:
        """Store a body as it is, unchecked (a forged or invalid event, for tests of what readers do)."""
        self._up(f"appending to {subject}")
        return (await self._events.add(subject, data, {}, None)).seq

    # ----------------------------------------------------------------------------------- reads

    async def last_seq(self) -> int:
        self._up("reading the event stream's state")
        return self._events.last_seq

    async def last_seq_matching(self, subject_filter: str) -> int:
        self._up(f"reading the last message on {subject_filter}")
        for rec in reversed(self._events.records):
            if subject_matches(subject_filter, rec.subject):
                return rec.seq
        return 0

    async def last(self, subject: str, *, direct: bool = False) -> Record | None:
        self._up(f"reading the last message on {subject}")
        return self._events.last_of(subject)

    async def last_seq_of(self, subject: str) -> int:
        rec = await self.last(subject)
        return 0 if rec is None else rec.seq

    async def read_seq(self, seq: int) -> Record | None:
        self._up(f"reading sequence {seq}")
        return self._events.records[seq - 1] if 1 <= seq <= self._events.last_seq else None

    async def subject_counts(self, subject_filter: str = subjects.ALL_EVENTS) -> dict[str, int]:
        self._up(f"listing the subjects {subject_filter}")
        return {s: len(q) for s, q in self._events.by_subject.items() if subject_matches(subject_filter, s)}

    async def history(
        self,
        subject_filter: str = subjects.ALL_EVENTS,
        *,
        from_seq: int = 1,
        timeout: float | None = None,
        strict: bool = False,
    ) -> list[Record]:
        out: list[Record] = []
        await self.replay(out.append, from_seq=from_seq, subject_filter=subject_filter)
        return out

    async def tail(
        self, subject_filter: str, limit: int, *, timeout: float | None = None, strict: bool = False
    ) -> list[Record]:
        records = await self.history(subject_filter)
        return records[-limit:] if limit else records

    async def replay(
        self,
        handler: Callable[[Record], Any | Awaitable[Any]],
        *,
        from_seq: int = 1,
        subject_filter: str = subjects.ALL_EVENTS,
        follow: bool = False,
        headers: bool = True,
        timeout: float | None = None,
        strict: bool = False,
        on_gap: Callable[[list[int]], Any] | None = None,
    ) -> int:
        """`EventLog.replay`: each stored record matching the filter from `from_seq`, in order; with
        `follow`, then every new one until cancelled (or until the link drops: LogUnavailable)."""
        self._up(f"replaying {subject_filter} from {from_seq}")
        is_async = inspect.iscoroutinefunction(handler)
        stream = self._events
        unfiltered = subject_filter == subjects.ALL_EVENTS
        last_handled = from_seq - 1
        nxt = max(from_seq, 1)
        while True:
            while nxt <= stream.last_seq:
                if not self.bus.connected:
                    raise LogUnavailable(f"replaying {subject_filter}: the in-memory log's link is down (drop_link)")
                rec = stream.records[nxt - 1]
                nxt += 1
                if unfiltered or subject_matches(subject_filter, rec.subject):
                    if not headers and rec.headers is not None:
                        rec = msgspec.structs.replace(rec, headers=None)
                    if is_async:
                        await handler(rec)
                    else:
                        handler(rec)
                    last_handled = rec.seq
                if nxt % _YIELD_EVERY == 0:
                    await asyncio.sleep(0)
            if not follow:
                return last_handled
            while nxt > stream.last_seq and self.bus.connected:
                await stream.wait()
            if not self.bus.connected:
                raise LogUnavailable(f"following {subject_filter}: the in-memory log's link is down (drop_link)")

    def follower(
        self, handler: Callable[[Record], Any | Awaitable[Any]], *, from_seq: int = 1, **kwargs: Any
    ) -> Follower:
        return Follower(self, handler, from_seq=from_seq, **kwargs)

    async def follow(
        self, handler: Callable[[Record], Any | Awaitable[Any]], *, from_seq: int = 1, **kwargs: Any
    ) -> None:
        await self.follower(handler, from_seq=from_seq, **kwargs).run()


class MemoryViews(_MemoryClient):
    """The views' bucket in memory, compare-and-swap by revision (`haru.log.seam.ViewStore`)."""

    async def get_view(self, key: str) -> tuple[bytes, int] | None:
        self._up(f"reading view {key}")
        return self._kv.values.get(key)

    async def views(self) -> dict[str, bytes]:
        self._up("listing views")
        return {k: v for k, (v, _) in self._kv.values.items()}

    async def put_view(self, key: str, data: bytes, *, last: int) -> int:
        self._up(f"writing view {key}")
        kv = self._kv
        current = kv.values.get(key)
        if (0 if current is None else current[1]) != last:
            raise Conflict(f"kv:{key}", last, None if current is None else current[1])
        kv.revision += 1
        kv.values[key] = (data, kv.revision)
        changed, kv.changed = kv.changed, asyncio.Event()
        changed.set()
        return kv.revision

    async def watch_views(self, pattern: str = "fleet.*") -> AsyncIterator[tuple[str, bytes | None, int]]:
        seen: dict[str, int] = {}
        while True:
            changed = self._kv.changed  # taken before the scan: a change while the caller works is not missed
            for key, (data, rev) in sorted(self._kv.values.items(), key=lambda kv: kv[1][1]):
                if subject_matches(pattern, key) and seen.get(key, 0) < rev:
                    seen[key] = rev
                    yield key, data, rev
            await changed.wait()


class MemoryIntents(_MemoryClient):
    """The route intents' stream in memory (`haru.log.seam.IntentStore`)."""

    async def publish_intent(self, fleet: str, data: bytes, *, expect: int) -> int:
        subject = subjects.intent(fleet)
        self._up(f"publishing on {subject}")
        last = self._intents.last_of(subject)
        current = 0 if last is None else last.seq
        mid = msg_id(subject, expect, data)
        if current != expect:
            if last is not None and (last.headers or {}).get(MSG_ID) == mid:
                return last.seq  # the same intent at the same position: one message (JetStream's dedupe)
            raise Conflict(subject, expect, current)
        return (await self._intents.add(subject, data, {EXPECTED_LAST_SUBJECT_SEQ: str(expect), MSG_ID: mid}, None)).seq

    async def last_intent(self, fleet: str) -> tuple[bytes, int] | None:
        self._up(f"reading the last intent of {fleet}")
        last = self._intents.last_of(subjects.intent(fleet))
        return None if last is None else (last.data, last.seq)

    async def watch_intents(self, fleet: str = "*") -> AsyncIterator[tuple[str, bytes, int]]:
        pattern = "haru.route.*" if fleet == "*" else subjects.intent(fleet)
        stream = self._intents
        latest = {s: q[-1] for s, q in stream.by_subject.items() if subject_matches(pattern, s)}
        for seq in sorted(latest.values()):
            rec = stream.records[seq - 1]
            yield rec.subject.rsplit(".", 1)[1], rec.data, rec.seq
        nxt = stream.last_seq + 1
        while True:
            while nxt > stream.last_seq:
                await stream.wait()
            while nxt <= stream.last_seq:
                rec = stream.records[nxt - 1]
                nxt += 1
                if subject_matches(pattern, rec.subject):
                    yield rec.subject.rsplit(".", 1)[1], rec.data, rec.seq


class MemoryLog(MemoryEvents, MemoryViews, MemoryIntents):
    """The event log in memory (see the module docstring): a `haru.log.seam.Log`, as `EventLog` is,
    composed of the same three parts (events, views, intents); haru/log/conformance.py has mypy
    check it against every Protocol of the seam.

    `connect(writer)` is another client of the same log (its own `writer`, the same streams, views
    and bus), as a second process's `EventLog.connect` would be.
    """
