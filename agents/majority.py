"""The agent's NATS node must reach a stream majority: when it does not, the agent moves to the next server.

    watch = MajorityWatch(log, interval_s=1.0, logger=logger)
    life.spawn(watch.run(), "majority")

A node cut from the other two keeps its clients connected: nothing closes, heartbeats published there
reach nobody past it, and appends wait on a leader it cannot reach. nats-py reconnects only when the
connection itself fails, so the agent asks: every `interval_s` it checks, through the server it is on,
that the event stream has a leader backed by a majority (`EventLog.reaches_majority`). When the node
answers that it has none (no leader, or a leader that no longer hears its replicas) or does not answer,
`failures` checks in a row, it leaves that server for the next in its list (`move_to_next_server`, nats-py's
own reconnect: subscriptions and the command service follow), logging `nats node has no majority` with
the server left, and counts it (`moves`, the metric `haru_agent_nats_moves_total`). A move that lands on
a server without a majority either (the agent's whole region is cut off) waits twice as long before the
next, up to `max_backoff_s`; while the connection is down nats-py's reconnect does the moving. Away from
its `home` (its own region's node, the first in its list), every `home_every_s` it asks the home server
on a connection of its own, and goes back once that reaches a majority again (`nats home server reaches
a majority again; moving back`): an agent does not stay exposed to another region's faults.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol
from urllib.parse import urlparse

__all__ = ["MajorityWatch"]


class NodeLink(Protocol):
    @property
    def connected(self) -> bool: ...

    def connected_url(self) -> str: ...

    async def reaches_majority(self, timeout: float) -> bool | None: ...

    async def server_reaches_majority(self, url: str, timeout: float) -> bool | None: ...

    async def move_to_next_server(self) -> None: ...

    async def move_to(self, url: str) -> None: ...


class MajorityWatch:
    def __init__(
        self,
        log: NodeLink,
        *,
        interval_s: float,
        logger: Any,
        home: str = "",
        failures: int = 2,
        max_backoff_s: float = 30.0,
        home_every_s: float = 5.0,
    ) -> None:
        """`home`: the server to come back to once it reaches a majority again ("": stay where moved)."""
        self.log = log
        self.home = home
        self.home_every_s = home_every_s
        self._home_checked = 0.0
        self.interval_s = interval_s
        self.logger = logger
        self.failures = max(1, failures)
        self.max_backoff_s = max_backoff_s
        self.moves = 0  # moves made for want of a majority, since the start
        self._missed = 0  # checks in a row that found no majority
        self._fruitless = 0  # moves in a row that found no majority where they landed

    async def check(self) -> bool:
        """One check; moves when this is the `failures`-th in a row without a majority. True: a majority."""
        if not self.log.connected:
            self._missed = 0
            return False
        timeout = max(0.5, self.interval_s)
        if await self.log.reaches_majority(timeout=timeout):
            if self._fruitless or self._missed:
                self.logger.info("nats node reaches a majority", server=self.log.connected_url(), moves=self.moves)
            self._missed = self._fruitless = 0
            await self._maybe_home(timeout)
            return True
        # no leader, a leader that no longer hears its replicas, or no answer: `failures` checks in a row
        # (an election in the majority is over in about that time; a node cut off stays so)
        self._missed += 1
        if self._missed >= self.failures:
            left = self.log.connected_url()
            self.moves += 1
            self._fruitless += 1
            self._missed = 0
            self.logger.warning("nats node has no majority; moving to the next server", server=left, moves=self.moves)
            await self.log.move_to_next_server()
            await asyncio.sleep(min(self.max_backoff_s, self.interval_s * 2 ** (self._fruitless - 1)))
        return False

    async def _maybe_home(self, timeout: float) -> None:
        """Away from home, every `home_every_s`: back home when the home server reaches a majority again."""
        if not self.home or _netloc(self.log.connected_url()) == _netloc(self.home):
            return
        now = asyncio.get_running_loop().time()
        if now - self._home_checked < self.home_every_s:
            return
        self._home_checked = now
        if await self.log.server_reaches_majority(self.home, timeout):
            self.logger.info("nats home server reaches a majority again; moving back", server=self.home)
            await self.log.move_to(self.home)

    async def run(self) -> None:
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop the agent; it is logged and the watch goes on
                self.logger.warning("majority check failed", exc_info=True)
            await asyncio.sleep(self.interval_s)


def _netloc(url: str) -> str:
    return urlparse(url if "://" in url else f"nats://{url}").netloc
