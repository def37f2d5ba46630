"""The domain's role: which domain the fleet's route points at, followed live.

The active domain is the `active` of the fleet's last `route_moved`; before any, the first declared
domain is active. The agent config's `role` may pin it (`active`/`standby`; `auto` follows the route).
A standby sleeps its runtimes after they load, and may run training.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from haru.agents.loops import LoopErrors
from haru.core import subjects
from haru.core.events import RouteMoved
from haru.core.record import Record
from haru.log.seam import EventReader

__all__ = ["Role"]


class Role:
    def __init__(
        self,
        log: EventReader,
        *,
        fleet: str,
        domain: str,
        pinned: str,
        first_domain: Callable[[], str],
        stopping: Callable[[], bool],
        errors: LoopErrors,
        logger: Any,
    ) -> None:
        """`pinned`: the config's role (`auto` follows the route); `first_domain`: the fleet's first declared
        domain as the slots say now (active before any route_moved)."""
        self.log = log
        self.fleet = fleet
        self.domain = domain
        self.pinned = pinned
        self.first_domain = first_domain
        self.stopping = stopping
        self.errors = errors
        self.logger = logger
        self.active_domain = ""
        self.revision = 0  # the route subject's sequence of the route_moved this role was read from
        self.on_moved: list[Callable[[], None]] = []  # called after each route_moved followed

    @property
    def now(self) -> str:
        """`active` or `standby`, as this domain's role is now."""
        if self.pinned != "auto":
            return self.pinned
        return "active" if self.active() == self.domain else "standby"

    def active(self) -> str:
        """The active domain (the first declared one before any route_moved)."""
        return self.active_domain or self.first_domain()

    async def read(self) -> None:
        """Read the route pointer now."""
        rec = await self.log.last(subjects.route(self.fleet))
        if rec is not None and isinstance(rec.event, RouteMoved):
            self.active_domain, self.revision = rec.event.active, rec.seq

    async def refresh(self, revision: int) -> None:
        """A command decided against a newer route than we have seen: read the pointer now."""
        if revision > self.revision:
            await self.read()

    async def follow(self) -> None:
        """Follow the route subject until the agent stops; the log going away keeps the last known role."""

        def on(rec: Record) -> None:
            if isinstance(rec.event, RouteMoved) and rec.seq >= self.revision:
                if rec.event.active != self.active_domain:
                    self.logger.info("route moved", active=rec.event.active, revision=rec.seq)
                self.active_domain, self.revision = rec.event.active, rec.seq
                for callback in self.on_moved:
                    callback()

        while not self.stopping():
            try:
                await self.log.follow(
                    on, from_seq=max(1, self.revision), subject_filter=subjects.route(self.fleet), name="agent-route"
                )
            except asyncio.CancelledError:
                raise
            except Exception:  # the log went away for a while (or a bug): keep the last known role
                n = self.errors.count("route")
                self.logger.warning("route follower interrupted", errors=n, exc_info=True)
                await asyncio.sleep(1.0)
