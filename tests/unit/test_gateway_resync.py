"""The gateway's resync (gateway/state.py `RouteFollower._catch_up`) tells a log that went back from a
watch that moved on while it read: what it reads is checked against what it held when the reads began."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec

from haru.core.residency import Resident
from haru.core.views import DomainView, FleetView, ModelView
from haru.gateway.metrics import GatewayMetrics
from haru.gateway.routing import RoutingTable
from haru.gateway.state import RouteFollower


def view(seq: int) -> FleetView:
    domains = {
        d: DomainView(
            name=d,
            serving_url=f"http://10.0.0.{i}:9100/v1/",
            reachable=True,
            models={"m": ModelView(name="m", admitted=True, residency=Resident(since=datetime.now(UTC)))},
        )
        for i, d in enumerate("ab", 1)
    }
    return FleetView(fleet="f", domains=domains, active="a", route_revision=1, seq=seq)


class _ReadWhileTheWatchDelivers:
    """The resync's reads, answered with what the log held when each read was served, while the view watch
    delivers a newer revision before the answer comes back (a view the projector rewrites every second)."""

    def __init__(self, follower: RouteFollower, read: tuple[bytes, int], delivered: tuple[FleetView, int]) -> None:
        self.follower, self.read, self.delivered = follower, read, delivered

    async def last(self, subject: str) -> None:
        return None

    async def last_intent(self, fleet: str) -> None:
        return None

    async def get_view(self, key: str) -> tuple[bytes, int]:
        newer, rev = self.delivered
        self.follower._apply_view("f", newer, rev, body=msgspec.json.encode(newer))
        return self.read


async def test_a_view_the_watch_delivered_during_the_resyncs_read_is_not_a_rewind():
    table = RoutingTable()
    follower = RouteFollower(None, table, GatewayMetrics())  # type: ignore[arg-type]  # no task runs
    v1, v2 = view(1), view(2)
    follower._apply_view("f", v1, 10, body=msgspec.json.encode(v1))
    follower.events = _ReadWhileTheWatchDelivers(follower, (msgspec.json.encode(v1), 10), (v2, 11))  # type: ignore[assignment]
    assert await follower._catch_up({}) == []
    assert follower.rewinds == 0
    routes = table.get("f")
    assert routes is not None and routes.view is not None and routes.view.seq == 2  # the older read replaced nothing
