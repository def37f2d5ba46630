"""RouteWatcher: the current intent, then every pointer move, in order, with no gap, across a
projector restart (the projector runs as a real child process and is SIGKILLed mid-way)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.intents import at
from haru.core.intents import intent as compute_intent
from haru.core.sizes import GiB
from haru.core.specs import DomainSpec, GpuSpec, ModelSpec, Policy
from haru.core.views import view_encoder
from haru.host.tasks import cancel_and_wait
from haru.log.route import RouteWatcher
from tests.support.clock import now
from tests.support.wait import wait_until

F = "default"
M = "qwen3.6:27b"
HARU = str(Path(sys.executable).parent / "haru")


async def declare(log) -> dict[str, int]:
    tips: dict[str, int] = {}
    s = sj.decl(F)
    seq = await log.append(s, ev.FleetDeclared(at=now(), fleet=F, policy=Policy()), expect=0)
    for d in ("a", "b"):
        spec = DomainSpec(name=d, serving_url=f"http://{d}:9000", gpus=[GpuSpec(index=0, memory_bytes=48 * GiB)])
        seq = await log.append(s, ev.DomainDeclared(at=now(), spec=spec), expect=seq)
        seq = await log.append(
            s,
            ev.ModelDeclared(at=now(), domain=d, spec=ModelSpec(name=M, slot="m", gpu_index=0, vram_bytes=GiB)),
            expect=seq,
        )
        seq = await log.append(
            s, ev.AdmissionDecided(at=now(), domain=d, name=M, gpu_index=0, admitted=True, vram_bytes=GiB), expect=seq
        )
    tips[s] = seq
    return tips


@pytest.fixture
def start_projector(nats_server, tmp_path):
    procs: list[subprocess.Popen] = []

    def start(name: str) -> tuple[subprocess.Popen, Path]:
        path = tmp_path / f"{name}.log"
        with open(path, "ab") as err:
            proc = subprocess.Popen(
                [HARU, "projector", "--nats-url", nats_server.url, "--log-format", "json"],
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=dict(os.environ),
            )
        procs.append(proc)
        return proc, path

    try:
        yield start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


def logged(path: Path, name: str) -> bool:
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("event") == name:
                return True
        except ValueError:
            pass
    return False


async def wait_logged(path: Path, name: str, timeout: float = 20.0) -> None:
    await wait_until(
        lambda: logged(path, name), timeout, interval_s=0.05, what=lambda: f"{name} in {path.read_text()[-2000:]}"
    )


@pytest.mark.timeout(150)
async def test_watcher_sees_every_pointer_move_in_order_across_a_projector_restart(event_log, start_projector):
    tips = await declare(event_log)
    proc, log_path = start_projector("first")
    await wait_logged(log_path, "projector.caught_up")

    route = sj.route(F)
    moves: list[int] = []

    async def move(active: str) -> None:
        seq = await event_log.append(route, ev.RouteMoved(at=now(), active=active), expect=tips.get(route, 0))
        tips[route] = seq
        moves.append(seq)

    seen: list[int] = []
    async with RouteWatcher(event_log, F) as w:
        # The projector published the never-routed intent for the declared fleet.
        await w.wait_for(lambda ri: ri.view_seq >= tips[sj.decl(F)], 30)  # 10 s was short on a loaded CI
        assert w.current.revision == 0 and w.current.active is None

        async def collect():
            async for ri in w:
                seen.append(ri.revision)

        collector = asyncio.create_task(collect())
        try:
            for i in range(6):
                await move("ab"[i % 2])
            await w.wait_for(lambda ri: ri.revision == moves[-1], 30)
            proc.kill()  # SIGKILL the projector mid-history
            proc.wait(10)
            for i in range(4):  # the pointer moves while no projector runs
                await move("ab"[i % 2])
            await asyncio.sleep(0.2)
            assert w.current.revision == moves[5]  # nobody published: the watcher still says so
            _, log2 = start_projector("second")
            await w.wait_for(lambda ri: ri.revision == moves[-1], 30)
            await wait_logged(log2, "projector.caught_up")
            for i in range(5):
                await move("ba"[i % 2])
            final = await w.wait_for(lambda ri: ri.revision == moves[-1], 30)
        finally:
            await cancel_and_wait(collector)
    assert final.active.domain == ("b", "a")[4 % 2]
    deduped = [r for i, r in enumerate(seen) if i == 0 or r != seen[i - 1]]
    assert [r for r in deduped if r] == moves, f"seen {seen}, moves {moves}"


async def test_watcher_starts_with_the_current_intent_and_can_connect_itself(nats_server, event_log):
    assert (await event_log.last_intent(F)) is None
    async with RouteWatcher([nats_server.url], F) as w:
        assert w.current is None
        from haru.core.views import FleetView

        first = compute_intent(FleetView(fleet=F, seq=3))
        await event_log.publish_intent(F, view_encoder.encode(first), expect=0)
        got = await asyncio.wait_for(w.__anext__(), 5)
        assert got == first and w.current == first
    # A second watcher starts from the last one published.
    second = compute_intent(FleetView(fleet=F, seq=9, active="", route_revision=0))
    seq = await event_log.publish_intent(F, view_encoder.encode(second), expect=1)
    async with RouteWatcher([nats_server.url], F) as w:
        assert w.current == second and w.seq == seq
        assert await asyncio.wait_for(w.__anext__(), 5) == second
        assert at(w.current, now()) == second


@pytest.mark.timeout(60)
async def test_haru_route_watch_prints_every_move(nats_server, event_log, start_projector):
    tips = await declare(event_log)
    _, log_path = start_projector("p")
    await wait_logged(log_path, "projector.caught_up")
    watch = await asyncio.create_subprocess_exec(
        HARU,
        "route",
        "--watch",
        "--json",
        "--nats-url",
        nats_server.url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        from haru.core.views import intent_decoder

        first = intent_decoder.decode(await asyncio.wait_for(watch.stdout.readline(), 20))
        assert first.revision == 0
        moves = []
        route = sj.route(F)
        for active in ("a", "b", "a"):
            seq = await event_log.append(route, ev.RouteMoved(at=now(), active=active), expect=tips.get(route, 0))
            tips[route] = seq
            moves.append(seq)
        got = []
        while not got or got[-1] != moves[-1]:
            ri = intent_decoder.decode(await asyncio.wait_for(watch.stdout.readline(), 20))
            got.append(ri.revision)
        assert [r for i, r in enumerate(got) if i == 0 or r != got[i - 1]] == moves
        # Ctrl-C is a clean exit: the watch's own close is not the control plane going away.
        watch.send_signal(signal.SIGINT)
        err = (await asyncio.wait_for(watch.stderr.read(), 20)).decode()
        assert await asyncio.wait_for(watch.wait(), 20) == 130
        assert "unreachable" not in err, err
    finally:
        if watch.returncode is None:
            watch.terminate()
            await watch.wait()
