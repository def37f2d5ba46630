"""After the event log lost events (nats-server's default fsync, its store on the lazy filesystem,
tests/support/lazyfs.py, the power cut while Haru's services kept running elsewhere):

- readers reset: a follower whose position the log went back behind, or whose last record now has other
  content, reads again instead of ignoring what comes as "older";
- writers re-establish: the agents re-report their models and GPUs, the promoter puts the route pointer
  back where it had decided, the projector folds every view again; the views are true again within 5 s
  of the log being back.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime

import msgspec
import pytest

from haru.core import events as ev
from haru.core import subjects
from haru.core.errors import LogError
from haru.host.natsd import NatsServer
from haru.host.tasks import cancel_and_wait
from haru.log.eventlog import EventLog
from tests.support.lazyfs import LazyFS, require_fuse

pytestmark = pytest.mark.timeout(150)


async def ensured(log: EventLog) -> None:
    async with asyncio.timeout(30):
        while True:
            with contextlib.suppress(LogError):
                await log.ensure()
                return
            await asyncio.sleep(0.1)


async def test_a_follower_reads_again_when_the_log_refilled_a_sequence_it_had_handled(tmp_path):
    require_fuse()
    subject = subjects.agent("rw", "a")
    with LazyFS(tmp_path / "store") as fs:
        server = NatsServer(fs.mountpoint, sync_interval=None, log_file=tmp_path / "nats.log")
        await server.start()
        try:
            async with EventLog.connect([server.url], writer="writer", timeout=2.0) as log:
                await log.ensure()
                first = await log.append(subject, ev.AgentStarted(at=datetime.now(UTC), domain="a", pid=1), expect=0)
                fs.writeback()
                seen: list[tuple[int, int]] = []  # (seq, pid) as handled
                rewinds: list[int] = []

                def on_rewind(head: int) -> int:
                    rewinds.append(head)
                    seen.clear()  # the owner drops what it folded and reads everything again
                    return 0

                follower = log.follower(
                    lambda rec: seen.append((rec.seq, rec.event.pid)),
                    subject_filter=subjects.fleet_events("rw"),
                    stall_interval=0.2,
                    on_rewind=on_rewind,
                )
                task = asyncio.create_task(follower.run())
                try:
                    forgotten = await log.append(
                        subject, ev.AgentStarted(at=datetime.now(UTC), domain="a", pid=2), expect=first
                    )
                    async with asyncio.timeout(10):
                        while (forgotten, 2) not in seen:
                            await asyncio.sleep(0.02)
                    server.kill()
                    fs.power_loss()
                    await server.start()
                    await ensured(log)
                    # Another writer refills the forgotten sequence with other content.
                    again = await log.append(
                        subject, ev.AgentStarted(at=datetime.now(UTC), domain="a", pid=3), expect=first
                    )
                    assert again == forgotten
                    async with asyncio.timeout(15):
                        while seen != [(first, 1), (again, 3)]:
                            await asyncio.sleep(0.02)
                    assert rewinds and follower.rewinds >= 1
                finally:
                    await cancel_and_wait(task)
        finally:
            server.kill()


async def test_after_the_log_lost_power_the_writers_re_establish_and_the_views_are_true_within_5_s(tmp_path):
    """A two-domain fleet on the simulator (real agents, the promoter, the projector), routed to `a` (on
    disk), then promoted to `b`: that promotion and everything after it not yet fsynced when NATS loses
    power. The services keep running (they are on other machines) and reconnect to the restarted server:
    the shorter log says the route is on `a`; the promoter knew it had moved it to `b` and re-decides it."""
    require_fuse()
    from haru.core.layout import load_layout
    from haru.core.residency import Resident, Sleeping
    from haru.core.views import view_decoder
    from haru.log.apply import apply
    from haru.log.requests import request_operation
    from haru.projections.metrics import ProjectorCollector
    from haru.projections.projector import Projector
    from tests.support.promoter import promoters, view_of
    from tests.support.sim_fleet import FLEET, Fleet, sim_layout

    def routed(active: str, standby: str):
        def true(view) -> bool:
            return (
                view is not None
                and view.active == active
                and view.operation is None
                and all(isinstance(m.residency, Resident) for m in view.domains[active].models.values())
                and all(isinstance(m.residency, (Resident, Sleeping)) for m in view.domains[standby].models.values())
            )

        return true

    async def stored(log: EventLog):
        """The fleet's view as the projector stored it in KV: what the gateway and `haru status` read."""
        got = await log.get_view(subjects.view_key(FLEET))
        return None if got is None else view_decoder.decode(got[0])

    async def until(log: EventLog, true, within: float) -> None:
        async with asyncio.timeout(within):
            while True:
                with contextlib.suppress(LogError):
                    if true(await stored(log)) and true(await view_of(log, FLEET)):
                        return
                await asyncio.sleep(0.05)

    layout = sim_layout(tmp_path / "layout.json", tmp_path)
    with LazyFS(tmp_path / "store") as fs:
        server = NatsServer(fs.mountpoint, sync_interval=None, log_file=tmp_path / "nats.log")
        await server.start()
        fleet = None
        try:
            async with EventLog.connect([server.url], writer="test", timeout=2.0) as log:
                await log.ensure()
                await apply(log, load_layout(layout), datetime.now(UTC))
                projector = Projector(log, stall_interval=0.25)
                projecting = asyncio.create_task(projector.run())
                try:
                    async with promoters(server.url) as [promoter]:
                        fleet = Fleet(tmp_path, server.url, layout, gw=None)
                        for d in ("a", "b"):
                            fleet.start(d)
                        await until(log, routed("a", "b"), 60)
                        fs.writeback()  # routing on `a` is long on disk
                        await request_operation(log, FLEET, "promotion", "b", by="cli:test", now=datetime.now(UTC))
                        await until(log, routed("b", "a"), 60)
                        moved = await log.last(subjects.route(FLEET))
                        assert moved is not None and moved.event.active == "b"
                        server.kill()  # the power goes: the promotion was only in the page cache
                        fs.power_loss()
                        await server.start()
                        back = time.monotonic()
                        await until(log, routed("b", "a"), 30)
                        took = time.monotonic() - back
                        print(f"views true again {took:.2f} s after the log was back")
                        history = await log.history(subjects.fleet_events(FLEET))
                        tags = [(r.subject, ev.tag_of(r.event)) for r in history if r.event is not None]
                        # Each agent and the promoter said what the log lost...
                        for d in ("a", "b"):
                            assert (subjects.domain_integrity(FLEET, d), "domain_log_regressed") in tags, d
                        assert (subjects.integrity(FLEET), "log_regressed") in tags
                        # ...the agents re-reported their models, the promoter put the route back on `b`
                        # without a new operation (the shorter log has none in flight)...
                        assert (subjects.model(FLEET, "b", "m1"), "model_resident") in tags
                        moves = [r.event for r in history if isinstance(r.event, ev.RouteMoved)]
                        assert [m.active for m in moves] == ["a", "b"] and moves[-1].op_id == ""
                        assert moves[-1].by == promoter.identity
                        # ...and the projector and the promoter folded it all again.
                        assert projector.follower is not None and projector.follower.rewinds >= 1
                        # (and says so on /metrics: haru_projector_log_rewinds_total, alert HaruLogRewound)
                        rewinds = {
                            m.name: m.samples[0].value for m in ProjectorCollector(projector).collect() if m.samples
                        }["haru_projector_log_rewinds"]
                        assert rewinds == projector.stats.log_rewinds >= 1
                        assert promoter.follower is not None and promoter.follower.rewinds >= 1
                        assert took < 5.0, f"views true again only after {took:.2f} s"
                finally:
                    await cancel_and_wait(projecting)
        finally:
            if fleet is not None:
                await fleet.stop()
            server.kill()


async def test_the_intents_watch_and_the_gateway_take_a_rewound_route_intent_at_a_lower_sequence(tmp_path):
    """Two route intents (to `b`, then `c`) acknowledged and seen, then forgotten in a power loss; the
    projector publishes what the log now says (`a`) at a lower sequence than the last one seen. A watch of
    the intents and a gateway must both take it: holding on to `c` because `a` is "older" would route by a
    pointer the log forgot."""
    require_fuse()
    from haru.core.views import RouteIntent, Target, view_encoder
    from haru.gateway.config import GatewayConfig
    from haru.gateway.server import Gateway

    fleet = "rw"

    def intent(revision: int, active: str) -> bytes:
        return view_encoder.encode(RouteIntent(fleet=fleet, revision=revision, active=Target(domain=active)))

    def gateway_routes(gw) -> str:
        routes = gw.table.get(fleet)
        return routes.intent.active.domain if routes is not None and routes.intent is not None else ""

    with LazyFS(tmp_path / "store") as fs:
        server = NatsServer(fs.mountpoint, sync_interval=None, log_file=tmp_path / "nats.log")
        await server.start()
        try:
            async with EventLog.connect([server.url], writer="projector", timeout=2.0) as log:
                await log.ensure()
                # the move the intent names is in the log (a reader checks a reset intent against it)
                to_a = await log.append(
                    subjects.route(fleet), ev.RouteMoved(at=datetime.now(UTC), active="a"), expect=0
                )
                first = await log.publish_intent(fleet, intent(to_a, "a"), expect=0)
                fs.writeback()  # routing on `a` is long on disk
                seen: list[tuple[int, str]] = []

                async def watch() -> None:
                    async for _, body, seq in log.watch_intents(fleet):
                        seen.append((seq, msgspec.json.decode(body)["active"]["domain"]))

                watching = asyncio.create_task(watch())
                try:
                    async with Gateway(GatewayConfig(port=0, resync_ms=250), log) as gw:
                        second = await log.publish_intent(fleet, intent(2, "b"), expect=first)
                        third = await log.publish_intent(fleet, intent(3, "c"), expect=second)
                        async with asyncio.timeout(10):
                            while (third, "c") not in seen or gateway_routes(gw) != "c":
                                await asyncio.sleep(0.02)
                        server.kill()
                        fs.power_loss()
                        await server.start()
                        async with asyncio.timeout(30):
                            while True:
                                with contextlib.suppress(LogError):
                                    await log.ensure()
                                    again = await log.publish_intent(fleet, intent(to_a, "a"), expect=first)
                                    break
                                await asyncio.sleep(0.1)
                        assert again == second < third  # a lower sequence than the last one seen
                        t = time.monotonic()
                        async with asyncio.timeout(10):
                            while (again, "a") not in seen or gateway_routes(gw) != "a":
                                await asyncio.sleep(0.02)
                        print(f"watch and gateway true again {time.monotonic() - t:.2f} s after the rewound intent")
                        assert seen[-1] == (again, "a") and gw.follower is not None and gw.follower.rewinds >= 1
                finally:
                    await cancel_and_wait(watching)
        finally:
            server.kill()


async def test_an_agent_that_was_down_when_the_log_lost_power_notices_it_when_it_comes_back(tmp_path):
    """The real agent, stopped (SIGTERM: its runtimes keep serving, its receipts are in its state dir);
    NATS loses power meanwhile; the agent started again says what the log lost and re-reports."""
    require_fuse()
    import signal

    from haru.core.layout import load_layout
    from haru.log.apply import apply
    from haru.log.receipts import RECEIPTS_FILE
    from tests.support.promoter import view_of
    from tests.support.sim_fleet import FLEET, Fleet, sim_layout

    layout = sim_layout(tmp_path / "layout.json", tmp_path)
    with LazyFS(tmp_path / "store") as fs:
        server = NatsServer(fs.mountpoint, sync_interval=None, log_file=tmp_path / "nats.log")
        await server.start()
        fleet = None
        try:
            async with EventLog.connect([server.url], writer="test", timeout=2.0) as log:
                await log.ensure()
                await apply(log, load_layout(layout), datetime.now(UTC))
                fs.writeback()
                fleet = Fleet(tmp_path, server.url, layout, gw=None)
                agent = fleet.start("a")
                model = subjects.model(FLEET, "a", "m1")

                async def tags() -> list[str]:
                    return [ev.tag_of(r.event) for r in await log.history(model) if r.event is not None]

                async with asyncio.timeout(60):
                    while "model_resident" not in await tags():
                        await asyncio.sleep(0.1)
                agent.signal(signal.SIGTERM)  # a restart: the runtimes outlive it
                await agent.wait(60)
                assert model in (fleet.state_dir("a") / RECEIPTS_FILE).read_text()
                server.kill()  # the power goes while the agent is down
                fs.power_loss()
                await server.start()
                await ensured(log)
                assert "model_resident" not in await tags()  # the log forgot it
                fleet.start("a")
                integrity = subjects.domain_integrity(FLEET, "a")
                async with asyncio.timeout(60):
                    while not await log.history(integrity):
                        await asyncio.sleep(0.1)
                [record] = await log.history(integrity)
                assert isinstance(record.event, ev.DomainLogRegressed)
                assert model in {r.subject for r in record.event.lost}
                async with asyncio.timeout(30):  # and it says again what is true: m1 serves (adopted)
                    while True:
                        view = await view_of(log, FLEET)
                        if view.domains["a"].models["m1"].residency.__struct_config__.tag == "resident":
                            break
                        await asyncio.sleep(0.1)
        finally:
            if fleet is not None:
                await fleet.stop()
            server.kill()
