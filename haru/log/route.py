"""`RouteWatcher`: what a router embeds to follow a fleet's route intents.

    async with RouteWatcher(["nats://127.0.0.1:4222"], "default") as w:
        w.current                      # the last RouteIntent on start (None: never published)
        async for ri in w:             # the current one first (if any), then every change, in order
            ...

It reads the last intent on `haru.route.<fleet>` on start and then follows the subject with an
ordered consumer (`EventLog.watch_intents`), so a router sees every published intent in stream
order with no gap, across projector restarts (the stream keeps the history; the projector
publishes one intent per route pointer move). `w.current` is always the newest intent received,
even when nobody iterates. Intents are published with `for_ms=0` on warming answers:
`w.current_at(now)` (or `haru.core.intents.at`) recomputes it from `since`.

Start: the watcher reads the last intent, subscribes, and waits for the subscription's first
delivery (the last intent again, or a newer one), so `current` is the newest intent once the
subscription is live. A fleet with no intent at all cannot be waited for: if two intents are
published in the milliseconds before the subscription is live, only the second is delivered. The
projector publishes an intent for each fleet as soon as it folds its declaration, so this only
concerns a watcher started before the fleet was ever projected.

After a lost link or a rewound intents' stream the next intent is checked against the event log (one
read of the fleet's route subject's last event, a direct get a route follower's user may make): an intent
whose `route_moved` is not the newest the log holds (the last survivor of a store that forgot, or one the
log has already moved past) is held back, never followed (`withheld`), until the projector publishes the
intent of the route the log holds now.

A watcher may be given a log (`haru.log.seam.Log`) it shares (not closed on exit) or server URLs (it connects
and closes its own). Several iterators over one watcher are not supported: one consumer a watcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from typing import Any

import msgspec
import structlog

from haru.core import intents, receipts, subjects
from haru.core.errors import HaruError
from haru.core.subjects import check_name
from haru.core.views import RouteIntent, intent_decoder
from haru.host.tasks import cancel_and_wait
from haru.log.eventlog import EventLog
from haru.log.seam import Log

_logger = structlog.get_logger("haru.log.route")

__all__ = ["RouteWatcher"]

_END = object()


class RouteWatcher:
    """The current route intent of one fleet, then every change, in order."""

    def __init__(
        self,
        source: Log | list[str] | str,
        fleet: str,
        *,
        creds: str | None = None,
        writer: str = "route-watcher",
        stall_interval: float = 1.0,
        timeout: float = 5.0,
    ) -> None:
        self.fleet = check_name("fleet", fleet)
        self.timeout = timeout  # for the subscription's first delivery (the log's requests have their own)
        self.stall_interval = stall_interval  # 0 = never check for a stalled subscription
        self._source = source
        self._creds = creds
        self._writer = writer
        self._log: Log | None = None if isinstance(source, (list, str)) else source
        self._owns_log = self._log is None
        self.current: RouteIntent | None = None
        self.seq = 0  # stream sequence of `current` on HARU_ROUTE
        self.invalid = 0  # bodies on the subject that were not route intents (skipped)
        self.resubscribed = 0  # times a stalled subscription was replaced (after a NATS restart)
        self.resets = 0  # times the route subject went backwards or changed under us (a rewound log)
        self.withheld = 0  # intents not followed: the log no longer holds the route_moved they name
        self._doubt = False  # the link dropped or the intents went back: check the next intent against the log
        self._forget_link: Callable[[], None] | None = None
        self._body = b""  # the body at `seq`
        self._withheld: bytes | None = None  # the newest intent, when held back: asked about again (`_recheck`)
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._first = asyncio.Event()  # the subscription delivered something: it is live

    async def __aenter__(self) -> RouteWatcher:
        if self._log is None:
            assert isinstance(self._source, (list, str))
            self._log = await EventLog.open(self._source, writer=self._writer, creds=self._creds)
        try:
            self._forget_link = self._log.on_link_change(self._on_link)
            last = await self._log.last_intent(self.fleet)
            self._task = asyncio.create_task(
                self._follow(self._log.watch_intents(self.fleet)), name=f"route-watcher-{self.fleet}"
            )
            if last is not None:
                # The subscription delivers the last intent first: once it has, it is live and the
                # watcher has started. Anything newer than `last` by then is what `current` shows.
                try:
                    async with asyncio.timeout(self.timeout):
                        await self._first.wait()
                except TimeoutError:
                    if await self._pointer_held(last[0]):
                        self._accept(last[0], last[1])
                if self._error is not None:
                    raise self._error
            if self.stall_interval > 0:
                self._watchdog = asyncio.create_task(self._watch_for_stalls(), name=f"route-watchdog-{self.fleet}")
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await cancel_and_wait(self._watchdog, self._task)
        if self._forget_link is not None:
            self._forget_link()
            self._forget_link = None
        await self._close_log()

    def _on_link(self, up: bool) -> None:
        if not up:
            self._doubt = True

    async def _watch_for_stalls(self) -> None:
        """Replace the subscription when the subject holds a newer intent and nothing arrives.

        After a NATS restart nats-py's ordered consumer takes ~20 s of missed heartbeats to
        resubscribe on its own; this notices in ~2 s. The new subscription starts at the newest
        intent: intents published in between, other than the newest, are not replayed (routing
        follows the newest; `resubscribed` counts these events). A subject whose newest intent is
        below the one held, or at its sequence with other content, was rewound (a store that forgot):
        that is followed at once (`resets`), never ignored as older.
        """
        assert self._log is not None
        seen, strikes = self.seq, 0
        while True:
            await asyncio.sleep(self.stall_interval)
            if self._withheld is not None:
                await self._recheck()
            if self.seq != seen:
                seen, strikes = self.seq, 0
                continue
            try:
                async with asyncio.timeout(self.stall_interval):
                    last = await self._log.last_intent(self.fleet)
            except (TimeoutError, HaruError):
                continue  # NATS is away: nothing to conclude yet
            step = "same" if last is None else receipts.reading(self.seq, self._body, last[1], last[0])
            if step == "same":
                strikes = 0
                continue
            strikes += 1
            if step == "next" and strikes < 2:  # a rewound subject ("reset") is followed at once
                continue
            strikes = 0
            old = self._task
            await cancel_and_wait(old)
            self.resubscribed += 1
            self._task = asyncio.create_task(
                self._follow(self._log.watch_intents(self.fleet)), name=f"route-watcher-{self.fleet}"
            )

    async def _close_log(self) -> None:
        if self._owns_log and self._log is not None:
            await self._log.close()
            self._log = None

    async def _follow(self, stream: AsyncIterator[tuple[str, bytes, int]]) -> None:
        try:
            async for _, body, seq in stream:
                await self._deliver(body, seq)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surfaced to the iterator
            self._error = exc
            self._first.set()
            self._queue.put_nowait(_END)
            async with self._changed:
                self._changed.notify_all()
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]

    async def _deliver(self, body: bytes, seq: int) -> None:
        step = receipts.reading(self.seq, self._body, seq, body)
        if step != "same" and (self._doubt or step == "reset"):
            # After a lost link or a rewound intents' stream the intent may be the last survivor of a
            # store that forgot: follow it only if the log still holds the route_moved it names (one
            # read, only then). Otherwise hold it unfollowed until the projector publishes the route
            # the log holds now.
            self._doubt = True
            if not await self._pointer_held(body):
                self.withheld += 1
                self.resets += step == "reset"
                self.seq, self._body, self._withheld = seq, body, body
                _logger.warning("route_watcher.pointer_forgotten", fleet=self.fleet, seq=seq)
                self._first.set()
                return
            self._doubt = False
        self._first.set()
        if self._accept(body, seq):
            async with self._changed:
                self._changed.notify_all()

    def _accept(self, body: bytes, seq: int) -> bool:
        step = receipts.reading(self.seq, self._body, seq, body)
        if step == "same":
            return False
        if step == "reset":  # the log was rewound (a store that forgot): follow it, never the forgotten pointer
            self.resets += 1
            _logger.warning("route_watcher.rewound", fleet=self.fleet, held_seq=self.seq, seq=seq)
        self._body = body
        try:
            ri = intent_decoder.decode(body)
        except msgspec.DecodeError:
            self.invalid += 1
            self.seq = seq
            return False
        self.current = ri
        self.seq = seq
        self._withheld = None
        self._queue.put_nowait(ri)
        return True

    async def _pointer_held(self, body: bytes) -> bool:
        """Whether the log holds the route_moved the intent `body` names as the fleet's newest (True for a
        body that is not an intent: `_accept` counts it). Read as the fleet's route subject's last event by
        a direct get, the one read of the events a route follower's NATS user may make (deploy/nats); an
        intent behind that newest move is held back too: the projector publishes the newer one. Any replica
        may answer a direct get, one a moment behind its leader too: the watchdog asks again about an
        intent held back (`_recheck`). Waits while the log does not answer."""
        assert self._log is not None
        try:
            ri = intent_decoder.decode(body)
        except msgspec.DecodeError:
            return True
        if ri.revision == 0 or ri.active is None:
            return True
        route = subjects.route(self.fleet)
        warn_at = time.monotonic() + self.timeout
        while True:
            try:
                async with asyncio.timeout(self.timeout):
                    rec = await self._log.last(route, direct=True)
                break
            except (TimeoutError, HaruError) as exc:
                if self._log.connected and time.monotonic() > warn_at:  # not for want of a link: say why
                    warn_at = time.monotonic() + 60
                    _logger.warning(
                        "route_watcher.route_unread",
                        fleet=self.fleet,
                        error=str(exc) or type(exc).__name__,
                        detail=f"cannot read the last event on {route} to check an intent against it; the "
                        f"NATS user needs $JS.API.DIRECT.GET.{subjects.EVENTS_STREAM}.{route} (deploy/nats)",
                    )
                await asyncio.sleep(0.1)  # NATS is away: nothing to conclude yet
        return rec is not None and rec.seq == ri.revision and intents.pointer_held(ri, route, rec.subject, rec.event)

    async def _recheck(self) -> None:
        """Ask again about the intent held back, the newest delivered: a replica that answered from behind has
        caught up by now, or the log still does not hold its route_moved and it stays held back."""
        body = self._withheld
        if body is None or not await self._pointer_held(body) or self._withheld is not body:
            return
        self._withheld, self._doubt = None, False
        self.current = intent_decoder.decode(body)
        self._queue.put_nowait(self.current)
        async with self._changed:
            self._changed.notify_all()

    @property
    def log(self) -> Log | None:
        """The connection the watcher reads through (for `Log.on_link_change`)."""
        return self._log

    def current_at(self, now: datetime) -> RouteIntent | None:
        """`current` with `for_ms` recomputed at `now`."""
        return None if self.current is None else intents.at(self.current, now)

    def __aiter__(self) -> RouteWatcher:
        return self

    async def __anext__(self) -> RouteIntent:
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)
            if isinstance(self._error, HaruError):
                raise self._error
            raise StopAsyncIteration
        assert isinstance(item, RouteIntent)
        return item

    async def wait_for(self, predicate: Callable[[RouteIntent], bool], timeout: float) -> RouteIntent:
        """Wait until `current` satisfies `predicate` (bounded by `timeout` seconds)."""

        async def until() -> RouteIntent:
            async with self._changed:
                while self.current is None or not predicate(self.current):
                    if self._error is not None:
                        raise self._error
                    await self._changed.wait()
                return self.current

        async with asyncio.timeout(timeout):
            return await until()
