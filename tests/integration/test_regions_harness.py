"""The region harness itself (tests/support/regions.py): three namespaces, a bridge, a delay proxy, and a
three-region NATS cluster whose streams and views bucket hold one replica per region.

What is asserted is what the scenario tests rely on: the log's quorums span the three regions; the proxy
really delays the inter-region paths; a region cut from the other two loses the right to append while
the two keep it, and catches up when the cut heals; a partition takes a region off the network and a
region loss kills what ran there; closing leaves no namespace or link behind.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import pytest

from haru.core import subjects
from haru.core.errors import LogError, LogUnavailable
from haru.core.events import FleetDeclared
from haru.core.specs import Policy
from haru.log.eventlog import EventLog
from tests.support.regions import Regions, ensure_streams, require_netns

pytestmark = pytest.mark.timeout(90)
STREAMS = (subjects.EVENTS_STREAM, subjects.ROUTE_STREAM, "KV_" + subjects.VIEWS_BUCKET)


@pytest.fixture(scope="module")
def regions(tmp_path_factory):
    require_netns()
    with Regions(tmp_path_factory.mktemp("regions")) as rg:
        rg.nats()
        yield rg


def declared(fleet: str, by: str) -> FleetDeclared:
    from datetime import UTC, datetime

    return FleetDeclared(at=datetime.now(UTC), by=by, fleet=fleet, policy=Policy())


async def test_the_streams_and_the_views_bucket_hold_one_replica_in_each_region(regions):
    await ensure_streams(regions.test_urls())  # as deploy/nats/ensure_streams.py makes them
    async with EventLog.connect(regions.test_urls(), writer="test") as log:
        for stream in STREAMS:
            _leader, placed = await regions.placement(log.js, stream)
            assert placed == [1, 2, 3], f"{stream} replicas sit in regions {placed}"


def round_trip_s(regions: Regions, src: int, dst: int) -> float:
    """Seconds of a NATS PING/PONG from region src to region dst's node through the proxy."""
    code = (
        f"import socket,time;s=socket.create_connection(({regions.hub_ip!r},{regions.client_port(src, dst)}),"
        "timeout=10);b=s.recv(65536)\nwhile not b.endswith(b'\\r\\n'): b+=s.recv(65536)\n"
        "s.sendall(b'CONNECT {\"verbose\":false}\\r\\nPING\\r\\n');t=time.monotonic();b=b''\n"
        "while b'PONG' not in b: b+=s.recv(65536)\nprint(time.monotonic()-t)"
    )
    out = subprocess.run(
        ["ip", "netns", "exec", regions.ns(src), sys.executable, "-c", code], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    return float(out.stdout)


def test_the_proxy_delays_every_inter_region_path_both_ways(regions):
    try:
        regions.set_delay(60)
        # a PING crosses once each way: >= 2 x 60 ms
        assert round_trip_s(regions, 1, 2) >= 0.12
        assert round_trip_s(regions, 3, 1) >= 0.12
    finally:
        regions.set_delay(0)
    assert round_trip_s(regions, 1, 2) < 0.12


async def test_a_region_cut_from_the_two_others_cannot_append_and_catches_up_after(regions):
    majority = await EventLog.open([f"nats://{regions.ip(2)}:4222"], writer="test:r2", timeout=3)
    minority = await EventLog.open([f"nats://{regions.ip(1)}:4222"], writer="test:r1", timeout=3)
    try:
        await ensure_streams(regions.test_urls())
        regions.cut(1, 2)
        regions.cut(1, 3)
        # the two regions elect what they need (leaders that were in region 1 move) and keep appending
        deadline = time.monotonic() + 30
        while True:
            try:
                seq = await majority.append(subjects.decl("cut"), declared("cut", "test:r2"), expect=0)
                break
            except (LogUnavailable, LogError):
                assert time.monotonic() < deadline, "the majority side never took an append"
                await asyncio.sleep(0.3)
        # the cut-off region has no quorum: nothing it sends is acknowledged
        with pytest.raises((LogUnavailable, LogError)):
            await minority.append(subjects.decl("cut-minority"), declared("cut-minority", "test:r1"), expect=0)
    finally:
        regions.heal(1, 2)
        regions.heal(1, 3)
    deadline = time.monotonic() + 30
    while True:  # after the heal region 1's node serves what the majority wrote meanwhile
        try:
            if await minority.last_seq_of(subjects.decl("cut")) == seq:
                break
        except (LogUnavailable, LogError):
            pass
        assert time.monotonic() < deadline, "region 1 did not catch up after the heal"
        await asyncio.sleep(0.3)
    await majority.close()
    await minority.close()


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def test_partition_kill_and_close_leave_nothing_behind(tmp_path):
    require_netns()
    rg = Regions(tmp_path / "rg", tag=f"hrk{os.getpid()}").open()
    try:
        server = rg.spawn(3, "listener", [sys.executable, "-m", "http.server", "--bind", "0.0.0.0", "8000"])
        deadline = time.monotonic() + 20
        while not reachable(rg.ip(3), 8000):
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.1)
        rg.partition(3)
        assert not reachable(rg.ip(3), 8000)
        rg.heal_partition(3)
        deadline = time.monotonic() + 10
        while not reachable(rg.ip(3), 8000):
            assert time.monotonic() < deadline, "region 3 stayed unreachable after the heal"
            time.sleep(0.1)
        assert rg.kill_region(3) == ["listener"]
        assert not server.alive
    finally:
        rg.close()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert rg.tag + "-" not in names
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert rg.tag + "c" not in links
