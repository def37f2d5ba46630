"""Regions that fail for real, at the level of one NATS node and one link: the fleet of
tests/support/region_fleet.py on the three-region harness.

d. region 1's NATS node loses its routes to the two others while the active's agent (region 1) is
   connected to it: the agent finds its node without a stream majority and moves to a node that has one
   (agents/majority.py); its appends go on from there; no client of region 3's gateway sees anything;
f. then region 1's link flaps (down and up every few seconds, for half a minute): a bounded number of
   operations, each with its reason, no flip storm, no client of region 3's gateway sees anything, and
   the agent cut off at each flap buffers what it observes and appends it in order (agents/appender.py).

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
from tests.support.region_fleet import FLEET, ClientLoad, RegionFleet, check_history, view
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


async def wait_for(check, timeout: float, what: str, fleet: RegionFleet):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await check()
        if got:
            return got
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; exited: {fleet.dead()}")


def state(v: dict, domain: str) -> str:
    return v["domains"][domain]["models"]["m1"]["residency"]["state"]


async def settled_in(region: int, rg: Regions) -> dict | None:
    """One domain active and resident, the other asleep, reachable and eligible, no operation: whichever."""
    v = await view(region, rg)
    if not v or v["operation"] is not None or v["active"] not in ("a", "b"):
        return None
    active = v["active"]
    standby = "b" if active == "a" else "a"
    ok = (
        state(v, active) == "resident"
        and state(v, standby) == "sleeping"
        and v["domains"][standby]["reachable"]
        and v["domains"][active]["reachable"]
    )
    return v if ok else None


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
    return [c.get("name", "") for c in conns if c.get("name", "").startswith(prefix)]


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
    moved_before = len(agent_lines(fleet, "a", "nats node has no majority; moving to the next server"))
    async with ClientLoad(fleet.gateway_url(3)) as load:
        await asyncio.sleep(1)
        t_fault = time.monotonic()
        rg.isolate_node(1)
        try:

            async def moved():
                lines = agent_lines(fleet, "a", "nats node has no majority; moving to the next server")
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
    assert len(history.route) <= 2, f"a flip storm: {history.route}"
    del active


async def _reachable(rg: Regions, domain: str) -> bool:
    v = await view(3, rg)
    return bool(v) and v["domains"][domain]["reachable"]


async def test_f_a_flapping_link_makes_a_bounded_number_of_operations_and_no_client_sees_it(fleet):
    rg = fleet.rg
    await wait_for(lambda: settled_in(3, rg), 90, "a settled fleet, seen by region 3's gateway", fleet)
    ops_before = len(await requests(fleet))
    moves_before = len((await check_history(fleet)).route)
    async with ClientLoad(fleet.gateway_url(3)) as load:
        t_fault = time.monotonic()
        # region 1 (agent a, and a NATS node) flaps: 5 s down (past the 4 s heartbeat timeout), 3 s up, for ~30 s
        try:
            while time.monotonic() - t_fault < 30:
                rg.partition(1)
                await asyncio.sleep(5)
                rg.heal_partition(1)
                await asyncio.sleep(3)
        finally:
            if 1 in rg.down:
                rg.heal_partition(1)
        await wait_for(lambda: settled_in(3, rg), 90, "a settled fleet after the flapping", fleet)
        await asyncio.sleep(1)
    assert load.since(t_fault), "no request ran while the link flapped"
    assert load.bad() == [], load.bad()[:10]
    history = await check_history(fleet)
    flips = history.route[moves_before:]
    ops = (await requests(fleet))[ops_before:]
    print(f"flapping: {len(ops)} operations ({[getattr(o, 'reason', '') for o in ops]}), {len(flips)} flips")
    # at most one failover per region that went away, and one attempt retried: never one per flap
    assert len(flips) <= 2, f"a flip storm: {history.route}"
    assert len(ops) <= 4, [(type(o).__name__, getattr(o, "reason", "")) for o in ops]
    for o in ops:
        assert getattr(o, "reason", "") or getattr(o, "detail", ""), f"an operation without its reason: {o}"
