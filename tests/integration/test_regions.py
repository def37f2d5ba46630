"""Regions that fail for real: the fleet of tests/support/region_fleet.py on the three-region harness.

a. the active's region partitioned from the other two, under client load through a surviving region's
   gateway: the majority fails the fleet over, no client of that gateway sees it;
e. the partition heals after the failover: the old active rejoins as the standby, its agent's buffered
   observations appended in order, without a second flip;
c. then region 3's NATS node cut from the two others while its gateway, its clients and the active still
   reach each other: the gateway routes by its last state, no client sees it, it catches up after;
b. then the region of the new active lost at once (its NATS node, promoter, projector, gateway and agent
   SIGKILLed, its link down): the two left fail the fleet over back, no client of region 3 sees it.
   (Which region leads JetStream's meta group and each stream at that moment is the cluster's choice.)

Each ends with the history checker (tests/support/region_fleet.check_history).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.region_fleet import ClientLoad, RegionFleet, check_history, state, view, wait_for
from tests.support.regions import Regions, require_netns

pytestmark = pytest.mark.timeout(180)


def serving(v: dict | None, domain: str) -> bool:
    return bool(v) and v.get("active") == domain


@pytest.fixture(scope="module")
def regions(tmp_path_factory):
    require_netns()
    with Regions(tmp_path_factory.mktemp("regions")) as rg:
        rg.nats()
        yield rg


@pytest.fixture(scope="module")
def fleet(regions, tmp_path_factory):
    f = RegionFleet(regions, tmp_path_factory.mktemp("fleet"))
    try:
        asyncio.run(f.start())
        yield f
    finally:
        f.kill_agents_runtimes()


def steady(v: dict | None, active: str, standby: str) -> bool:
    return (
        bool(v)
        and v["active"] == active
        and v["operation"] is None
        and state(v, active) == "resident"
        and state(v, standby) == "sleeping"
        and v["domains"][standby]["reachable"]
        and v["domains"][standby]["eligible"]
    )


async def test_a_the_actives_region_partitioned_fails_over_and_no_client_sees_it(fleet):
    rg = fleet.rg
    await wait_for(lambda: steady_in(3, rg, "a", "b"), 60, "a active, b asleep, seen by region 3's gateway", fleet)
    async with ClientLoad(fleet.gateway_url(3)) as load:
        await asyncio.sleep(2)
        t_fault = time.monotonic()
        rg.partition(1)
        await wait_for(lambda: serving_in(3, rg, "b"), 60, "b active, seen by region 3's gateway", fleet)
        t_moved = time.monotonic()
        await asyncio.sleep(2)
    print(f"partition to route moved, seen by the gateway: {t_moved - t_fault:.1f} s; {len(load.done)} requests")
    assert load.since(t_fault), "no request ran through the failover"
    assert load.bad() == [], load.bad()[:10]
    history = await check_history(fleet)
    assert [a for _, a in history.route] == ["a", "b"], history.told()


async def steady_in(region: int, rg: Regions, active: str, standby: str):
    v = await view(region, rg)
    return v if steady(v, active, standby) else None


async def serving_in(region: int, rg: Regions, active: str):
    v = await view(region, rg)
    return v if v and v["active"] == active and state(v, active) == "resident" and v["operation"] is None else None


async def test_e_the_partition_heals_and_the_old_active_rejoins_as_the_standby(fleet):
    rg = fleet.rg
    assert 1 in rg.down, "runs after scenario a, with region 1 still partitioned"
    async with ClientLoad(fleet.gateway_url(3)) as load:
        rg.heal_partition(1)
        v = await wait_for(lambda: steady_in(3, rg, "b", "a"), 60, "b active, a asleep again", fleet)
        await asyncio.sleep(2)
    assert load.bad() == [], load.bad()[:10]
    history = await check_history(fleet)
    assert [a for _, a in history.route] == ["a", "b"], "a second flip after the heal; " + history.told()
    # the promoter left in region 1 could not act while cut off, and said so in its named state
    said = fleet.procs["promoter-r1"].output(10**7)
    assert '"quorum_lost"' in said and '"quorum_regained"' in said, said[-3000:]
    del v


async def test_c_a_gateways_region_cut_from_nats_keeps_routing_and_catches_up(fleet):
    """Region 3's NATS node loses its routes to both others (the proxy holds their bytes), while the
    test's clients, region 3's gateway and the active b still reach each other: the gateway routes by
    what it last saw, its clients see nothing, and after the heal it serves the majority's view again."""
    rg = fleet.rg
    await wait_for(lambda: steady_in(3, rg, "b", "a"), 60, "b active, a asleep, seen by region 3's gateway", fleet)
    async with ClientLoad(fleet.gateway_url(3)) as load:
        await asyncio.sleep(1)
        t_fault = time.monotonic()
        rg.cut(3, 1)
        rg.cut(3, 2)
        try:
            await asyncio.sleep(8)  # past the route pings (3 s) and the heartbeat timeout (4 s)
        finally:
            rg.heal(3, 1)
            rg.heal(3, 2)
        await asyncio.sleep(1)
    assert load.since(t_fault), "no request ran while region 3 was cut"
    assert load.bad() == [], load.bad()[:10]

    async def caught_up():
        mine, theirs = await view(3, rg), await view(1, rg)
        return mine and theirs and mine["seq"] >= theirs["seq"] and mine["active"] == "b"

    await wait_for(caught_up, 60, "region 3's gateway to serve the majority's view again", fleet)
    history = await check_history(fleet)
    assert [a for _, a in history.route] == ["a", "b"], history.told()


async def test_b_the_actives_region_lost_with_its_node_and_promoter_fails_over_to_the_other(fleet):
    """Region 2 (the active b since scenario a, its NATS node, its promoter, projector and gateway) is
    SIGKILLed and its link taken down: region 1 and 3 keep the majority and fail over to a."""
    rg = fleet.rg
    await wait_for(lambda: steady_in(3, rg, "b", "a"), 60, "b active, a asleep, seen by region 3's gateway", fleet)
    async with ClientLoad(fleet.gateway_url(3)) as load:
        await asyncio.sleep(1)
        t_fault = time.monotonic()
        killed = rg.kill_region(2)
        assert {"nats-r2", "promoter-r2", "agent-b", "gateway-r2"} <= set(killed), killed
        await wait_for(lambda: serving_in(3, rg, "a"), 60, "a active again, seen by region 3's gateway", fleet)
        t_moved = time.monotonic()
        await asyncio.sleep(2)
    print(f"region lost to route moved, seen by the gateway: {t_moved - t_fault:.1f} s")
    assert load.since(t_fault), "no request ran through the failover"
    assert load.bad() == [], load.bad()[:10]
    history = await check_history(fleet)
    assert [a for _, a in history.route] == ["a", "b", "a"], history.told()
