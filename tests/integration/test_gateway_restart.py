"""A gateway's start on a long history: its route follower reads each fleet's last route move, not the
route subjects' whole history, and then follows every new move (gateway/state.py)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from haru.core import subjects
from haru.core.events import RouteMoved
from haru.gateway.metrics import GatewayMetrics
from haru.gateway.routing import RoutingTable
from haru.gateway.state import RouteFollower


async def move(log, fleet: str, active: str) -> int:
    route = subjects.route(fleet)
    return await log.append(route, RouteMoved(at=datetime.now(UTC), active=active), expect=await log.last_seq_of(route))


async def until(cond, timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.02)


async def test_a_starting_gateway_reads_each_fleets_last_move_then_follows_new_ones(event_log):
    for i in range(30):
        await move(event_log, "default", "ab"[i % 2])
    for i in range(3):
        await move(event_log, "edge", "ab"[i % 2])
    last = await move(event_log, "default", "b")
    async with RouteFollower(event_log, RoutingTable(), GatewayMetrics()) as follower:
        await until(lambda: follower.route_position >= last)
        await asyncio.sleep(0.3)  # nothing older comes after
        assert follower.moves_seen == 2  # the newest move of each fleet, not the 34 in the log
        newer = await move(event_log, "edge", "b")
        await until(lambda: follower.route_position >= newer)
        assert follower.moves_seen == 3
