"""A log that forgot what a writer was acknowledged becomes history: the writer's `log_regressed` event
(an agent's `domain_log_regressed` on its own integrity subject, the promoter's `log_regressed` on the
fleet's), folded as an anomaly, counted on /metrics (`haru_log_regressions_total`) and failing
`haru verify` with the ranges named.

Real nats-server with its default fsync interval, its store on the lazy filesystem
(tests/support/lazyfs.py); the power goes after the writers were acknowledged, the server restarts on
what the disk kept, and the writers' own receipt guards notice when their connections come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from datetime import UTC, datetime

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from haru.core import events as ev
from haru.core import subjects
from haru.core.errors import LogError
from haru.core.fold import fold
from haru.host.natsd import NatsServer
from haru.log.eventlog import EventLog
from haru.log.history import Verifier
from haru.log.receipts import RegressionCollector
from tests.support.cluster import haru_cli
from tests.support.lazyfs import LazyFS, require_fuse

pytestmark = pytest.mark.timeout(120)

FLEET = "rg"


async def until(predicate, within: float, what: str) -> None:
    async with asyncio.timeout(within):
        while not predicate():
            await asyncio.sleep(0.05)


async def ensured(log: EventLog) -> None:
    async with asyncio.timeout(30):  # the connection comes back by itself once the server is up
        while True:
            with contextlib.suppress(LogError):
                await log.ensure()
                return
            await asyncio.sleep(0.1)


async def test_an_agent_and_the_promoter_record_what_the_log_forgot_and_verify_fails_naming_it(tmp_path):
    require_fuse()
    with LazyFS(tmp_path / "store") as fs:
        server = NatsServer(fs.mountpoint, sync_interval=None, log_file=tmp_path / "nats.log")
        await server.start()
        try:
            async with (
                EventLog.connect([server.url], writer=f"agent:{FLEET}/a@host", timeout=2.0) as agent,
                EventLog.connect([server.url], writer="promoter:host:1", timeout=2.0) as promoter,
            ):
                assert agent.receipt_guard is not None and promoter.receipt_guard is not None
                agent.receipt_guard.record_as(domain="a")
                promoter.receipt_guard.record_as()
                await agent.ensure()
                model = subjects.model(FLEET, "a", "m1")
                kept = await agent.append(
                    model, ev.ModelLoading(at=datetime.now(UTC), domain="a", model="m1"), expect=0
                )
                fs.writeback()  # the loading is long on disk; what follows was never fsynced
                resident = await agent.append(
                    model, ev.ModelResident(at=datetime.now(UTC), domain="a", model="m1"), expect=kept
                )
                route = subjects.route(FLEET)
                flip = await promoter.append(route, ev.RouteMoved(at=datetime.now(UTC), active="a"), expect=0)
                server.kill()  # the power goes
                fs.power_loss()
                await server.start()
                await ensured(agent)
                await until(
                    lambda: agent.receipt_guard.recorded and promoter.receipt_guard.recorded, 30, "both recorded"
                )
                records = await agent.history(subjects.fleet_events(FLEET))
                registry = CollectorRegistry()
                registry.register(RegressionCollector(agent.receipt_guard))
                registry.register(RegressionCollector(promoter.receipt_guard))
                metrics = generate_latest(registry).decode()
            done = await asyncio.to_thread(haru_cli, ["verify", "--nats-url", server.url], dict(os.environ))
            # Starting from a checkpoint after the records does not hide them.
            async with EventLog.connect([server.url], writer="projector:test", timeout=2.0) as projector:
                await projector.append(
                    subjects.checkpoint(FLEET),
                    ev.Checkpoint(at=datetime.now(UTC), fleet=FLEET, upto=await projector.last_seq()),
                    expect=0,
                )
            since = await asyncio.to_thread(
                haru_cli, ["verify", "--since-checkpoint", "--nats-url", server.url], dict(os.environ)
            )
        finally:
            server.kill()
        # What the log holds now: the loading, and the two writers' records of what it forgot.
        by_subject = {r.subject: r for r in records if r.subject != model}
        assert [r.seq for r in records if r.subject == model] == [kept]
        agents_record = by_subject[subjects.domain_integrity(FLEET, "a")].event
        assert isinstance(agents_record, ev.DomainLogRegressed) and agents_record.domain == "a"
        [lost] = agents_record.lost
        assert (lost.subject, lost.held, lost.acknowledged, lost.reason) == (model, kept, resident, "behind")
        assert len(lost.expected) == 64  # the sha256 of the body acknowledged at `resident`
        promoters_record = by_subject[subjects.integrity(FLEET)].event
        assert isinstance(promoters_record, ev.LogRegressed) and promoters_record.fleet == FLEET
        assert [(r.subject, r.held, r.acknowledged) for r in promoters_record.lost] == [(route, 0, flip)]

        # Folded as an anomaly naming the range.
        view = fold((r.seq, r.subject, r.event) for r in records)[FLEET]
        before = fold((r.seq, r.subject, r.event) for r in records if r.subject == model)[FLEET]
        assert view.anomalies == before.anomalies + 2
        for rec in (by_subject[subjects.domain_integrity(FLEET, "a")], by_subject[subjects.integrity(FLEET)]):
            upto = fold((r.seq, r.subject, r.event) for r in records if r.seq <= rec.seq)[FLEET]
            assert upto.last_anomaly.startswith(f"seq {rec.seq}: the event log lost acknowledged events")
            assert f"{rec.event.lost[0].subject} after {rec.event.lost[0].held} up to" in upto.last_anomaly

        # Counted on /metrics, by fleet, subject kind and writer.
        assert f'haru_log_regressions_total{{fleet="{FLEET}",subject_kind="model",writer="agent"}} 1.0' in metrics
        assert f'haru_log_regressions_total{{fleet="{FLEET}",subject_kind="route",writer="promoter"}} 1.0' in metrics

        # `haru verify`: the chains that remain hold, but history is not intact; it fails naming the ranges.
        verifier = Verifier()
        for r in records:
            verifier.add(r)
        assert verifier.breaks == [] and verifier.misplaced == [] and not verifier.ok
        assert done.returncode == 11, done.stdout + done.stderr
        assert f"{model} after {kept} up to {resident}" in done.stdout
        assert f"{route} after 0 up to {flip}" in done.stdout
        assert "lost events it had acknowledged" in done.stderr and "verify FAILED" in done.stdout
        assert since.returncode == 11, since.stdout + since.stderr
        assert f"{route} after 0 up to {flip}" in since.stdout


async def test_an_agent_s_receipts_outlive_it_so_a_power_loss_while_it_was_down_is_still_noticed(tmp_path):
    """The writer appends, stops (its receipts written to its state dir), the log loses power while it is
    down, and the next run of the same writer, with the same file, notices and records the loss."""
    require_fuse()
    state = tmp_path / "agent-a" / "receipts.json"
    state.parent.mkdir()
    model = subjects.model(FLEET, "a", "m1")
    with LazyFS(tmp_path / "store") as fs:
        server = NatsServer(fs.mountpoint, sync_interval=None, log_file=tmp_path / "nats.log")
        await server.start()
        try:
            async with EventLog.connect([server.url], writer=f"agent:{FLEET}/a@host", timeout=2.0) as first:
                assert first.receipt_guard is not None
                first.receipt_guard.record_as(domain="a")
                first.receipt_guard.persist(state)
                await first.ensure()
                kept = await first.append(
                    model, ev.ModelLoading(at=datetime.now(UTC), domain="a", model="m1"), expect=0
                )
                fs.writeback()
                resident = await first.append(
                    model, ev.ModelResident(at=datetime.now(UTC), domain="a", model="m1"), expect=kept
                )
            # the agent is down; its receipts are on its own disk (an fsynced file, renamed into place)
            assert f'"{model}":{{"seq":{resident},' in state.read_text()
            server.kill()
            fs.power_loss()
            await server.start()
            async with EventLog.connect([server.url], writer=f"agent:{FLEET}/a@host", timeout=2.0) as second:
                assert second.receipt_guard is not None
                second.receipt_guard.record_as(domain="a")
                second.receipt_guard.persist(state)
                await until(lambda: second.receipt_guard.recorded, 30, "the loss recorded")
                [found] = second.receipt_guard.found
                assert (found.subject, found.held, found.acknowledged) == (model, kept, resident)
                record = await second.read_seq(second.receipt_guard.recorded[0])
                assert record is not None and isinstance(record.event, ev.DomainLogRegressed)
                assert record.subject == subjects.domain_integrity(FLEET, "a")
            # Recorded, so the receipt is dropped: a third run does not report the same loss again.
            async with EventLog.connect([server.url], writer=f"agent:{FLEET}/a@host", timeout=2.0) as third:
                assert third.receipt_guard is not None
                third.receipt_guard.record_as(domain="a")
                third.receipt_guard.persist(state)
                assert await third.receipt_guard.check_now() == []
        finally:
            server.kill()


def test_a_receipts_file_that_cannot_be_read_is_no_receipts_and_is_rewritten_whole(tmp_path):
    from haru.core.receipts import Receipt
    from haru.log.receipts import load_receipts, save_receipts

    path = tmp_path / "receipts.json"
    assert load_receipts(path) == {}
    save_receipts(path, "agent:f/a@h", {"haru.evt.f.a.agent": Receipt(3, "h")})
    assert load_receipts(path) == {"haru.evt.f.a.agent": Receipt(3, "h")}
    path.write_bytes(b'{"v":1,"writer":"agent:f/a@h","rec')  # a torn write (never ours: we rename into place)
    assert load_receipts(path) == {}
    save_receipts(path, "agent:f/a@h", {})
    assert load_receipts(path) == {} and [p.name for p in tmp_path.iterdir()] == ["receipts.json"]
