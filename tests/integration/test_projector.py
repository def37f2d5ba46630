"""The projector: its scenarios written once and run on both logs (tests/support/log_world.py:
JetStream on a real nats-server, and in memory): views in KV, one route intent per pointer move, racing
projectors, resuming from the stored views, invalid bodies, quiet fleets. Then what needs a server:
`haru projector` as a child process (SIGKILL, two processes racing), `haru status`/`route`, a NATS
restart (and test_damaged_log.py: a damaged store)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import msgspec
import pytest

from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.fold import fold
from haru.core.intents import changed
from haru.core.views import intent_decoder, view_decoder
from haru.host.tasks import cancel_and_wait
from haru.log.route import RouteWatcher
from haru.log.seam import Log
from haru.projections.projector import Projector
from tests.support.clock import now
from tests.support.projector import MODELS, F, Writer, declare, stored_view, wait_view_seq
from tests.support.wait import wait_until

HARU = str(Path(sys.executable).parent / "haru")


@pytest.fixture
async def log(world):
    await declare(world.log)
    return world.log


async def expected_views(log: Log):
    return fold((r.seq, r.subject, r.event) for r in await log.history() if r.event is not None)


class ProjectorProcess:
    """`haru projector` as a real child process, with its JSON logs captured."""

    def __init__(self, url: str, log_path: Path) -> None:
        self.url = url
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> ProjectorProcess:
        self.log_file = open(self.log_path, "ab")
        env = {**os.environ, "HARU_NO_UVLOOP": os.environ.get("HARU_NO_UVLOOP", "0")}
        self.proc = subprocess.Popen(
            [HARU, "projector", "--nats-url", self.url, "--log-format", "json"],
            stdout=subprocess.DEVNULL,
            stderr=self.log_file,
            env=env,
        )
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log_file.close()

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log_file.close()
        return self.proc.returncode

    def lines(self) -> list[dict]:
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out


@pytest.fixture
def projector_processes(nats_server, tmp_path):
    started: list[ProjectorProcess] = []

    def start(name: str = "p") -> ProjectorProcess:
        p = ProjectorProcess(nats_server.url, tmp_path / f"{name}.log").start()
        started.append(p)
        return p

    try:
        yield start
    finally:
        for p in started:
            p.kill()


# ------------------------------------------------------------------------------------- in process


# ------------------------------------------------------------------------------------- in process


async def intents_published(log: Log) -> int:
    got = await log.last_intent(F)
    return 0 if got is None else got[1]  # the intents' stream is dense: its last sequence counts them


async def test_views_and_intents_follow_the_log(log):
    w = Writer(log)
    r1 = await w.move("a")
    await w.churn(9, domain="a")
    projector = Projector(log)
    task = asyncio.create_task(projector.run())
    try:
        last = await log.last_seq()
        view = await wait_view_seq(log, last)
        assert view == (await expected_views(log))[F]
        assert view.active == "a" and view.route_revision == r1
        ri = intent_decoder.decode((await log.last_intent(F))[0])
        assert (ri.revision, ri.active.domain, ri.view_seq) == (r1, "a", last)
        assert set(ri.answers) == set(MODELS)
        r2 = await w.move("b")  # following: a new pointer move becomes a new intent
        await wait_view_seq(log, r2)
        await projector.wait_idle(5)
        ri = intent_decoder.decode((await log.last_intent(F))[0])
        assert (ri.revision, ri.active.domain) == (r2, "b")
        assert projector.stats.resumed_from == 1
    finally:
        await cancel_and_wait(task)


async def test_every_pointer_move_becomes_one_intent_even_when_writes_coalesce(log):
    w = Writer(log)
    moves = [await w.move(d) for d in ("a", "b", "a", "b", "a")]  # all stored before the projector reads one
    published: list[int] = []  # the revision of each intent the projector published, in order
    publish = log.publish_intent

    async def recording(fleet, data, *, expect):
        seq = await publish(fleet, data, expect=expect)
        published.append(intent_decoder.decode(data).revision)
        return seq

    log.publish_intent = recording
    projector = Projector(log)
    task = asyncio.create_task(projector.run())
    try:
        await wait_view_seq(log, moves[-1])
        await projector.wait_idle(5)
        # One intent per move, in order; before them, when a flush fell between the declarations and the
        # first move (the catch-up hands the handler what each socket read brought), the fleet's intent
        # before any route (revision 0), which is as true.
        assert [r for r in published if r] == moves and published[: len(published) - len(moves)] in ([], [0])
        assert await intents_published(log) == len(published)
        assert intent_decoder.decode((await log.last_intent(F))[0]).revision == moves[-1]
    finally:
        await cancel_and_wait(task)


async def test_two_racing_projectors_publish_each_move_once_and_agree_on_the_view(log, world):
    w = Writer(log)
    seen: list = []

    async def watch() -> None:
        async for _, body, _ in log.watch_intents(F):
            seen.append(intent_decoder.decode(body))

    watcher = asyncio.create_task(watch())
    first, second = Projector(await world.client("projector:1")), Projector(await world.client("projector:2"))
    tasks = [asyncio.create_task(first.run()), asyncio.create_task(second.run())]
    try:
        moves = []
        for d in ("a", "b", "a", "b"):
            moves.append(await w.move(d))
            await w.churn(3, domain=d)
        last = await log.last_seq()
        view = await wait_view_seq(log, last)
        await first.wait_idle(5)
        await second.wait_idle(5)
        assert view == (await expected_views(log))[F]
        await asyncio.sleep(0.1)  # the watcher hears the last publish
        # every move has its intent, and no intent was published twice (by the two of them, or one)
        assert [ri.revision for ri in seen if ri.revision in moves and ri.view_seq == ri.revision] == moves
        assert all(changed(a, b) for a, b in pairwise(seen)), [(ri.revision, ri.view_seq) for ri in seen]
        assert len(seen) == await intents_published(log)  # the stream holds each intent once
        # A projector that publishes the intent the other just stored (the same position and body: one
        # message, the log's dedupe) counts it too, so their counts add up to at least what is stored.
        assert first.stats.intents_published + second.stats.intents_published >= len(seen)
    finally:
        await cancel_and_wait(watcher, *tasks)


async def test_a_restarted_projector_resumes_after_its_stored_view(log):
    w = Writer(log)
    await w.move("a")
    await w.churn(6, domain="a")
    projector = Projector(log)
    task = asyncio.create_task(projector.run())
    folded = await log.last_seq()
    try:
        await wait_view_seq(log, folded)
        await projector.wait_idle(5)
    finally:
        await cancel_and_wait(task)
    r = await w.move("b")
    again = Projector(log)
    task = asyncio.create_task(again.run())
    try:
        assert (await wait_view_seq(log, r)).active == "b"
        assert again.stats.resumed_from == folded + 1
        assert again.stats.handled == r - folded  # nothing folded twice
    finally:
        await cancel_and_wait(task)


async def test_an_invalid_body_is_counted_skipped_and_projection_goes_on(log, world):
    w = Writer(log)
    await w.move("a")
    bad_subject = sj.model(F, "a", MODELS[0])
    bad1 = await world.append_raw(bad_subject, b'{"type": "model_loading", "at": "not a time"}')
    bad2 = await world.append_raw(sj.agent(F, "a"), b"\x00 not json at all")
    w.tips.pop(bad_subject, None)
    good = await w.put(bad_subject, ev.ModelLoading(at=now(), domain="a", model=MODELS[0]))
    projector = Projector(log)
    task = asyncio.create_task(projector.run())
    try:
        view = await wait_view_seq(log, good)
        assert view.anomalies == 2 and "skipped" in view.last_anomaly
        assert view.domains["a"].models[MODELS[0]].residency.seq == good
        assert projector.stats.invalid == 2
        r = await w.move("b")  # and it goes on following
        assert (await wait_view_seq(log, r)).active == "b"
    finally:
        await cancel_and_wait(task)
    if world.url is not None:  # `haru verify` (a child process, so on the server) flags both bodies
        out = await asyncio.to_thread(run_cli, "verify", "--json", url=world.url)
        assert out.returncode == 5, out.stderr
        flagged = {b["seq"]: b["what"] for b in json.loads(out.stdout)["breaks"]}
        assert "not a valid event" in flagged[bad1] and "not a valid event" in flagged[bad2]


async def test_an_idle_fleet_does_not_pin_the_resume_point(world):
    log = world.log
    await declare(log, "edge")  # declared, then quiet
    edge_last = await log.last_seq()
    await declare(log)
    w = Writer(log)
    await w.move("a")
    await w.churn(40)
    last = await log.last_seq()
    projector = Projector(log, checkpoint_lag=10)
    task = asyncio.create_task(projector.run())
    try:
        await wait_view_seq(log, last)
        await projector.wait_idle(5)
    finally:
        await cancel_and_wait(task)
    edge = await stored_view(log, "edge")
    assert edge.seq == edge_last and edge.checkpoint == last
    expected = (await expected_views(log))["edge"]
    assert edge == msgspec.structs.replace(expected, checkpoint=last)
    # A restart resumes after both fleets' positions, not after the quiet fleet's last event.
    again = Projector(log)
    assert await again.load() == last + 1
    assert again.views["edge"].seq == edge_last


# ------------------------------------------------------------------------------- child processes


def events_named(p: ProjectorProcess, name: str) -> list[dict]:
    return [line for line in p.lines() if line.get("event") == name]


async def wait_for_log(p: ProjectorProcess, name: str, timeout: float = 20.0) -> dict:
    found = await wait_until(
        lambda: events_named(p, name),
        timeout,
        interval_s=0.05,
        what=lambda: f"{name} in the projector's log:\n{p.log_path.read_text()[-3000:]}",
    )
    return found[-1]


@pytest.mark.timeout(90)
async def test_sigkilled_projector_resumes_from_its_stored_view(event_log, projector_processes):
    await declare(event_log)
    w = Writer(event_log)
    await w.move("a")
    await w.churn(60)
    first = projector_processes("first")
    last = await event_log.last_seq()
    before = await wait_view_seq(event_log, last)
    assert events_named(first, "projector.resume")[0]["from_seq"] == 1
    first.kill()  # SIGKILL: no final flush, no goodbye

    await w.churn(30)
    r2 = await w.move("b")
    await w.churn(12, domain="a")
    last = await event_log.last_seq()

    second = projector_processes("second")
    resume = await wait_for_log(second, "projector.resume")
    caught_up = await wait_for_log(second, "projector.caught_up")
    view = await wait_view_seq(event_log, last)
    assert view == (await expected_views(event_log))[F]
    assert view.active == "b" and view.route_revision == r2
    # It resumed where the stored view stopped, and folded only what came after.
    assert resume["from_seq"] == before.seq + 1 > 1
    assert caught_up["handled"] == last - before.seq
    ri = intent_decoder.decode((await event_log.last_intent(F))[0])
    assert ri.revision == r2
    assert second.stop() == 0
    stopped = events_named(second, "projector.stopped")
    assert stopped and stopped[-1]["last_seq"] == last


@pytest.mark.timeout(90)
async def test_two_projectors_racing_never_go_backwards(event_log, projector_processes):
    await declare(event_log)
    w = Writer(event_log)
    racers = [projector_processes("p1"), projector_processes("p2")]
    for p in racers:
        await wait_for_log(p, "projector.caught_up")

    views: list[tuple[int, int]] = []  # (kv revision, view seq)
    intents: list[tuple[int, int, int]] = []  # (stream seq, view_seq, revision)

    async def watch_views():
        async for _key, value, rev in event_log.watch_views(sj.view_key(F)):
            if value is not None:
                views.append((rev, view_decoder.decode(value).seq))

    async def watch_intents():
        async for _, body, seq in event_log.watch_intents(F):
            ri = intent_decoder.decode(body)
            intents.append((seq, ri.view_seq, ri.revision))

    watchers = [asyncio.create_task(watch_views()), asyncio.create_task(watch_intents())]
    try:
        moves = []
        for i in range(8):
            moves.append(await w.move("ab"[i % 2]))
            for _ in range(5):
                await w.churn(5, domain="ab"[(i + 1) % 2])
                await asyncio.sleep(0.005)
        last = await event_log.last_seq()
        view = await wait_view_seq(event_log, last)
        deadline = asyncio.get_running_loop().time() + 10
        while not intents or intents[-1][2] != moves[-1]:
            assert asyncio.get_running_loop().time() < deadline, intents[-5:]
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # let any late writer try (and fail) to go backwards
    finally:
        await cancel_and_wait(*watchers)

    assert view == (await expected_views(event_log))[F]
    assert len(views) > 1
    for (r0, s0), (r1, s1) in pairwise(views):
        assert r1 > r0 and s1 >= s0, f"view went backwards: {views}"
    for (q0, v0, rev0), (q1, v1, rev1) in pairwise(intents):
        assert q1 > q0 and v1 > v0 and rev1 >= rev0, f"intent went backwards: {intents}"
    # Every pointer move was published, once.
    revisions = [rev for _, _, rev in intents]
    deduped = [r for i, r in enumerate(revisions) if i == 0 or r != revisions[i - 1]]
    assert [r for r in deduped if r] == moves
    # Both raced: each wrote views or found the other's.
    for p in racers:
        p.stop()
        stats = events_named(p, "projector.stopped")[-1]
        assert stats["view_writes"] + stats["views_adopted"] + stats["view_conflicts"] > 0


# ------------------------------------------------------------------------------------ haru status


def run_cli(*args: str, url: str) -> subprocess.CompletedProcess:
    return subprocess.run([HARU, *args, "--nats-url", url], capture_output=True, text=True, timeout=30)


@pytest.mark.timeout(60)
async def test_haru_status_and_route_print_the_view_and_intent(nats_server, event_log):
    missing = await asyncio.to_thread(run_cli, "status", "--fleet", "nope", url=nats_server.url)
    assert missing.returncode == 3 and "haru projector" in missing.stderr
    await declare(event_log)
    w = Writer(event_log)
    r = await w.move("a")
    await w.put(sj.model(F, "a", MODELS[0]), ev.ModelResident(at=now(), domain="a", model=MODELS[0]))
    last = await w.put(sj.model(F, "a", MODELS[1]), ev.ModelLoading(at=now(), domain="a", model=MODELS[1]))
    projector = Projector(event_log)
    task = asyncio.create_task(projector.run())
    try:
        await wait_view_seq(event_log, last)
        await projector.wait_idle(5)
        out = await asyncio.to_thread(run_cli, "status", url=nats_server.url)
        assert out.returncode == 0, out.stderr
        assert f"route revision {r} → a" in out.stdout
        assert "GPU 0: 20.0 / 46.0 GiB held  (2 declared, 2 admitted)" in out.stdout
        assert f"    {MODELS[0]:<28} resident for " in out.stdout
        assert f"    {MODELS[1]:<28} loading for " in out.stdout
        js = await asyncio.to_thread(run_cli, "status", "--json", url=nats_server.url)
        assert view_decoder.decode(js.stdout.encode()) == await stored_view(event_log)
        route = await asyncio.to_thread(run_cli, "route", url=nats_server.url)
        assert route.returncode == 0, route.stderr
        assert route.stdout.startswith(f"fleet {F}  ·  route revision {r} → a")
        assert f"  {MODELS[0]:<28} ready" in route.stdout and "warming for" in route.stdout
        rj = await asyncio.to_thread(run_cli, "route", "--json", url=nats_server.url)
        ri = intent_decoder.decode(rj.stdout.encode())
        assert ri.revision == r and ri.answers[MODELS[1]].answer == "warming"
    finally:
        await cancel_and_wait(task)
    nothing = await asyncio.to_thread(run_cli, "route", "--fleet", "other", url=nats_server.url)
    assert nothing.returncode == 3 and "no route intent" in nothing.stderr


@pytest.mark.timeout(90)
async def test_projector_rides_out_a_nats_restart(nats_server, event_log):
    await declare(event_log)
    w = Writer(event_log)
    await w.move("a")
    projector = Projector(event_log)
    task = asyncio.create_task(projector.run())
    watcher = RouteWatcher([nats_server.url], F)
    try:
        await wait_view_seq(event_log, await event_log.last_seq())
        await watcher.__aenter__()
        await watcher.wait_for(lambda ri: ri.revision > 0, 10)
        await asyncio.to_thread(nats_server.stop_sync)
        await asyncio.sleep(0.5)
        await asyncio.to_thread(nats_server.start_sync)
        deadline = asyncio.get_running_loop().time() + 20
        while True:  # the client reconnects on its own
            try:
                r = await w.move("b")
                break
            except Exception:
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.2)
        view = await wait_view_seq(event_log, r, timeout=30)
        assert view.active == "b" and not task.done()
        intent_after = intent_decoder.decode((await event_log.last_intent(F))[0])
        assert intent_after.revision == r
        # A router's watcher notices its subscription stalled and follows again (nats-py alone
        # would take ~20 s of missed heartbeats).
        assert (await watcher.wait_for(lambda ri: ri.revision == r, 15)).active.domain == "b"
    finally:
        await watcher.__aexit__(None, None, None)
        await cancel_and_wait(task)
