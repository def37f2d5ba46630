"""Projector benchmark: how soon each restarted reader is back with fresh views, one run, side by side.

1. Restart to fresh views, at each history length of `--events` (default 10k and 1M events, loaded with
   `publish_async` in batches). The projector first folds the whole log (its first start: nothing in KV
   yet; printed as "first start"), then stops; `--tail` more events are appended while it is down. Then,
   one after the other on the same log:
   - the projector restarts: until every fleet's view in KV covers the log's last event;
   - a gateway's route follower (gateway/state.py) starts: until its routing table holds every fleet's
     stored view and intent, and the last route move;
   - a promoter starts: until it has folded everything stored when it started (`ready`).
   The baseline, measured in the same run on the same log: one KV read of every fleet's view plus one
   read of the events appended while the projector was down (what a resume cannot avoid). Each start is
   printed as a ratio to it, and the projector's first start (a full fold) also as a multiple of its
   restart. Goal: every reader has fresh views within 1 s of starting, at 1M events.
2. Route-intent propagation: from the ack of a `route_moved` append to a RouteWatcher receiving
   the intent with that revision, with `haru projector` running as a child process on an idle
   machine (p50 and p99; target p99 <= 10 ms).

    .venv/bin/python bench/projector.py [--events 10000,1000000] [--tail 1000] [--moves 200]
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

from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.sizes import GiB
from haru.core.specs import DomainSpec, GpuSpec, ModelSpec, Policy
from haru.core.views import view_decoder
from haru.gateway.metrics import GatewayMetrics
from haru.gateway.routing import RoutingTable
from haru.gateway.state import RouteFollower
from haru.host.natsd import NatsServer
from haru.log.eventlog import EventLog
from haru.log.route import RouteWatcher
from haru.projections.projector import Projector
from haru.promoter.service import Promoter

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
                "loading": lambda d=d, m=m: ev.ModelLoading(at=at(), domain=d, model=m),
                "resident": lambda d=d, m=m: ev.ModelResident(at=at(), domain=d, model=m, warmup_ms=100),
                "sleeping": lambda d=d, m=m: ev.ModelSleeping(at=at(), domain=d, model=m),
                "waking": lambda d=d, m=m: ev.ModelWaking(at=at(), domain=d, model=m),
                "lost": lambda d=d, m=m: ev.ModelLost(at=at(), domain=d, model=m, reason="unhealthy"),
            }[step]()
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


async def fleet_heads(log: EventLog) -> dict[str, int]:
    """Each fleet's last event in the log: a view is fresh when it has folded it."""
    return {f: await log.last_seq_matching(sj.fleet_events(f)) for f in FLEETS}


async def stored_seqs(log: EventLog) -> dict[str, int]:
    """The last event each fleet's view in KV has folded (0: none stored)."""
    out = {}
    for f in FLEETS:
        got = await log.get_view(sj.view_key(f))
        out[f] = 0 if got is None else view_decoder.decode(got[0]).seq
    return out


async def projector_start(log: EventLog, last: int, limit: float) -> tuple[float, Projector]:
    """Start a projector; the seconds until every fleet's view in KV has folded that fleet's last event
    and nothing folded is left unwritten. The projector is stopped before returning."""
    heads = await fleet_heads(log)
    projector = Projector(log)
    t0 = time.perf_counter()
    task = asyncio.create_task(projector.run())
    try:
        async with asyncio.timeout(limit):
            while True:
                if task.done():
                    task.result()
                if projector.stats.last_seq >= last:
                    await projector.wait_idle()
                    stored = await stored_seqs(log)
                    if all(stored[f] >= heads[f] for f in FLEETS):
                        break
                await asyncio.sleep(0.001)
        dt = time.perf_counter() - t0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return dt, projector


async def baseline(log: EventLog, from_seq: int, last: int) -> float:
    """One KV read of every fleet's view, then one read of the events from `from_seq` to `last`."""
    t0 = time.perf_counter()
    for f in FLEETS:
        assert await log.get_view(sj.view_key(f)) is not None
    seen = [0]

    def on(rec) -> None:
        seen[0] += 1

    await log.replay(on, from_seq=from_seq)
    dt = time.perf_counter() - t0
    assert seen[0] >= last - from_seq + 1, (seen[0], from_seq, last)
    return dt


async def gateway_start(log: EventLog, last_route: int, limit: float) -> float:
    """A gateway's route follower from nothing: until its table holds every fleet's stored view and an
    intent, and it has handled the last route move."""
    want = {}
    for f in FLEETS:
        got = await log.get_view(sj.view_key(f))
        assert got is not None
        want[f] = view_decoder.decode(got[0]).seq
    table = RoutingTable()
    t0 = time.perf_counter()
    async with RouteFollower(log, table, GatewayMetrics()) as follower:
        async with asyncio.timeout(limit):
            while True:
                fresh = all(
                    (r := table.get(f)) is not None and r.view is not None and r.view.seq >= want[f] and r.intent
                    for f in FLEETS
                )
                if fresh and follower.route_position >= last_route:
                    break
                await asyncio.sleep(0.001)
        return time.perf_counter() - t0


async def promoter_start(log: EventLog, limit: float) -> float:
    """A promoter from nothing: until it has folded everything stored when it started (`ready`)."""
    promoter = Promoter(log, identity="promoter:bench")
    ready = asyncio.Event()
    t0 = time.perf_counter()
    task = asyncio.create_task(promoter.run(ready))
    waiting = asyncio.create_task(ready.wait())
    try:
        async with asyncio.timeout(limit):
            await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        return time.perf_counter() - t0
    finally:
        task.cancel()
        waiting.cancel()
        await asyncio.gather(task, waiting, return_exceptions=True)


async def restart_round(store: Path, n: int, tail: int, limit: float) -> dict[str, float]:
    """One history length on a fresh server (the module docstring, 1)."""
    bodies = history(n + tail)
    async with NatsServer(store) as server:
        async with EventLog.connect([server.url], writer="bench") as log:
            await log.ensure()
            t0 = time.perf_counter()
            stored = await load(log, bodies[:n])
            times = {"load": time.perf_counter() - t0}
            times["first start"], _ = await projector_start(log, stored, limit)
            last = await load(log, bodies[n:])  # appended while the projector is down
            last_route = await log.last_seq_matching(f"{sj.EVT}.*.route")
            times["baseline"] = await baseline(log, stored + 1, last)
            times["projector"], projector = await projector_start(log, last, limit)
            times["resumed from"] = projector.stats.resumed_from
            times["gateway"] = await gateway_start(log, last_route, limit)
            times["promoter"] = await promoter_start(log, limit)
            times["events"] = last
    return times


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


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", default="10000,1000000", help="history lengths, comma-separated")
    ap.add_argument("--tail", type=int, default=1000, help="events appended while the projector is down")
    ap.add_argument("--moves", type=int, default=200, help="route moves for the propagation (0: skip it)")
    ap.add_argument("--limit", type=float, default=600.0, help="seconds allowed for one start")
    args = ap.parse_args()
    lengths = [int(x) for x in args.events.split(",") if x.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp)
        print(f"restart to fresh views, {len(FLEETS)} fleets, {args.tail} events appended while the projector is down")
        print("  baseline: one KV read of every view + one read of those events; ratio = start / baseline")
        for n in lengths:
            t = await restart_round(store / f"n{n}", n, args.tail, args.limit)
            base = t["baseline"]
            print(f"\n{int(t['events']):,} events (loaded in {t['load']:.1f} s)")
            print(f"  baseline (KV reads + tail read)    {base * 1000:8.1f} ms   1.00x")
            for k in ("projector", "gateway", "promoter"):
                extra = f"   (resumed from seq {int(t['resumed from']):,})" if k == "projector" else ""
                print(f"  {k + ' start':<34} {t[k] * 1000:8.1f} ms   {t[k] / base:5.2f}x{extra}")
            first = t["first start"]
            print(
                f"  projector first start (full fold)  {first * 1000:8.1f} ms   {first / base:5.2f}x"
                f"   ({first / t['projector']:.0f}x its restart)"
            )
        if args.moves:
            async with NatsServer(store / "propagation") as server:
                async with EventLog.connect([server.url], writer="bench") as log:
                    await log.ensure()
                    await load(log, history(4 * (1 + 2 + 2 * 2 * len(MODELS)) + 8))
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
