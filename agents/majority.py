"""The agent's NATS node must reach a stream majority: when it does not, the agent moves to a server that does.

    watch = MajorityWatch(log, servers=config.servers(), interval_s=1.0, logger=logger)
    life.spawn(watch.run(), "majority")

A node cut from the other two keeps its clients connected: nothing closes, heartbeats published there
reach nobody past it, and appends wait on a leader it cannot reach. nats-py reconnects only when the
connection itself fails, so the agent asks: every `interval_s` it checks, through the server it is on,
that the event stream has a leader backed by a majority (`EventLog.reaches_majority`: no leader, a
leader that no longer hears its replicas, or no answer all say no). After `failures` such checks in a
row (one, by default: a move needs another server that says yes, so a slow answer costs a probe, not a
move) it asks its other servers, each on a connection of its own, in its order, and moves to the first
that reaches a majority (`move_to`, nats-py's own reconnect steered there: subscriptions and the command
service follow), logging `nats node has no majority; moving to a server that has one` with both servers.
When none does (an election, which leaves every node without a leader for a few seconds; or the agent's
whole region cut off), it stays, and says so once. Away from its home (its own region's node, the first
in its list), every `home_every_s` it asks the home server the same, and goes back once that reaches a
majority again (`nats home server reaches a majority again; moving back`), so it does not stay exposed
to another region's faults. Moves are counted (`moves`, the metric `haru_agent_nats_moves_total`).
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

    async def move_to(self, url: str) -> None: ...


class MajorityWatch:
    def __init__(
        self,
        log: NodeLink,
        *,
        servers: list[str],
        interval_s: float,
        logger: Any,
        failures: int = 1,
        home_every_s: float = 5.0,
    ) -> None:
        """`servers`: the agent's servers in its order, its own region's node (its home) first."""
        self.log = log
        self.servers = list(servers)
        self.home = self.servers[0] if self.servers else ""
        self.interval_s = interval_s
        self.logger = logger
        self.failures = max(1, failures)
        self.home_every_s = home_every_s
        self.moves = 0  # moves made for want of a majority, since the start
        self._missed = 0  # checks in a row that found no majority
        self._home_checked = 0.0
        self._stuck = False  # no server reached a majority at the last look (said once)

    async def check(self) -> bool:
        """One check; after `failures` in a row without a majority, a move to a server that has one.
        True: the node the agent is on reaches a majority."""
        if not self.log.connected:
            self._missed = 0
            return False
        timeout = max(0.5, self.interval_s)
        if await self.log.reaches_majority(timeout=timeout):
            if self._missed or self._stuck:
                self.logger.info("nats node reaches a majority", server=self.log.connected_url(), moves=self.moves)
            self._missed, self._stuck = 0, False
            await self._maybe_home(timeout)
            return True
        # no leader, a leader that no longer hears its replicas, or no answer, `failures` checks in a row
        self._missed += 1
        if self._missed < self.failures:
            return False
        self._missed = 0
        here = self.log.connected_url()
        # Only a server that reaches a majority itself is worth the move: during an election every node
        # has no leader, and with the agent's whole region cut off the others cannot be reached.
        for url in self.servers:
            if _netloc(url) == _netloc(here):
                continue
            if await self.log.server_reaches_majority(url, timeout):
                self.moves += 1
                self._stuck = False
                self.logger.warning(
                    "nats node has no majority; moving to a server that has one",
                    server=here,
                    to=url,
                    moves=self.moves,
                )
                await self.log.move_to(url)
                return False
        if not self._stuck:
            self._stuck = True
            self.logger.warning("nats node has no majority, and no other server reaches one", server=here)
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
            self.moves += 1
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
