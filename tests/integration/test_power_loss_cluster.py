"""Jepsen's cluster faults on the shipped three-node cluster (deploy/nats, `sync_interval: always`), each
node's store on a lazy filesystem and its routes through a proxy that can cut them
(tests/support/powerloss.py), under load: writers appending sequence-checked events and a promotion in
flight (an operation's steps and the route pointer moving, again and again).

c. one node's power loss plus a partition (the shape of nats-server #7567): the stream leader loses
   power while the other two are cut from each other, so no majority is left; it restarts during the
   partition, the partition heals. Nothing acknowledged may be lost, the three replicas must end equal
   (no split brain), and no writer's receipt may say the log went back.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.lazyfs import require_fuse
from tests.support.powerloss import FaultCluster, Load, haru_said

FLEET = "pl"


@pytest.mark.timeout(120)
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
    print(
        f"fault c: leader {leader} lost power ({dropped['bytes']} unsynced bytes dropped) while {x}|{y} were cut; "
        f"appends acknowledged again {t_back:.1f} s after; {len(load.acked)} acknowledged, {len(lost)} lost, "
        f"{load.flips} route flips, {load.errors} failed appends; receipts: {said or 'nothing regressed'}; "
        f"replicas {states}"
    )
    assert acked_without_majority <= load.writers + 1, "appends were acknowledged without a majority"
    assert lost == [], f"{len(lost)} of {len(load.acked)} acknowledged events lost: {lost[:5]}"
    assert said == []
    assert len(set(states.values())) == 1 and None not in states.values(), f"the replicas differ: {states}"
    assert next(iter(states.values()))[1] >= max(a.seq for a in load.acked)  # type: ignore[index]
    assert load.flips >= 1
