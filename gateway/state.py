"""Keeps the gateway's routing table current: a KV watch on the fleet views and a subscription to
the route intents. This is the only NATS traffic the chat path depends on, and it happens here,
ahead of requests: a request never waits for NATS.

Each follower survives the log going away: it logs, waits (0.2 s doubling to 5 s) and watches
again, and the gateway keeps routing by the last state it saw meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import msgspec
import structlog

from gateway.metrics import GatewayMetrics
from gateway.routing import RoutingTable
from haru.errors import HaruError
from haru.eventlog import EventLog
from haru.views import intent_decoder, view_decoder

log = structlog.get_logger("haru.gateway")

_BACKOFF_MIN_S = 0.2
_BACKOFF_MAX_S = 5.0


class RouteFollower:
    """Two tasks (views, intents) applying what they see to `table`. An async context manager."""

    def __init__(self, events: EventLog, table: RoutingTable, metrics: GatewayMetrics,
                 on_change: Callable[[str], None] | None = None) -> None:
        self.events = events
        self.table = table
        self.metrics = metrics
        self.on_change = on_change
        self.views_seen = 0
        self.intents_seen = 0
        self.errors = 0
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> RouteFollower:
        self._tasks = [
            asyncio.create_task(self._follow("views", self._views), name="gateway-views"),
            asyncio.create_task(self._follow("intents", self._intents), name="gateway-intents"),
        ]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _follow(self, what: str, watch: Callable[[], object]) -> None:
        delay = _BACKOFF_MIN_S
        while True:
            try:
                await watch()  # type: ignore[misc]
                delay = _BACKOFF_MIN_S
            except asyncio.CancelledError:
                raise
            except HaruError as exc:
                self.errors += 1
                log.warning("gateway.watch_failed", watching=what, error=str(exc), retry_in_s=delay)
            except Exception as exc:  # a bug or a nats-py surprise: keep routing by what we have
                self.errors += 1
                log.error("gateway.watch_crashed", watching=what, error=repr(exc), retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, _BACKOFF_MAX_S)

    async def _views(self) -> None:
        async for key, data, _rev in self.events.watch_views():
            fleet = key.removeprefix("fleet.")
            if data is None:
                self.table.set_view(fleet, None)
                log.info("gateway.view_deleted", fleet=fleet)
            else:
                try:
                    view = view_decoder.decode(data)
                except msgspec.DecodeError as exc:
                    self.errors += 1
                    log.error("gateway.bad_view", fleet=fleet, error=str(exc))
                    continue
                if not self.table.set_view(fleet, view):
                    continue
            self.views_seen += 1
            self._changed(fleet, "view")

    async def _intents(self) -> None:
        async for fleet, data, seq in self.events.watch_intents("*"):
            try:
                intent = intent_decoder.decode(data)
            except msgspec.DecodeError as exc:
                self.errors += 1
                log.error("gateway.bad_intent", fleet=fleet, seq=seq, error=str(exc))
                continue
            routes = self.table.get(fleet)
            before = routes.active if routes is not None else None
            if not self.table.set_intent(fleet, intent, seq):
                continue
            self.intents_seen += 1
            after = self.table.get(fleet)
            if after is not None and after.active != before:
                log.info("gateway.route_moved", fleet=fleet, active=after.active, previous=before,
                         revision=after.revision)
            self._changed(fleet, "intent")

    def _changed(self, fleet: str, kind: str) -> None:
        routes = self.table.get(fleet)
        if routes is None:
            self.metrics.forget(fleet)
        else:
            self.metrics.route(fleet, routes.revision, kind)
        if self.on_change is not None:
            self.on_change(fleet)
