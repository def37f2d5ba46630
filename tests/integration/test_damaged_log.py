"""A damaged or truncated store: replays end, name the sequences, and the CLI exits with its own code.

Each test builds a real store (events appended, views written by a real projector), stops its
nats-server, copies the store directory, damages the COPY's message block, and starts a second
nats-server on the copy. Nothing is mocked: the damage is bytes in a `.blk` file.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from pathlib import Path

import pytest

from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.errors import LogDamaged
from haru.host.natsd import NatsServer
from haru.host.tasks import cancel_and_wait
from haru.log.eventlog import EventLog
from haru.projections.projector import Projector
from tests.support import haru
from tests.support.clock import now
from tests.support.projector import MODELS, Writer, declare, wait_view_seq
from tests.support.wait import wait_until

F = "default"
LOG_DAMAGED, LOG_TRUNCATED = 10, 11
BOUND_S = 60  # generous: a command that hung would never return


def _blocks(store: Path) -> list[Path]:
    found = sorted(store.glob("jetstream/*/streams/HARU_EVENTS/msgs/*.blk"), key=lambda p: int(p.stem))
    assert found, f"no message block under {store}"
    return found


async def _build(nats_server, log: EventLog) -> dict:
    """A fleet's declarations, a route move and residency churn, folded into views by a projector."""
    await declare(log)
    w = Writer(log)
    await w.move("a")
    await w.churn(12, domain="a")
    victim = await w.put(sj.model(F, "a", MODELS[0]), ev.ModelLoading(at=now(), domain="a", model=MODELS[0]))
    last = await w.churn(6, domain="b")
    victim_rec = await log.read_seq(victim)
    projector = Projector(log)
    task = asyncio.create_task(projector.run())
    try:
        await wait_view_seq(log, last)
        await projector.wait_idle(10)
    finally:
        await cancel_and_wait(task)
    return {"victim": victim, "victim_body": victim_rec.data, "last": last}


def _copy(server: NatsServer, dest: Path) -> Path:
    server.stop_sync()
    shutil.copytree(server.store_dir, dest, ignore=shutil.ignore_patterns("nats-server.log"))
    return dest


def _flip_byte_in(store: Path, body: bytes) -> None:
    """Flip one byte in the middle of the stored message whose body is `body`."""
    for blk in _blocks(store):
        data = bytearray(blk.read_bytes())
        at = data.find(body)
        if at >= 0:
            assert data.find(body, at + 1) < 0, "the body must be unique in the block"
            data[at + len(body) // 2] ^= 0x20
            blk.write_bytes(bytes(data))
            return
    raise AssertionError("the message's body is not in any block")


@pytest.fixture
def second_server():
    started: list[NatsServer] = []

    def start(store: Path) -> NatsServer:
        s = NatsServer(store)
        s.start_sync()
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop_sync()


@pytest.mark.timeout(240)
async def test_a_flipped_byte_ends_every_replay_and_names_the_sequence(nats_server, event_log, tmp_path, second_server):
    built = await _build(nats_server, event_log)
    await event_log.close()
    store = _copy(nats_server, tmp_path / "copy")
    _flip_byte_in(store, built["victim_body"])
    damaged = second_server(store)
    v = built["victim"]

    async with EventLog.connect([damaged.url], writer="test") as log:
        assert await log.last_seq() == built["last"]  # the server still counts it ...
        assert await log.read_seq(v) is None  # ... but cannot serve it
        seen: list[int] = []
        with pytest.raises(LogDamaged) as caught:
            async with asyncio.timeout(BOUND_S):
                await log.replay(lambda r: seen.append(r.seq), timeout=BOUND_S)
        assert caught.value.missing == [v]
        assert seen == [s for s in range(1, built["last"] + 1) if s != v]  # every other event was handled
        # Filtered on the damaged subject: the gap cannot be seen from the sequences, only counted.
        with pytest.raises(LogDamaged) as caught:
            async with asyncio.timeout(BOUND_S):
                await log.history(sj.model(F, "a", MODELS[0]), timeout=BOUND_S)
        assert caught.value.missing == [v]
        assert caught.value.records and v not in [r.seq for r in caught.value.records]
        # A follower (projector, promoter, sink) is told of the hole and goes on.
        gaps: list[list[int]] = []
        handled: list[int] = []
        follower = asyncio.create_task(log.replay(lambda r: handled.append(r.seq), follow=True, on_gap=gaps.append))
        try:
            async with asyncio.timeout(BOUND_S):
                while not handled or handled[-1] < built["last"]:
                    await asyncio.sleep(0.02)
        finally:
            await cancel_and_wait(follower)
        assert gaps == [[v]]
        # Filtered on subjects the damage is not on: complete, no false alarm.
        other = await log.history(sj.fleet_events(F).replace(">", "b.>"), timeout=BOUND_S, strict=True)
        assert other and all(r.subject.startswith("haru.evt.default.b.") for r in other)

    for argv in (("verify",), ("history",), ("history", "haru.evt.default.a.>"), ("why", MODELS[0])):
        out = await asyncio.to_thread(haru, *argv, nats_url=damaged.url, timeout=BOUND_S)
        assert out.returncode == LOG_DAMAGED, (argv, out.returncode, out.stdout, out.stderr)
        assert f"cannot serve sequence {v}" in out.stderr, (argv, out.stderr)
        assert "restore the store from a backup" in out.stderr
    listed = await asyncio.to_thread(haru, "history", nats_url=damaged.url, timeout=BOUND_S)
    assert len(listed.stdout.splitlines()) == built["last"] - 1  # what could be read is still shown
    clean = await asyncio.to_thread(haru, "history", "haru.evt.default.b.>", nats_url=damaged.url, timeout=BOUND_S)
    assert clean.returncode == 0, clean.stderr


def _cut_after(store: Path, body: bytes) -> None:
    """Cut the block file just inside the stored message whose body is `body` (it and every newer
    message vanish), and drop the block index so the server rebuilds from what is left, as after a
    restore from a cut copy."""
    for blk in _blocks(store):
        data = blk.read_bytes()
        at = data.find(body)
        if at >= 0:
            blk.write_bytes(data[:at])
            for later in _blocks(store):
                if int(later.stem) > int(blk.stem):
                    later.unlink()
            for index in store.glob("jetstream/*/streams/HARU_EVENTS/msgs/index.db"):
                index.unlink()
            return
    raise AssertionError("the message's body is not in any block")


@pytest.mark.timeout(240)
async def test_cutting_the_newest_events_is_caught_against_the_views(nats_server, event_log, tmp_path, second_server):
    built = await _build(nats_server, event_log)
    last = built["last"]
    cut_at = last - 4
    cut_body = (await event_log.read_seq(cut_at)).data
    intact = await asyncio.to_thread(haru, "verify", nats_url=nats_server.url, timeout=BOUND_S)
    assert intact.returncode == 0, intact.stdout + intact.stderr
    await event_log.close()
    store = _copy(nats_server, tmp_path / "copy")
    _cut_after(store, cut_body)
    cut = second_server(store)

    async with EventLog.connect([cut.url], writer="test") as log:
        ends = await log.last_seq()
        assert ends == cut_at - 1  # the stream is shorter, and its chains are still intact
    out = await asyncio.to_thread(haru, "verify", nats_url=cut.url, timeout=BOUND_S)
    assert out.returncode == LOG_TRUNCATED, out.stdout + out.stderr
    assert f"the store ends at {ends} but the views have folded up to {last}" in out.stderr
    assert f"events {ends + 1}..{last} are missing" in out.stderr

    # Writers go on after the cut: the stream grows past what the views folded, but the events
    # at the sequences the views name are other events. Still caught.
    async with EventLog.connect([cut.url], writer="test") as log:
        w = Writer(log)
        while await log.last_seq() < last:
            await w.churn(1, domain="b")
    out = await asyncio.to_thread(haru, "verify", nats_url=cut.url, timeout=BOUND_S)
    assert out.returncode == LOG_TRUNCATED, out.stdout + out.stderr
    assert f"seq {last} is not the event view fleet.{F} (last folded) folded" in out.stderr


async def test_a_body_nested_10000_deep_is_an_invalid_event_not_the_end_of_the_replay(nats_server, event_log):
    await declare(event_log)
    deep = await event_log.js.publish(sj.decl(F), b'{"a":' * 10_000 + b"1" + b"}" * 10_000)
    after = await Writer(event_log).move("a")
    records = await event_log.history(timeout=BOUND_S)
    bad = [r for r in records if r.seq == deep.seq]
    assert bad and bad[0].event is None and "nested too deeply" in bad[0].error
    assert records[-1].seq == after  # the replay went on past it
    out = await asyncio.to_thread(haru, "verify", nats_url=nats_server.url, timeout=BOUND_S)
    assert out.returncode == 5 and f"seq {deep.seq} on {sj.decl(F)}: the body is not a valid event" in out.stdout


def all_stopped(pid: int) -> bool:
    """Every thread of `pid` is stopped by a signal ('T' in /proc)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            states.append(task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(s in ("T", "t") for s in states)


async def test_a_replay_against_a_server_that_stopped_answering_ends_at_its_deadline(nats_server, event_log):
    import os
    import signal

    from haru.core.errors import ReplayTimeout

    await declare(event_log)
    os.kill(nats_server.proc.pid, signal.SIGSTOP)  # the server hangs: no answer, no refusal
    try:
        # every thread of it stopped before the replay asks (on a loaded machine a thread still running on the
        # other core answered a tiny replay in time, once)
        await wait_until(lambda: all_stopped(nats_server.proc.pid), 10.0, interval_s=0.01, what="the server stopped")
        with pytest.raises(ReplayTimeout) as caught:
            async with asyncio.timeout(BOUND_S):  # a replay without a deadline would hit this instead
                await event_log.history(timeout=1.0)
        assert "not finished after 1 s" in str(caught.value) and "HARU_REPLAY_TIMEOUT" in str(caught.value)
    finally:
        os.kill(nats_server.proc.pid, signal.SIGCONT)


async def test_a_forgery_the_views_folded_last_is_misplaced_not_a_cut_store(nats_server, event_log):
    # A misplaced event moves a view's position but not its `updated_at`; verify's truncation
    # witness must not take the forgery at the view's last sequence for a replaced event.
    await declare(event_log)
    w = Writer(event_log)
    await w.move("a")
    await w.churn(3, domain="a")
    agent = sj.agent(F, "a")
    forged = await event_log.append(
        agent, ev.RouteMoved(at=now(), active="b", by="agent:default/a@host"), expect=await event_log.last_seq_of(agent)
    )
    projector = Projector(event_log)
    task = asyncio.create_task(projector.run())
    try:
        await wait_view_seq(event_log, forged)
        await projector.wait_idle(10)
    finally:
        await cancel_and_wait(task)
    out = await asyncio.to_thread(haru, "verify", nats_url=nats_server.url, timeout=BOUND_S)
    assert out.returncode == 8, out.stdout + out.stderr  # MISPLACED, not LOG_TRUNCATED (11)
    assert f"seq {forged} on {agent}: route_moved" in out.stdout
    assert "store was cut" not in out.stdout + out.stderr


async def test_verify_on_a_live_fleet_is_not_fooled_by_events_folded_while_it_reads(nats_server, event_log):
    """On a live fleet the projector folds events as they are stored. Verify reads the views, then the
    stream's end: an event stored and folded between the two reads is no cut. Read the other way
    round it was one: exit 11, "the newest events were cut", on a healthy demo (seen twice in CI)."""
    from haru.cli.history import witnessed_findings

    await declare(event_log)
    w = Writer(event_log)
    await w.move("a")
    projector = Projector(event_log)
    task = asyncio.create_task(projector.run())
    try:
        await wait_view_seq(event_log, await event_log.last_seq())

        class Live:
            """The log, with one more event stored and folded while its views are being read."""

            def __getattr__(self, name):
                return getattr(event_log, name)

            async def views(self):
                await wait_view_seq(event_log, await w.churn(1, domain="a"))
                return await event_log.views()

        for _ in range(3):
            stream_last, findings = await witnessed_findings(Live())
            assert findings == [], [str(f) for f in findings]
            assert stream_last == await event_log.last_seq()
    finally:
        await cancel_and_wait(task)
