"""Projector benchmark, one run, figures measured side by side.

1. Rebuild: fold 100k events into fleet views (and write them to KV, with intents) with
   `haru.projector.Projector`, against a raw nats-py ordered-consumer drain of the same stream (nats-py's fastest
   ordinary way to read it, doing nothing with the messages). Ratio = raw time / rebuild time (goal >= 0.8x, issue 30;
   with the follower's catch-up, which reads what the stream holds through a pull consumer handled from nats-py's read
   loop, 0.76-0.92x, median 0.86x, five runs of six at or above the goal; docs/performance.md, "The follower's
   catch-up"). Also printed, to show where the time goes: `EventLog.replay` (not following: the ordered consumer) with a
   no-op handler and with the fold, and a following replay (what the projector's follower runs: the catch-up, then the
   ordered consumer) with a no-op handler and with the fold.
2. Route-intent propagation: from the ack of a `route_moved` append to a RouteWatcher receiving
   the intent with that revision, with `haru projector` running as a child process on an idle
   machine (p50 and p99; target p99 <= 10 ms).

    .venv/bin/python bench/projector.py [--events 100000] [--moves 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from nats.js import api

from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.fold import add_one
from haru.core.sizes import GiB
from haru.core.specs import DomainSpec, GpuSpec, ModelSpec, Policy
from haru.host.natsd import NatsServer
from haru.log.eventlog import EventLog
from haru.log.nats_headers import enable_fast_header_parse
from haru.log.route import RouteWatcher
from haru.projections.projector import Projector

if os.environ.get("HARU_BENCH_HEADERS") != "nats-py":  # HARU_BENCH_HEADERS=nats-py: nats-py's own parse
    enable_fast_header_parse()  # as the services that replay the log do at start-up (the figures in docs/ are with it)

FLEETS = ("default", "edge", "lab", "eu")
DOMAINS = ("a", "b")
MODELS = tuple(f"model-{i}:{7 + i}b" for i in range(8))
T0 = datetime(2026, 11, 29, tzinfo=UTC)


def history(n: int) -> list[tuple[str, bytes]]:
    """n event bodies: declarations of 4 fleets, then residency/GPU/agent churn and route moves."""
    out: list[tuple[str, bytes]] = []
    t = [0.0]

    def at() -> datetime:
        t[0] += 0.01
        return T0 + timedelta(seconds=t[0])

    for f in FLEETS:
        out.append((sj.decl(f), ev.encode(ev.FleetDeclared(at=at(), fleet=f, policy=Policy()))))
        for d in DOMAINS:
            spec = DomainSpec(
                name=d,
                serving_url=f"http://{d}:9000",
                gpus=[GpuSpec(index=0, memory_bytes=80 * GiB, reserve_bytes=2 * GiB)],
            )
            out.append((sj.decl(f), ev.encode(ev.DomainDeclared(at=at(), spec=spec))))
            for i, m in enumerate(MODELS):
                ms = ModelSpec(name=m, slot=f"s{i}", gpu_index=0, vram_bytes=8 * GiB, port=8000 + i)
                out.append((sj.decl(f), ev.encode(ev.ModelDeclared(at=at(), domain=d, spec=ms))))
                out.append(
                    (
                        sj.decl(f),
                        ev.encode(
                            ev.AdmissionDecided(
                                at=at(), domain=d, name=m, gpu_index=0, admitted=True, vram_bytes=8 * GiB
                            )
                        ),
                    )
                )
        out.append((sj.route(f), ev.encode(ev.RouteMoved(at=at(), active="a"))))
    cycle = ("loading", "resident", "sleeping", "waking", "resident", "lost")
    i = 0
    while len(out) < n:
        f = FLEETS[i % len(FLEETS)]
        d = DOMAINS[(i // len(FLEETS)) % 2]
        m = MODELS[(i // 8) % len(MODELS)]
        k = i // 64
        step = cycle[k % len(cycle)]
        if i % 97 == 0:
            e: ev.Event = ev.GpuObserved(
                at=at(), domain=d, index=0, present=True, memory_total_bytes=80 * GiB, memory_used_bytes=(i % 80) * GiB
            )
            s = sj.gpu(f, d, 0)
        elif i % 997 == 0:
            e = ev.RouteMoved(at=at(), active=DOMAINS[(i // 997) % 2])
            s = sj.route(f)
        else:
            s = sj.model(f, d, m)
            e = {
                "loading": lambda d, m: ev.ModelLoading(at=at(), domain=d, model=m),
                "resident": lambda d, m: ev.ModelResident(at=at(), domain=d, model=m, warmup_ms=100),
                "sleeping": lambda d, m: ev.ModelSleeping(at=at(), domain=d, model=m),
                "waking": lambda d, m: ev.ModelWaking(at=at(), domain=d, model=m),
                "lost": lambda d, m: ev.ModelLost(at=at(), domain=d, model=m, reason="unhealthy"),
            }[step](d, m)
        out.append((s, ev.encode(e)))
        i += 1
    return out


async def load(log: EventLog, bodies: list[tuple[str, bytes]]) -> int:
    """Bulk-publish the bodies (no per-subject checks: this is a fixture, not an append path)."""
    batch = 5000
    for i in range(0, len(bodies), batch):
        for s, b in bodies[i : i + batch]:
            await log.js.publish_async(s, b)
        await asyncio.wait_for(log.js.publish_async_completed(), 60)
    return await log.last_seq()


async def raw_drain(log: EventLog, last: int) -> float:
    done = asyncio.get_running_loop().create_future()
    count = 0

    async def cb(msg):
        nonlocal count
        count += 1
        if count >= last and not done.done():
            done.set_result(None)

    t0 = time.perf_counter()
    sub = await log.js.subscribe(
        sj.ALL_EVENTS,
        cb=cb,
        stream=sj.EVENTS_STREAM,
        ordered_consumer=True,
        deliver_policy=api.DeliverPolicy.ALL,
        pending_msgs_limit=-1,
        pending_bytes_limit=-1,
    )
    await done
    dt = time.perf_counter() - t0
    await sub.unsubscribe()
    return dt


async def replay_noop(log: EventLog) -> float:
    t0 = time.perf_counter()
    await log.replay(lambda rec: None)
    return time.perf_counter() - t0


async def replay_fold(log: EventLog) -> float:
    """The replay with the projector's fold (its `Folder`s), the views materialized at the end."""
    folders: dict = {}

    def handler(rec):
        add_one(folders, rec.event, seq=rec.seq, subject=rec.subject, error=rec.error)

    t0 = time.perf_counter()
    await log.replay(handler)
    views = {f: folder.view() for f, folder in folders.items()}
    dt = time.perf_counter() - t0
    assert len(views) == len(FLEETS)
    return dt


async def follow_until(log: EventLog, last: int, handler) -> float:
    """A following replay (what a follower runs: the catch-up reader, then the ordered consumer) until
    the handler has seen `last`."""
    done = asyncio.get_running_loop().create_future()

    def on(rec):
        handler(rec)
        if rec.seq >= last and not done.done():
            done.set_result(None)

    t0 = time.perf_counter()
    task = asyncio.create_task(log.replay(on, follow=True))
    try:
        await asyncio.wait_for(asyncio.shield(done), 120)
        dt = time.perf_counter() - t0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return dt


async def follow_noop(log: EventLog, last: int) -> float:
    return await follow_until(log, last, lambda rec: None)


async def follow_fold(log: EventLog, last: int) -> float:
    folders: dict = {}
    dt = await follow_until(
        log, last, lambda rec: add_one(folders, rec.event, seq=rec.seq, subject=rec.subject, error=rec.error)
    )
    assert len(folders) == len(FLEETS)
    return dt


async def rebuild(log: EventLog, last: int) -> tuple[float, Projector]:
    projector = Projector(log)
    t0 = time.perf_counter()
    task = asyncio.create_task(projector.run())
    try:
        while projector.stats.last_seq < last:
            await asyncio.sleep(0.001)
        await projector.wait_idle(60)
        dt = time.perf_counter() - t0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    for f in FLEETS:
        got = await log.get_view(sj.view_key(f))
        assert got is not None, f"no view for {f}"
    return dt, projector


async def propagation(url: str, log: EventLog, moves: int, store: Path) -> list[float]:
    haru = str(Path(sys.executable).parent / "haru")
    err = open(store / "projector.log", "wb")
    proc = subprocess.Popen(
        [haru, "projector", "--nats-url", url, "--log-format", "json"], stdout=subprocess.DEVNULL, stderr=err
    )
    try:
        fleet = "default"
        route = sj.route(fleet)
        latencies: list[float] = []
        async with RouteWatcher(log, fleet) as w:
            expect = await log.last_seq_of(route)
            # Wait until the projector is live (it publishes the current intent).
            await w.wait_for(lambda ri: ri.revision == expect, 60)
            for i in range(moves):
                active = DOMAINS[i % 2]
                seq = await log.append(route, ev.RouteMoved(at=datetime.now(UTC), active=active), expect=expect)
                t0 = time.perf_counter()
                await w.wait_for(lambda ri, seq=seq: ri.revision >= seq, 10)
                latencies.append((time.perf_counter() - t0) * 1000)
                expect = seq
                await asyncio.sleep(0.02)  # idle between moves
        return latencies
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        err.close()


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def rebuild_round(store: Path, bodies: list[tuple[str, bytes]]) -> tuple[int, dict[str, float], Projector]:
    """One round on a fresh server: load, then each reader over the same stream."""
    async with NatsServer(store) as server:
        async with EventLog.connect([server.url], writer="bench") as log:
            await log.ensure()
            last = await load(log, bodies)
            times = {
                "raw": await raw_drain(log, last),
                "noop": await replay_noop(log),
                "fold": await replay_fold(log),
                "follow": await follow_noop(log, last),
                "follow+fold": await follow_fold(log, last),
            }
            times["rebuild"], projector = await rebuild(log, last)
            # A second raw drain after, so a drifting machine load shows up in the baseline too.
            times["raw"] = min(times["raw"], await raw_drain(log, last))
    return last, times, projector


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--moves", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3, help="fresh-server rounds of the rebuild (best of)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp)
        bodies = history(args.events)
        best: dict[str, float] = {}
        for r in range(args.rounds):
            last, times, projector = await rebuild_round(store / f"round{r}", bodies)
            for k, v in times.items():
                best[k] = min(best.get(k, v), v)
            print(f"round {r + 1}: " + "  ".join(f"{k} {v:.2f}s" for k, v in times.items()))
        raw, noop, folded, built = best["raw"], best["noop"], best["fold"], best["rebuild"]
        s = projector.stats
        print()
        print(f"rebuild of {last} events ({len(FLEETS)} fleets), best of {args.rounds} fresh-server rounds")
        print(f"  raw ordered-consumer drain    {raw:5.2f}s  {last / raw:9,.0f} ev/s   1.00x (baseline)")
        print(f"  EventLog.replay, no-op        {noop:5.2f}s  {last / noop:9,.0f} ev/s   {raw / noop:.2f}x")
        print(f"  EventLog.replay + fold        {folded:5.2f}s  {last / folded:9,.0f} ev/s   {raw / folded:.2f}x")
        print(
            f"  follow (catch-up), no-op      {best['follow']:5.2f}s  "
            f"{last / best['follow']:9,.0f} ev/s   {raw / best['follow']:.2f}x"
        )
        print(
            f"  follow (catch-up) + fold      {best['follow+fold']:5.2f}s  "
            f"{last / best['follow+fold']:9,.0f} ev/s   {raw / best['follow+fold']:.2f}x"
        )
        print(
            f"  projector rebuild (KV+route)  {built:5.2f}s  "
            f"{last / built:9,.0f} ev/s   {raw / built:.2f}x   (goal >= 0.8x)"
        )
        print(
            f"    last round: view writes {s.view_writes}, intents published {s.intents_published}, flushes {s.flushes}"
        )

        async with NatsServer(store / "propagation") as server:
            async with EventLog.connect([server.url], writer="bench") as log:
                await log.ensure()
                await load(log, bodies[: 4 * (1 + 2 + 2 * 2 * len(MODELS)) + 8])
                lat = await propagation(server.url, log, args.moves, store)
        print()
        print(f"route-intent propagation, route_moved ack -> RouteWatcher, {len(lat)} moves, idle")
        print(
            f"  p50 {statistics.median(lat):.2f} ms   p90 {pct(lat, 90):.2f} ms   p99 {pct(lat, 99):.2f} ms   "
            f"max {max(lat):.2f} ms   (target p99 <= 10 ms)"
        )


if __name__ == "__main__":
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if os.environ.get("HARU_NO_UVLOOP") != "1":
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
    asyncio.run(main())
