"""Scenario d with a late move: region 1's NATS node loses its routes while the active's agent (region 1)
is connected to it, and the agent does not leave the node before the heartbeat timeout runs out (here
its majority check is off, so it never leaves: the node's rejoin does what a late move does). The
majority fails the fleet over to b; then a's heartbeats reach the majority again, and the promoter puts
the old active to sleep (`recovered`). No client of region 3's gateway may see anything: not the
failover, and not a sleeping old active that a request still met.

Its own module: the fleet's agent config differs from tests/integration/test_regions_nats.py's.
"""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from haru.core import subjects
from tests.support.region_fleet import ClientLoad, RegionFleet, check_history, serving_in, settled_in, view, wait_for
from tests.support.regions import Regions, require_netns

pytestmark = pytest.mark.timeout(180)


async def lead_from(rg: Regions, stream: str, region: int) -> None:
    """Step `stream`'s leader down until region's node leads it (each step-down elects one at random)."""
    nc = await nats.connect(rg.test_urls())
    try:
        js = nc.jetstream()
        want = f"haru-nats-r{region}"
        for _ in range(30):
            info = await js.stream_info(stream)
            if info.cluster is not None and info.cluster.leader == want:
                return
            await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=5)
            await asyncio.sleep(1.5)
        raise AssertionError(f"{stream}'s leader never landed on {want}")
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    require_netns()
    with Regions(tmp_path_factory.mktemp("regions")) as rg:
        rg.nats()
        f = RegionFleet(
            rg,
            tmp_path_factory.mktemp("fleet"),
            agent_config={"a": {"majority_check_ms": 0}},
        )
        try:
            asyncio.run(f.start())
            yield f
        finally:
            f.kill_agents_runtimes()


async def test_d_late_move_fails_over_and_the_old_active_sleeps_with_no_client_seeing_it(fleet):
    rg = fleet.rg
    await wait_for(lambda: settled_in(3, rg), 90, "a settled fleet, seen by region 3's gateway", fleet)
    assert (await view(3, rg))["active"] == "a"
    # the route intents' stream led from the node that is cut: gateways route by the route subject meanwhile
    await lead_from(rg, subjects.ROUTE_STREAM, 1)
    await wait_for(lambda: settled_in(3, rg), 60, "a settled fleet, seen by region 3's gateway", fleet)
    async with ClientLoad(fleet.gateway_url(3)) as load:
        await asyncio.sleep(1)
        t_fault = time.monotonic()
        rg.isolate_node(1)
        try:
            await wait_for(lambda: serving_in(3, rg, "b"), 60, "b active, seen by region 3's gateway", fleet)
            t_failover = time.monotonic()
            await asyncio.sleep(3)
        finally:
            rg.rejoin_node(1)
        await wait_for(lambda: settled_in(3, rg), 60, "a settled fleet after the node rejoined", fleet)
        await asyncio.sleep(2)
    print(f"node cut to failover seen: {t_failover - t_fault:.1f} s; {len(load.done)} requests")
    assert load.since(t_fault), "no request ran while the node was cut"
    assert load.bad() == [], (len(load.bad()), load.bad()[:10])
    history = await check_history(fleet)
    assert [to for _, to in history.route][-1:] == ["b"], history.told()
