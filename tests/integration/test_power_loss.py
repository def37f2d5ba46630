"""Power loss under load, on the lazy filesystem (tests/support/lazyfs.py): does the event log keep what
it acknowledged, and does Haru notice when it does not?

The single embedded node, as `haru up` starts it, with nats-server's store on a filesystem that forgets
every write not yet fsynced. Writers append sequence-checked events on their own subjects as fast as
they can; the power goes mid-load (nats-server is SIGKILLed, then the unsynced writes are dropped);
the server restarts on the same store. Every acknowledged event is then looked for by its sequence and
body hash.

- the shipped configuration (`sync_interval: always`): nothing acknowledged is lost, and the writers'
  receipts agree with the log;
- nats-server's default (fsync every 2 min): acknowledged events are lost, and every writer's receipt
  check names each subject that lost some, with the range.

The stream itself is created, then the kernel's writeback is simulated (`writeback()`), before the
load: nats-server writes a stream's meta.inf/meta.sum without fsync even with `always`, and a real disk
has them once the flusher ran (~30 s); what is measured here is the acknowledged events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import pytest

from haru.core import events as ev
from haru.core import subjects
from haru.core.errors import LogError
from haru.core.events import ModelResident
from haru.core.sizes import GiB
from haru.core.specs import DomainSpec, GpuSpec, Policy
from haru.core.views import RouteIntent, Target, view_encoder
from haru.host.natsd import NatsServer
from haru.log.eventlog import EventLog
from haru.log.receipts import check
from haru.log.route import RouteWatcher
from tests.support.lazyfs import LazyFS, require_fuse
from tests.support.ports import lasting_port
from tests.support.powerloss import documented, run_documented_everywhere, run_documented_on
from tests.support.wait import wait_until

FLEET = "pl"
WRITERS = 4
RECOVERY_A = "After a: the single node lost power"
RECOVERY_B = "After b: all three nodes lost power"
RECOVERY_D = "After d: bit flips or a truncation in one node's block files"
RECOVERY_E = "After e: power lost between a flip's acknowledgement and its route intent"
LOAD_ACKS = 160  # acknowledged appends (all writers together) before the power goes


def test_the_embedded_server_fsyncs_every_write_unless_told_otherwise(tmp_path):
    """What `haru up` and `haru serve` start (haru.up.compose: NatsServer(home / "nats", port=...))."""
    for sync_interval, expected in (("always", True), (None, None)):
        http_port = lasting_port()
        server = NatsServer(
            tmp_path / f"s-{sync_interval}", sync_interval=sync_interval, extra_args=["-m", str(http_port)]
        )
        server.start_sync()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/varz", timeout=5) as r:
                config = json.loads(r.read())["jetstream"]["config"]
            assert config.get("sync_always") is expected, (sync_interval, config)
        finally:
            server.stop_sync()
    assert NatsServer(tmp_path / "x").sync_interval == "always"  # the default every caller gets


async def load(log: EventLog, acked: list[tuple[str, int, int]], stop: asyncio.Event, w: int) -> None:
    """One writer: sequential, sequence-checked appends on its own subject until the log goes away."""
    subject = subjects.model(FLEET, "a", f"m{w}")
    seq = 0
    i = 0
    while not stop.is_set():
        event = ModelResident(at=datetime.now(UTC), domain="a", model=f"m{w}", endpoint="127.0.0.1:1", warmup_ms=i)
        try:
            seq = await log.append(subject, event, expect=seq)
        except LogError:
            return  # the power went
        acked.append((subject, seq, i))  # acknowledged: sequence seq on subject, the event numbered i
        i += 1


async def power_loss_run(tmp_path, sync_interval: str | None):
    require_fuse()
    with LazyFS(tmp_path / "store") as fs:
        server = NatsServer(fs.mountpoint, sync_interval=sync_interval, log_file=tmp_path / "nats.log")
        await server.start()
        try:
            async with EventLog.connect([server.url], writer="agent:pl/a@host", timeout=2.0) as log:
                log.receipt_guard.record_as(domain="a")  # as an agent: what it finds becomes domain_log_regressed
                await log.ensure()
                fs.writeback()  # the streams' definitions reached the disk long ago
                acked: list[tuple[str, int, int]] = []
                stop = asyncio.Event()
                writers = [asyncio.create_task(load(log, acked, stop, w)) for w in range(WRITERS)]
                async with asyncio.timeout(60):
                    while len(acked) < LOAD_ACKS:
                        await asyncio.sleep(0.01)
                server.kill()  # the power goes: the process first, then what the disk had not been told to keep
                dropped = fs.power_loss()
                stop.set()
                async with asyncio.timeout(30):
                    await asyncio.gather(*writers)
                # what it was acknowledged (the guard drops a receipt once it has recorded its loss)
                receipts = log.receipts()
                await server.start()
                async with asyncio.timeout(30):  # the writer's connection comes back by itself
                    while True:
                        with contextlib.suppress(LogError):
                            await log.ensure()
                            break
                        await asyncio.sleep(0.1)
                lost = []
                for subject, seq, i in acked:
                    rec = await log.read_seq(seq)
                    event = rec.event if rec is not None and rec.subject == subject else None
                    if not isinstance(event, ModelResident) or event.warmup_ms != i:
                        lost.append((subject, seq))
                regressions = await check(log, receipts)
                async with asyncio.timeout(20):  # the guard's own check after the reconnect, and its record
                    while regressions and (
                        len(log.receipt_guard.found) < len(regressions) or not log.receipt_guard.recorded
                    ):
                        await asyncio.sleep(0.05)
                # docs/operations.md, 'After a: the single node lost power', as written
                recovery = await asyncio.to_thread(run_documented_on, server.url, documented(RECOVERY_A))
                return acked, lost, regressions, dropped, list(log.receipt_guard.found), recovery
        finally:
            server.kill()


async def test_shipped_config_loses_nothing_acknowledged_in_a_power_loss_under_load(tmp_path):
    acked, lost, regressions, dropped, found, recovery = await power_loss_run(tmp_path, "always")
    assert len(acked) >= LOAD_ACKS
    assert lost == [], f"{len(lost)} of {len(acked)} acknowledged events lost with sync_interval always"
    assert regressions == [] and found == []
    [verify] = recovery
    assert verify.returncode == 0 and "verify ok" in verify.stdout, (verify.stdout, verify.stderr)


async def test_default_config_loses_acknowledged_events_and_every_writer_s_receipts_say_which(tmp_path):
    acked, lost, regressions, dropped, found, recovery = await power_loss_run(tmp_path, None)
    assert dropped["bytes"] > 0
    # The writer's own log noticed by itself when its connection came back (eventlog.log_regressed).
    assert sorted(found, key=lambda r: r.subject) == regressions
    assert lost, "nats-server's default fsync interval kept everything: this test no longer shows the fault"
    lost_subjects = {subject for subject, _ in lost}
    # Every subject that lost an acknowledged event is named, with the range lost.
    assert {r.subject for r in regressions} == lost_subjects
    last_acked = {subject: max(seq for s, seq, _ in acked if s == subject) for subject in lost_subjects}
    for r in regressions:
        assert r.acknowledged == last_acked[r.subject]
        assert r.held < min(seq for s, seq in lost if s == r.subject)
        assert "lost acknowledged events" in r.describe()
    # The documented recovery: `haru verify` exits 11 and names every range the writer recorded.
    [verify] = recovery
    assert verify.returncode == 11, (verify.returncode, verify.stdout, verify.stderr)
    for r in regressions:
        assert r.subject in verify.stdout and "lost acknowledged events" in verify.stdout, verify.stdout


@pytest.mark.parametrize("held", [0, 3])
def test_the_comparison_names_a_log_behind_a_receipt_and_a_rewritten_sequence(held):
    from haru.core.receipts import Receipt, compare

    receipt = Receipt(seq=7, hash="h7")
    assert compare("s", receipt, last_seq=7, hash_at_receipt="h7") is None
    assert compare("s", receipt, last_seq=9, hash_at_receipt="h7") is None  # others appended after us
    behind = compare("s", receipt, last_seq=held, hash_at_receipt=None)
    assert behind is not None and (behind.reason, behind.held, behind.acknowledged) == ("behind", held, 7)
    rewritten = compare("s", receipt, last_seq=12, hash_at_receipt="other")
    assert rewritten is not None and rewritten.reason == "rewritten"
    assert compare("s", receipt, last_seq=12, hash_at_receipt=None).reason == "rewritten"  # another subject's now


# ------------------------------------------------ e: power loss between the flip's ack and the intent

PROJECTOR = str(Path(sys.executable).parent / "haru")


async def declare_fleet(log: EventLog) -> None:
    s = subjects.decl(FLEET)
    seq = await log.append(s, ev.FleetDeclared(at=datetime.now(UTC), fleet=FLEET, policy=Policy()), expect=0)
    for d in ("a", "b"):
        spec = DomainSpec(name=d, serving_url=f"http://{d}:9000", gpus=[GpuSpec(index=0, memory_bytes=48 * GiB)])
        seq = await log.append(s, ev.DomainDeclared(at=datetime.now(UTC), spec=spec), expect=seq)


def start_projector(url: str, path: Path) -> subprocess.Popen:
    with open(path, "ab") as err:
        return subprocess.Popen(
            [PROJECTOR, "projector", "--nats-url", url, "--log-format", "json"], stdout=subprocess.DEVNULL, stderr=err
        )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sync_interval", ["always", None], ids=["shipped", "default"])
async def test_power_loss_after_the_flip_is_acknowledged_but_before_its_intent_reached_a_router(
    tmp_path, sync_interval
):
    """The promoter's route_moved is acknowledged; the control-plane machine loses power before the
    projector published the route intent for it. After the restart the route must be the
    acknowledged one (shipped config), or the loss must be named by the writer's receipts (default)."""
    require_fuse()
    with LazyFS(tmp_path / "store") as fs:
        server = NatsServer(fs.mountpoint, sync_interval=sync_interval, log_file=tmp_path / "nats.log")
        await server.start()
        procs: list[subprocess.Popen] = []
        try:
            async with EventLog.connect([server.url], writer="promoter:p1", timeout=2.0) as log:
                log.receipt_guard.record_as()  # as the promoter: what it finds becomes log_regressed
                await log.ensure()
                await declare_fleet(log)
                procs.append(start_projector(server.url, tmp_path / "projector-1.log"))
                async with RouteWatcher([server.url], FLEET) as router:
                    await router.wait_for(lambda ri: ri is not None, 20)  # the never-routed intent
                fs.writeback()  # the declaration and the first intent are long on disk
                os.kill(procs[0].pid, signal.SIGSTOP)  # the projector has not run since the flip
                flip = await log.append(
                    subjects.route(FLEET), ev.RouteMoved(at=datetime.now(UTC), active="b"), expect=0
                )
                server.kill()  # the power goes: nats-server, the projector, the page cache
                stop(procs[0])
                fs.power_loss()
                await server.start()
                t = time.monotonic()
                procs.append(start_projector(server.url, tmp_path / "projector-2.log"))
                async with asyncio.timeout(30):
                    while True:
                        with contextlib.suppress(LogError):
                            regressions = await check(log, log.receipts())
                            break
                        await asyncio.sleep(0.1)
                async with RouteWatcher([server.url], FLEET) as router:
                    if sync_interval == "always":
                        assert regressions == []
                        intent = await router.wait_for(
                            lambda ri: ri is not None and ri.active is not None and ri.active.domain == "b", 20
                        )
                        took = time.monotonic() - t
                        assert intent.revision == flip
                        print(f"route true again {took:.2f} s after the restart")
                    else:
                        # The flip is gone and the writer that was acknowledged it says so.
                        assert [(r.subject, r.acknowledged, r.held) for r in regressions] == [
                            (subjects.route(FLEET), flip, 0)
                        ]
                        intent = await router.wait_for(lambda ri: ri is not None, 20)
                        assert intent.active is None  # the log forgot the flip: nothing routes by it
                        async with asyncio.timeout(20):  # the guard's record of what it found
                            while not log.receipt_guard.recorded:
                                await asyncio.sleep(0.05)
                # docs/operations.md, 'After e', as written
                verify, route = await asyncio.to_thread(
                    run_documented_on, server.url, documented(RECOVERY_E), fleet=FLEET
                )
                assert route.returncode == 0, (route.stdout, route.stderr)
                if sync_interval == "always":
                    assert verify.returncode == 0, (verify.stdout, verify.stderr)
                    assert f"route revision {flip} → b" in route.stdout, route.stdout
                else:
                    assert verify.returncode == 11 and subjects.route(FLEET) in verify.stdout, verify.stdout
                    assert "no active domain" in route.stdout, route.stdout
                print(f"haru route after the restart:\n{route.stdout}")
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                stop(p)
            server.kill()


# ----------------------------------------------------- b: all three cluster nodes lose power at once


@pytest.mark.timeout(180)
async def test_shipped_cluster_loses_nothing_acknowledged_when_all_three_nodes_lose_power(tmp_path):
    """The shipped deploy/nats node configs (test_deploy_cluster's cluster), each node's store on its own
    lazy filesystem; R3 appends under load; all three nodes SIGKILLed and their unsynced writes dropped
    at once; the cluster restarted on the same stores."""
    require_fuse()
    from tests.support.cluster import Cluster

    cluster = Cluster(tmp_path / "cluster")
    with contextlib.ExitStack() as mounts:
        disks = [mounts.enter_context(LazyFS(node.dir / "js")) for node in cluster.nodes]
        cluster.start()
        try:
            async with cluster.log("admin", writer="writer") as log:
                async with asyncio.timeout(30):  # JetStream's meta leader on a fresh cluster
                    while True:
                        with contextlib.suppress(LogError):
                            await log.ensure(replicas=3)
                            break
                        await asyncio.sleep(0.25)
                for disk in disks:
                    disk.writeback()  # the streams' definitions reached the disks long ago
                acked: list[tuple[str, int, int]] = []
                stop = asyncio.Event()
                writers = [asyncio.create_task(load(log, acked, stop, w)) for w in range(WRITERS)]
                async with asyncio.timeout(60):
                    while len(acked) < LOAD_ACKS // 2:
                        await asyncio.sleep(0.01)
                for node in cluster.nodes:  # the power goes everywhere at once
                    node.kill()
                for disk in disks:
                    disk.power_loss()
                stop.set()
                async with asyncio.timeout(30):
                    await asyncio.gather(*writers)
                cluster.start()
                lost: list[tuple[str, int]] = []
                async with asyncio.timeout(45):  # leaders elected, the stream answers again
                    while True:
                        try:
                            lost = []
                            for subject, seq, i in acked:
                                rec = await log.read_seq(seq)
                                event = rec.event if rec is not None and rec.subject == subject else None
                                if not isinstance(event, ModelResident) or event.warmup_ms != i:
                                    lost.append((subject, seq))
                            break
                        except LogError:
                            await asyncio.sleep(0.25)
                regressions = await check(log, log.receipts())
            # docs/operations.md, 'After b: all three nodes lost power', as written
            recovery = await asyncio.to_thread(
                run_documented_everywhere, cluster, documented(RECOVERY_B), documented(RECOVERY_D)
            )
        finally:
            cluster.stop()
    assert "verify ok" in recovery[-1], recovery
    assert len(acked) >= LOAD_ACKS // 2
    assert lost == [], f"{len(lost)} of {len(acked)} acknowledged events lost with sync_interval always on R3"
    assert regressions == []


# ------------------------------------------------------------ readers never follow a rewound pointer


def intent(revision: int, active: str) -> bytes:
    return view_encoder.encode(RouteIntent(fleet=FLEET, revision=revision, active=Target(domain=active)))


@pytest.mark.timeout(90)
async def test_a_router_follows_a_rewound_route_subject_instead_of_the_pointer_the_log_forgot(tmp_path):
    """nats-server's default fsync: the route intent that moved routing to `b` is acknowledged and seen
    by a router, then forgotten in a power loss. The projector, restarted, publishes what the log now
    says (`a`) at the same stream sequence the forgotten one had. The router must take it: holding
    on to `b` because `a` is "not newer" would route by a pointer the log no longer holds."""
    require_fuse()
    with LazyFS(tmp_path / "store") as fs:
        server = NatsServer(fs.mountpoint, sync_interval=None, log_file=tmp_path / "nats.log")
        await server.start()
        try:
            async with EventLog.connect([server.url], writer="projector", timeout=2.0) as log:
                await log.ensure()
                move = subjects.route(FLEET)
                to_a = await log.append(move, ev.RouteMoved(at=datetime.now(UTC), active="a"), expect=0)
                first = await log.publish_intent(FLEET, intent(to_a, "a"), expect=0)
                fs.writeback()  # routing on `a` is long on disk
                async with RouteWatcher([server.url], FLEET, stall_interval=0.5) as router:
                    to_b = await log.append(move, ev.RouteMoved(at=datetime.now(UTC), active="b"), expect=to_a)
                    forgotten = await log.publish_intent(FLEET, intent(to_b, "b"), expect=first)
                    await router.wait_for(lambda ri: ri.active is not None and ri.active.domain == "b", 10)
                    server.kill()
                    fs.power_loss()
                    await server.start()
                    async with asyncio.timeout(30):
                        while True:
                            with contextlib.suppress(LogError):
                                await log.ensure()
                                again = await log.publish_intent(FLEET, intent(to_a, "a"), expect=first)
                                break
                            await asyncio.sleep(0.1)
                    assert again == forgotten  # the same stream sequence, other content
                    t = time.monotonic()
                    now = await router.wait_for(lambda ri: ri.active is not None and ri.active.domain == "a", 20)
                    print(f"router true again {time.monotonic() - t:.2f} s after the rewound intent")
                    assert now.revision == to_a and router.resets >= 1
        finally:
            server.kill()


async def cut_tails_and_restart(fs: LazyFS, server: NatsServer, log: EventLog, events_kept: int, route_kept: int):
    """The server stopped, its HARU_EVENTS and HARU_ROUTE block files cut back to the sizes given, restarted; the
    intent that survived, once the log answers again."""
    server.kill()
    fs.truncate(block_files(fs, subjects.EVENTS_STREAM)[0], events_kept)
    fs.truncate(block_files(fs, subjects.ROUTE_STREAM)[0], route_kept)
    await server.start()
    async with asyncio.timeout(30):
        while True:
            with contextlib.suppress(LogError):
                return await log.last_intent(FLEET)
            await asyncio.sleep(0.1)


def block_files(fs: LazyFS, stream: str) -> list[str]:
    mount = fs.mountpoint
    return [str(p.relative_to(mount)) for p in sorted(mount.glob(f"**/{stream}/msgs/*.blk"))]


@pytest.mark.timeout(90)
async def test_a_router_is_never_handed_the_surviving_intent_of_a_route_move_the_damaged_log_lost(tmp_path):
    """Fault d on the single node, made exact: the block files lose their tails (HARU_EVENTS back to before
    both route moves, HARU_ROUTE back to the intent for the first). The intent that survives names a
    `route_moved` the log no longer holds. A router following the route through the restart must not be
    handed it: it waits for the intent of the route the log holds now (here the projector's part is played
    by the test, after a pause in which the router has seen the survivor)."""
    require_fuse()
    with LazyFS(tmp_path / "store") as fs:
        server = NatsServer(fs.mountpoint, sync_interval="always", log_file=tmp_path / "nats.log")
        await server.start()
        try:
            async with EventLog.connect([server.url], writer="promoter:p1", timeout=2.0) as log:
                log.receipt_guard.record_as()  # as the promoter: what it finds becomes log_regressed
                await log.ensure()
                await declare_fleet(log)
                fs.writeback()
                events_kept = (fs.mountpoint / block_files(fs, subjects.EVENTS_STREAM)[0]).stat().st_size
                move = subjects.route(FLEET)
                to_a = await log.append(move, ev.RouteMoved(at=datetime.now(UTC), active="a"), expect=0)
                first = await log.publish_intent(FLEET, intent(to_a, "a"), expect=0)
                route_kept = (fs.mountpoint / block_files(fs, subjects.ROUTE_STREAM)[0]).stat().st_size
                to_b = await log.append(move, ev.RouteMoved(at=datetime.now(UTC), active="b"), expect=to_a)
                await log.publish_intent(FLEET, intent(to_b, "b"), expect=first)
                seen: list[tuple[float, int, str]] = []
                async with RouteWatcher([server.url], FLEET, stall_interval=0.5) as router:

                    async def follow() -> None:
                        async for ri in router:
                            seen.append((time.monotonic(), ri.revision, ri.active.domain if ri.active else ""))

                    following = asyncio.create_task(follow())
                    await router.wait_for(lambda ri: ri.revision == to_b, 10)
                    survivor = await cut_tails_and_restart(fs, server, log, events_kept, route_kept)
                    t_back = time.monotonic()
                    assert survivor is not None and survivor[1] == first  # the damage is what the test says
                    assert await log.read_seq(to_a) is None
                    # the router has had the survivor delivered (followed, or withheld) before the projector
                    await wait_until(lambda: router.seq == first, 20, what="the router reading the survivor")
                    await asyncio.sleep(0.5)
                    again = await log.append(move, ev.RouteMoved(at=datetime.now(UTC), active="b"), expect=0)
                    await log.publish_intent(FLEET, intent(again, "b"), expect=first)
                    await router.wait_for(lambda ri: ri.revision == again and ri.active.domain == "b", 20)
                    following.cancel()
                    rewound = []
                    for t, revision, active in seen:
                        if t < t_back:
                            continue
                        rec = await log.read_seq(revision)
                        if not (
                            rec is not None and isinstance(rec.event, ev.RouteMoved) and rec.event.active == active
                        ):
                            rewound.append((revision, active))
                    assert rewound == [], f"the router was handed pointers the log no longer holds: {rewound}"
                    assert router.withheld >= 1
        finally:
            server.kill()


@pytest.mark.timeout(90)
async def test_the_gateway_never_routes_by_the_surviving_intent_of_a_route_move_the_damaged_log_lost(tmp_path):
    """The same damage as above, the gateway following: after the log is back it routes by no pointer the
    log no longer holds (here: by none, the log holds no route_moved), then by the projector's new intent."""
    from haru.core.views import DomainView, FleetView
    from tests.support.gateway import running_gateway

    require_fuse()
    with LazyFS(tmp_path / "store") as fs:
        server = NatsServer(fs.mountpoint, sync_interval="always", log_file=tmp_path / "nats.log")
        await server.start()
        try:
            async with EventLog.connect([server.url], writer="promoter:p1", timeout=2.0) as log:
                log.receipt_guard.record_as()  # as the promoter: what it finds becomes log_regressed
                await log.ensure()
                await declare_fleet(log)
                domains = {d: DomainView(name=d) for d in ("a", "b")}
                await log.put_view(
                    subjects.view_key(FLEET), view_encoder.encode(FleetView(fleet=FLEET, domains=domains)), last=0
                )
                fs.writeback()
                events_kept = (fs.mountpoint / block_files(fs, subjects.EVENTS_STREAM)[0]).stat().st_size
                move = subjects.route(FLEET)
                to_a = await log.append(move, ev.RouteMoved(at=datetime.now(UTC), active="a"), expect=0)
                first = await log.publish_intent(FLEET, intent(to_a, "a"), expect=0)
                route_kept = (fs.mountpoint / block_files(fs, subjects.ROUTE_STREAM)[0]).stat().st_size
                to_b = await log.append(move, ev.RouteMoved(at=datetime.now(UTC), active="b"), expect=to_a)
                await log.publish_intent(FLEET, intent(to_b, "b"), expect=first)
                async with EventLog.connect([server.url], writer="gateway", timeout=2.0) as gw_log:
                    async with running_gateway(gw_log, resync_ms=200) as gw:

                        def routed() -> tuple[int, str] | None:
                            routes = gw.table.get(FLEET)
                            return None if routes is None or not routes.active else (routes.revision, routes.active)

                        await wait_until(lambda: routed() == (to_b, "b"), 10, what="the gateway routing on b")
                        survivor = await cut_tails_and_restart(fs, server, log, events_kept, route_kept)
                        t_back = time.monotonic()
                        assert survivor is not None and survivor[1] == first
                        seen: list[tuple[int, str]] = []
                        # the gateway has seen the log rewound and applied what it holds now
                        while time.monotonic() - t_back < 3 or (routed() or (0, ""))[1] == "b":
                            if (now := routed()) is not None:
                                seen.append(now)
                            assert time.monotonic() - t_back < 30, f"the gateway still routes by {routed()}"
                            await asyncio.sleep(0.01)
                        again = await log.append(move, ev.RouteMoved(at=datetime.now(UTC), active="b"), expect=0)
                        await log.publish_intent(FLEET, intent(again, "b"), expect=first)
                        await wait_until(lambda: routed() == (again, "b"), 20, what="the gateway following the log")
                    # what it was handed after the log was back (before it read the log it still holds b)
                    handed = [r for i, r in enumerate(seen) if r != (seen[i - 1] if i else (to_b, "b"))]
                    rewound = []
                    for revision, active in handed:
                        rec = await log.read_seq(revision)
                        if not (
                            rec is not None and isinstance(rec.event, ev.RouteMoved) and rec.event.active == active
                        ):
                            rewound.append((revision, active))
                    assert rewound == [], f"the gateway routed by pointers the log no longer holds: {rewound}"
        finally:
            server.kill()


def test_a_reader_takes_a_lower_or_changed_sequence_as_a_reset_and_ignores_only_a_redelivery():
    from haru.core.receipts import reading

    assert reading(5, b"x", 6, b"y") == "next"
    assert reading(5, b"x", 5, b"x") == "same"
    assert reading(5, b"x", 5, b"y") == "reset"
    assert reading(5, b"x", 3, b"x") == "reset"
