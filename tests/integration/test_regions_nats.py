"""Regions that fail for real, at the level of one NATS node and one link: the fleet of
tests/support/region_fleet.py on the three-region harness.

d. region 1's NATS node loses its routes to the two others while the active's agent (region 1) is
   connected to it: the agent finds its node without a stream majority and moves to a node that has one
   (agents/majority.py); its appends go on from there; no client of region 3's gateway sees anything;
f. then region 1's link flaps (down and up every few seconds, for half a minute): a bounded number of
   operations, each with its reason, no flip storm, no client of region 3's gateway sees anything. The
   runtime of region 1's agent crashes during the first outage: the agent, cut off, sees it, restarts it,
   buffers what it recorded and appends it in order at a heal (agents/appender.py), learns from the log
   that it was failed over meanwhile, and settles as the standby without another flip.

Each ends with the history checker (tests/support/region_fleet.check_history).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from haru.core import subjects
from haru.core.events import OperationRequested
from haru.log.eventlog import EventLog
from tests.support.agent_harness import kill_runtimes
from tests.support.region_fleet import (
    DOMAINS,
    FLEET,
    ClientLoad,
    RegionFleet,
    check_history,
    serving_in,
    settled_in,
    view,
    wait_for,
)
from tests.support.regions import Regions, require_netns

pytestmark = pytest.mark.timeout(180)


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


def agent_lines(fleet: RegionFleet, domain: str, event: str) -> list[dict]:
    out = []
    for line in fleet.procs[f"agent-{domain}"].output(10**8).splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if doc.get("event") == event:
            out.append(doc)
    return out


def clients_of(rg: Regions, region: int, prefix: str) -> list[str]:
    """The names of the clients connected to region's NATS node that start with `prefix`."""
    conns = rg.monitor(region, "/connz?limit=1024").get("connections") or []
    names = [c.get("name", "") for c in conns]
    return [n for n in names if n.startswith(prefix) and not n.endswith(":probe")]  # not its majority probes


async def requests(fleet: RegionFleet) -> list[OperationRequested]:
    async with EventLog.connect(fleet.rg.test_urls(), writer="test:ops") as log:
        recs = await log.history(subjects.op(FLEET))
    return [r.event for r in recs if isinstance(r.event, OperationRequested)]


async def test_d_an_agent_on_a_node_cut_from_the_others_moves_to_a_node_with_a_majority(fleet):
    rg = fleet.rg
    await wait_for(lambda: settled_in(3, rg), 90, "a settled fleet, seen by region 3's gateway", fleet)
    active = (await view(3, rg))["active"]
    agent_a = f"agent:{FLEET}/a@"
    assert clients_of(rg, 1, agent_a), "agent a starts on its own region's node"
    moved_before = len(agent_lines(fleet, "a", "nats node has no majority; moving to a server that has one"))
    async with ClientLoad(fleet.gateway_url(3)) as load:
        await asyncio.sleep(1)
        t_fault = time.monotonic()
        rg.isolate_node(1)
        try:

            async def moved():
                lines = agent_lines(fleet, "a", "nats node has no majority; moving to a server that has one")
                if len(lines) <= moved_before:
                    return None
                on = [r for r in (2, 3) if clients_of(rg, r, agent_a)]
                return on or None

            on = await wait_for(moved, 30, "agent a to leave its node for one with a majority", fleet)
            t_moved = time.monotonic()
            # from there its heartbeats reach the majority: the view calls a reachable again
            await wait_for(lambda: _reachable(rg, "a"), 30, "a reachable in the majority's view after the move", fleet)
            await asyncio.sleep(2)
        finally:
            rg.rejoin_node(1)
        await wait_for(lambda: settled_in(3, rg), 60, "a settled fleet after the node rejoined", fleet)
    print(f"node cut to agent moved: {t_moved - t_fault:.1f} s (to region {on}); {len(load.done)} requests")
    assert load.since(t_fault), "no request ran while the node was cut"
    assert load.bad() == [], load.bad()[:10]
    history = await check_history(fleet)
    assert len(history.route) <= 2, f"a flip storm: {history.route}; " + history.told()
    del active


async def _reachable(rg: Regions, domain: str) -> bool:
    v = await view(3, rg)
    return bool(v) and v["domains"][domain]["reachable"]


async def test_f_a_flapping_link_makes_a_bounded_number_of_operations_and_no_client_sees_it(fleet):
    """The active's region flaps: its first outage lasts until the majority has failed the fleet over
    (the active's runtime crashes meanwhile, seen only by its cut-off agent), then 5 s down, 3 s up,
    until 30 s have passed."""
    rg = fleet.rg
    v = await wait_for(lambda: settled_in(3, rg), 90, "a settled fleet, seen by region 3's gateway", fleet)
    old, new = v["active"], ("b" if v["active"] == "a" else "a")
    region = DOMAINS[old]
    ops_before = len(await requests(fleet))
    moves_before = len((await check_history(fleet)).route)
    model = subjects.model(FLEET, old, "m1")
    async with EventLog.connect(rg.test_urls(), writer="test:model") as log:
        seen_before = {r.seq for r in await log.history(model)}
    async with ClientLoad(fleet.gateway_url(3)) as load:
        t_fault = time.monotonic()
        try:
            rg.partition(region)
            await asyncio.sleep(1)
            assert kill_runtimes(fleet.root / "state" / old), f"agent {old} has no runtime to crash"
            await wait_for(lambda: serving_in(3, rg, new), 60, f"{new} active, seen by region 3's gateway", fleet)
            rg.heal_partition(region)
            heals = 1
            await asyncio.sleep(3)
            while time.monotonic() - t_fault < 30:
                rg.partition(region)
                await asyncio.sleep(5)  # past the 4 s heartbeat timeout
                rg.heal_partition(region)
                heals += 1
                await asyncio.sleep(3)
        finally:
            if region in rg.down:
                rg.heal_partition(region)
        await wait_for(lambda: settled_in(3, rg), 90, "a settled fleet after the flapping", fleet)
        await asyncio.sleep(1)
    assert load.since(t_fault), "no request ran while the link flapped"
    assert load.bad() == [], load.bad()[:10]
    history = await check_history(fleet)
    flips = history.route[moves_before:]
    ops = (await requests(fleet))[ops_before:]
    told = [(type(o).__name__, o.target, getattr(o, "reason", ""), history.ops.get(o.op_id, ["?"])[-1]) for o in ops]
    print(f"flapping: {len(ops)} operations over {heals} heals ({told}), flips {flips}")
    # one failover, and no flip back and forth with the flaps
    assert [a for _, a in flips] == [new], f"a flip storm: {history.route}; " + history.told()
    # bounded by the flaps, not by time: the failover, and at most one operation per heal (the rejoining old
    # active demoted, or an operation a flap cut short ended and asked again), never a storm
    assert len(ops) <= 1 + heals, told
    for o in ops:
        assert getattr(o, "reason", "") or getattr(o, "detail", ""), f"an operation without its reason: {o}"
    # what the old active's agent saw while cut off was buffered, then appended in order at a heal; it
    # learnt from the log that it is the standby now, and settled
    assert agent_lines(fleet, old, "appends buffered: the event log does not acknowledge")
    assert agent_lines(fleet, old, "buffered appends recorded")
    async with EventLog.connect(rg.test_urls(), writer="test:model") as log:
        tags = [type(r.event).__name__ for r in await log.history(model) if r.seq not in seen_before]
    assert tags[:3] == ["ModelLost", "ModelLoading", "ModelResident"], tags
    assert tags[-1] == "ModelSleeping", tags
