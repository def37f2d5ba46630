"""Jepsen's cluster faults on the shipped three-node cluster (deploy/nats, `sync_interval: always`), each
node's store on a lazy filesystem and its routes through a proxy that can cut them
(tests/support/powerloss.py), under load: writers appending sequence-checked events and a promotion in
flight (an operation's steps and the route pointer moving, again and again).

c. one node's power loss plus a partition (the shape of nats-server #7567): the stream leader loses
   power while the other two are cut from each other, so no majority is left; it restarts during the
   partition, the partition heals. Nothing acknowledged may be lost, the three replicas must end equal
   (no split brain), and no writer's receipt may say the log went back.
d. bit flips and a truncation in one node's block files (nats-server #7549's shape), with a projector and
   a router following the route: every acknowledged event JetStream lost must be named by a writer's
   receipt, no router may be given a pointer the log no longer holds, and the view and the route intent
   must equal what the log holds again.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest

from haru.core import events as ev
from haru.core import subjects
from haru.core.sizes import GiB
from haru.core.specs import DomainSpec, GpuSpec, Policy
from haru.core.views import view_decoder
from haru.log.eventlog import EventLog
from haru.log.route import RouteWatcher
from tests.support.lazyfs import require_fuse
from tests.support.powerloss import FaultCluster, Load, covered, documented, haru_said, run_documented

FLEET = "pl"
ROUTE_STREAM = subjects.ROUTE_STREAM
RECOVERY_C = "After c: one node lost power and the network split"
RECOVERY_D = "After d: bit flips or a truncation in one node's block files"


@pytest.mark.timeout(240)
async def test_one_node_s_power_loss_during_a_partition_loses_nothing_acknowledged_and_leaves_no_split_brain(
    tmp_path,
):
    require_fuse()
    async with FaultCluster(tmp_path / "cluster") as fc:
        async with fc.log("admin", writer="writer") as log:
            load = Load(log, FLEET)
            await load.until(80)
            leader = await fc.stream_leader(log)
            assert leader is not None
            x, y = (n.index for n in fc.nodes if n.index != leader)
            fc.partition(x, y)  # the two followers are cut from each other ...
            dropped = fc.power_loss(leader)  # ... as the leader loses power: no majority anywhere
            t_fault, at_fault = time.monotonic(), len(load.acked)
            await asyncio.sleep(10)  # longer than a Raft election: a majority would have elected a leader
            acked_without_majority = len(load.acked) - at_fault
            await asyncio.to_thread(fc.restart, leader)  # back during the partition: a majority with either
            await load.more(40, timeout=45)
            t_back = time.monotonic() - t_fault
            fc.heal(x, y)
            await load.more(40, timeout=30)
            await load.stop()
            lost = await load.lost(log)
            said = await haru_said(log)
            states = await fc.converged(20)
        # docs/operations.md, 'After c: one node lost power and the network split', as written; and, as it
        # says, a node whose /healthz never turns 200 is treated as a damaged disk: the block after it
        try:
            recovery = await asyncio.to_thread(run_documented, fc, documented(RECOVERY_C), leader, wait_s=45)
            branch = "c"
        except subprocess.TimeoutExpired:
            said_healthz = await asyncio.to_thread(fc.healthz, leader)
            print(f"node {leader}'s /healthz stayed {said_healthz}: recovered as a damaged disk, as documented")
            recovery = await asyncio.to_thread(run_documented, fc, documented(RECOVERY_D), leader)
            branch = "c then d"
    print(
        f"fault c: leader {leader} lost power ({dropped['bytes']} unsynced bytes dropped) while {x}|{y} were cut; "
        f"appends acknowledged again {t_back:.1f} s after; {len(load.acked)} acknowledged, {len(lost)} lost, "
        f"{load.flips} route flips, {load.errors} failed appends; receipts: {said or 'nothing regressed'}; "
        f"replicas {states}; recovered by the documented {branch}"
    )
    assert acked_without_majority <= load.writers + 1, "appends were acknowledged without a majority"
    assert lost == [], f"{len(lost)} of {len(load.acked)} acknowledged events lost: {lost[:5]}"
    assert said == []
    assert len(set(states.values())) == 1 and None not in states.values(), f"the replicas differ: {states}"
    assert next(iter(states.values()))[1] >= max(a.seq for a in load.acked)  # type: ignore[index]
    assert load.flips >= 1
    assert any(f'"last_seq":{states[leader][1]}' in said for said in recovery), recovery  # type: ignore[index]


# ------------------------------------------------------- d: bit flips and a truncation in one node's blocks

PROJECTOR = str(Path(sys.executable).parent / "haru")


async def declare_fleet(log: EventLog) -> None:
    s = subjects.decl(FLEET)
    seq = await log.append(s, ev.FleetDeclared(at=datetime.now(UTC), fleet=FLEET, policy=Policy()), expect=0)
    for d in ("a", "b"):
        spec = DomainSpec(name=d, serving_url=f"http://{d}:9000", gpus=[GpuSpec(index=0, memory_bytes=48 * GiB)])
        seq = await log.append(s, ev.DomainDeclared(at=datetime.now(UTC), spec=spec), expect=seq)


@dataclass
class Seen:
    t: float
    revision: int
    active: str | None


async def follow(router: RouteWatcher, seen: list[Seen]) -> None:
    async for ri in router:
        seen.append(Seen(time.monotonic(), ri.revision, ri.active.domain if ri.active else None))


async def route_truth(log: EventLog) -> tuple[int, str]:
    """The route as the log holds it now: the last route_moved's sequence and active domain."""
    rec = await log.last(subjects.route(FLEET))
    assert rec is not None and isinstance(rec.event, ev.RouteMoved)
    return rec.seq, rec.event.active


def routed(router: RouteWatcher) -> tuple[int, str] | None:
    ri = router.current
    return None if ri is None or ri.active is None else (ri.revision, ri.active.domain)


async def view_route(log: EventLog) -> tuple[int, str] | None:
    got = await log.get_view(subjects.view_key(FLEET))
    if got is None:
        return None
    view = view_decoder.decode(got[0])
    return view.route_revision, view.active


async def held(log: EventLog, s: Seen) -> bool:
    """The log holds the route_moved a router was given (same sequence, same active domain)."""
    rec = await log.read_seq(s.revision)
    return (
        rec is not None
        and rec.subject == subjects.route(FLEET)
        and isinstance(rec.event, ev.RouteMoved)
        and rec.event.active == s.active
    )


@pytest.mark.timeout(120)
async def test_bit_flips_and_a_truncation_in_one_node_s_block_files_are_detected_and_never_routed_by(tmp_path):
    """The stream leader's node is stopped, bits are flipped in its HARU_EVENTS block file and its HARU_ROUTE
    block file is cut in half (a bad disk), it restarts and the streams' leaders step down so the damaged
    replica may lead. Where JetStream loses an acknowledged event, a writer's receipt must name it (the
    subject and the range); no router may be given a route pointer the log no longer holds once the log is
    back, and the projected view and the route intent must equal what the log holds again."""
    require_fuse()
    procs: list[subprocess.Popen] = []
    async with FaultCluster(tmp_path / "cluster") as fc:
        try:
            async with fc.log("admin", writer="writer") as log:
                await declare_fleet(log)
                with open(tmp_path / "projector.log", "ab") as err:
                    procs.append(
                        subprocess.Popen(
                            [PROJECTOR, "projector", "--nats-url", ",".join(fc.all_urls("projector"))],
                            stdout=subprocess.DEVNULL,
                            stderr=err,
                        )
                    )
                seen: list[Seen] = []
                async with RouteWatcher(fc.all_urls("router"), FLEET, stall_interval=0.5) as router:
                    following = asyncio.create_task(follow(router, seen))
                    await router.wait_for(lambda ri: ri is not None, 30)  # the projector runs (never routed yet)
                    load = Load(log, FLEET)
                    await load.until(80)
                    victim = await fc.stream_leader(log)
                    assert victim is not None
                    disk = fc.disks[victim - 1]
                    fc.nodes[victim - 1].kill()
                    events_blk, route_blk = fc.block_files(victim)[0], fc.block_files(victim, ROUTE_STREAM)[0]
                    flipped = disk.flip_bits(events_blk, count=16, seed=35)
                    size = (fc.nodes[victim - 1].dir / "js" / route_blk).stat().st_size
                    cut = disk.truncate(route_blk, size // 2)
                    await asyncio.to_thread(fc.restart, victim)
                    await load.more(30, timeout=45)
                    admin = await fc.cluster.raw("admin")
                    try:
                        for stream in (subjects.EVENTS_STREAM, ROUTE_STREAM):  # the damaged replica may lead
                            with contextlib.suppress(Exception):
                                await admin.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=5)
                    finally:
                        await admin.close()
                    await load.more(30, timeout=45)
                    await load.stop()
                    states = await fc.converged(20)
                    t_back = time.monotonic()  # the damaged node rejoined and the load is over: the log is back
                    lost = await load.lost(log)
                    said = await haru_said(log)
                    truth = await route_truth(log)
                    deadline = time.monotonic() + 30
                    while (now := (routed(router), await view_route(log))) != (truth, truth):
                        assert time.monotonic() < deadline, (
                            f"route and view {now}, the log {truth}: {(tmp_path / 'projector.log').read_text()[-3000:]}"
                        )
                        await asyncio.sleep(0.05)
                    took = time.monotonic() - t_back
                    await asyncio.sleep(1)  # and it stays so
                    following.cancel()
                    rewound = [s for s in seen if s.t >= t_back and not await held(log, s)]
                    leader_after = await fc.stream_leader(log)
            # docs/operations.md, 'After d: bit flips or a truncation in one node's block files', as written:
            # the damaged node gets an empty store and copies its peers'
            recovery = await asyncio.to_thread(run_documented, fc, documented(RECOVERY_D), victim)
            recovered = await fc.converged(20)
            assert (fc.nodes[victim - 1].dir / "js" / "jetstream.damaged").is_dir()  # moved aside, kept
            async with fc.log("admin", writer="reader") as reader:
                lost_after = await load.lost(reader)
        finally:
            for p in procs:
                p.kill()
                p.wait(10)
    unnamed = covered(lost, said)
    print(
        f"fault d: node {victim} damaged ({len(flipped['flipped'])} bits flipped in {events_blk}, {route_blk} cut "
        f"{cut['was']} -> {cut['size']} bytes), events leader now {leader_after}; {len(load.acked)} acknowledged, "
        f"{len(lost)} lost, {len(unnamed)} of them named by no receipt; receipts: "
        f"{[r.describe() for r in said] or 'nothing regressed'}; view and route true {took:.2f} s after the log "
        f"was back; replicas {states}"
    )
    assert unnamed == [], f"acknowledged events lost and named by no writer's receipt: {unnamed[:5]}"
    assert all(r.subject in r.describe() for r in said)
    assert rewound == [], f"a router was given a route pointer the log no longer holds: {rewound}"
    assert router.current is not None and router.current.revision == truth[0]
    assert len(set(recovered.values())) == 1 and None not in recovered.values(), f"after the recovery: {recovered}"
    assert {a.seq for a in lost_after} <= {a.seq for a in lost}, "the documented recovery lost acknowledged events"
    print(f"after the documented recovery of node {victim}: replicas {recovered}; {recovery[-1].strip()}")
