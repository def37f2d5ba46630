"""Routers through a failover: Haru's gateway against HAProxy and nginx driven by `haru route follow`.

    .venv/bin/python bench/routers.py [--runs 1] [--clients 4] [--steady 3] [--only haproxy,nginx]

Each row is a fresh world: a real nats-server, the projector, a promoter and Haru's gateway in this process,
two real agents (subprocesses) on the simulator (tests/support/sim_fleet.py), and, for the HAProxy and nginx
rows, the router (Debian's package, a child process) with a route follower (haru.routers.Follower) in this
process. `--clients` clients send non-streaming chat requests in a loop through the router under test;
the simulator's reply names the domain that answered. After `--steady` seconds of steady traffic the
scenario runs:

- planned: a promotion of b requested (`haru promote b`): the old active a is put to sleep after the flip,
  once the routers acknowledged it (policy router_ack_timeout_ms; the "no ack" rows set it to 0, so a
  sleeps as soon as the flip is appended, which is what happened before routers acknowledged);
- detach: a's GPU detached (`haru sim detach-gpu a`): an unplanned failover.

Printed per row: flip -> serving, from the flip's append (its `at`) to the first answer from b; the
failed requests (not 200) from the scenario's start to 2 s after that; p99 of the requests sent in that
window against the steady p99 (and the ratio). The nginx rows turn client keep-alive off (a graceful
reload closes idle keep-alive connections, and a client sending on one at that instant sees it closed);
the "keep-alive" row leaves it on to show that cost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp

from haru.core import subjects
from haru.core.events import RouteMoved
from haru.host.natsd import NatsServer
from haru.host.tasks import cancel_and_wait
from haru.log.eventlog import EventLog
from haru.log.requests import request_operation
from haru.routers import Follower
from tests.support.failover_sim import sim
from tests.support.region_fleet import p99
from tests.support.routers import haproxy, nginx
from tests.support.sim_fleet import FLEET, sim_fleet, sim_layout, steady

ROWS = {
    # name: (router, scenario, ack, nginx client keep-alive)
    "gateway planned": ("gateway", "planned", True, "0"),
    "haproxy planned": ("haproxy", "planned", True, "0"),
    "haproxy planned, no ack": ("haproxy", "planned", False, "0"),
    "nginx planned": ("nginx", "planned", True, "0"),
    "nginx planned, no ack": ("nginx", "planned", False, "0"),
    "nginx planned, keep-alive": ("nginx", "planned", True, "75s"),
    "gateway detach": ("gateway", "detach", True, "0"),
    "haproxy detach": ("haproxy", "detach", True, "0"),
    "nginx detach": ("nginx", "detach", True, "0"),
}


class Load:
    """Clients in a loop; each request recorded as (sent, done, ok, domain) on the wall clock."""

    def __init__(self, url: str, clients: int) -> None:
        self.url, self.clients = url, clients
        self.done: list[tuple[float, float, bool, str]] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _client(self, i: int) -> None:
        n = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            while not self._stop.is_set():
                n += 1
                body = {"model": ("m1", "m2")[n % 2], "messages": [{"role": "user", "content": f"hi {i} {n}"}]}
                sent = time.time()
                ok, domain = False, ""
                try:
                    async with s.post(self.url + "/v1/chat/completions", json=body) as r:
                        raw = await r.read()
                        ok = r.status == 200
                        if ok and b"[domain " in raw:
                            domain = raw.split(b"[domain ", 1)[1].split(b"]", 1)[0].decode()
                except (TimeoutError, aiohttp.ClientError):
                    pass
                self.done.append((sent, time.time(), ok, domain))
                if not ok:
                    await asyncio.sleep(0.01)  # a router refusing at once must not spin

    async def __aenter__(self) -> Load:
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        await asyncio.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


@contextlib.asynccontextmanager
async def front(router: str, tmp: Path, log, gateway_url: str, keepalive: str):
    """The URL clients use: the gateway's, or a router's with its follower running."""
    if router == "gateway":
        yield gateway_url, None
        return
    start = haproxy(tmp) if router == "haproxy" else nginx(tmp, keepalive=keepalive)
    async with start as proc:
        f = Follower(log, FLEET, "bench", proc.target(), interval_s=0.25, backoff_s=0.1)
        task = asyncio.create_task(f.run())
        try:
            yield proc.url, f
        finally:
            await cancel_and_wait(task)


async def one(name: str, root: Path, clients: int, steady_s: float) -> dict:
    router, scenario, ack, keepalive = ROWS[name]
    root.mkdir(parents=True, exist_ok=True)
    layout = sim_layout(root / "layout.json", root)
    if not ack:
        doc = json.loads(layout.read_text())
        doc["policy"]["router_ack_timeout_ms"] = 0
        layout.write_text(json.dumps(doc))
    server = NatsServer(root / "nats")
    await server.start()
    try:
        async with EventLog.connect([server.url], writer="bench") as log:
            await log.ensure()
            async with sim_fleet(root, server, log, layout) as fleet:
                await wait_for(lambda: _steady(log), 90, "a active, b a standby")
                async with front(router, root, log, fleet.gw.url, keepalive) as (url, follower):
                    if follower is not None:
                        await wait_for(lambda: follower.applied is not None, 10, "the router following")
                    async with Load(url, clients) as load:
                        await asyncio.sleep(steady_s)
                        t0 = time.time()
                        if scenario == "planned":
                            await request_operation(log, FLEET, "promotion", "b", by="bench", now=datetime.now(UTC))
                        else:
                            await asyncio.to_thread(sim, root, "detach-gpu", "a")
                        flip = await wait_for(lambda: _flip(log), 60, "the flip")
                        flip_at = flip.event.at.timestamp()
                        first_b = await wait_for(
                            lambda: next((d for s, d, ok, dom in load.done if ok and dom == "b" and d >= flip_at), 0),
                            30,
                            "an answer from b",
                        )
                        await asyncio.sleep(2.0)
                        t1 = first_b + 2.0
    finally:
        await server.stop()
    steady_lat = [d - s for s, d, ok, _ in load.done if ok and s < t0]
    window = [(s, d, ok) for s, d, ok, _ in load.done if t0 <= s <= t1]
    failed = sum(1 for _, _, ok in window if not ok)
    lat = [d - s for s, d, ok in window]
    return {
        "row": name,
        "flip_to_serving_ms": (first_b - flip_at) * 1000,
        "detect_to_flip_ms": (flip_at - t0) * 1000,
        "failed": failed,
        "requests": len(window),
        "p99_steady_ms": p99(steady_lat) * 1000,
        "p99_ms": p99(lat) * 1000,
    }


async def _steady(log) -> bool:
    from haru.core.views import view_decoder

    got = await log.get_view(subjects.view_key(FLEET))
    return got is not None and steady(view_decoder.decode(got[0]))


async def _flip(log):
    for rec in reversed(await log.history(subjects.route(FLEET))):
        if isinstance(rec.event, RouteMoved) and rec.event.active == "b":
            return rec
    return None


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--steady", type=float, default=3.0)
    ap.add_argument("--only", default="", help="comma-separated words a row's name must contain one of")
    args = ap.parse_args()
    words = [w for w in args.only.split(",") if w]
    rows = [r for r in ROWS if not words or any(w in r for w in words)]
    results: dict[str, list[dict]] = {r: [] for r in rows}
    with tempfile.TemporaryDirectory(prefix="haru-bench-routers-") as tmp:
        for run in range(args.runs):
            for i, name in enumerate(rows):
                got = await one(name, Path(tmp) / f"{run}-{i}", args.clients, args.steady)
                results[name].append(got)
                print(
                    f"  {name:28s} flip->serving {got['flip_to_serving_ms']:7.0f} ms  failed {got['failed']:4d}"
                    f"/{got['requests']:<5d} p99 {got['p99_ms']:7.1f} ms (steady {got['p99_steady_ms']:.1f} ms)",
                    flush=True,
                )
    base = {
        s: statistics.median(r["flip_to_serving_ms"] for r in results[f"gateway {s}"])
        for s in ("planned", "detach")
        if f"gateway {s}" in results
    }
    print(f"\nmedians of {args.runs} run(s), {args.clients} clients:")
    print(f"{'row':28s} {'flip->serving':>14s} {'vs gateway':>10s} {'failed':>8s} {'p99':>9s} {'p99/steady':>10s}")
    for name, rs in results.items():
        fs = statistics.median(r["flip_to_serving_ms"] for r in rs)
        failed = statistics.median(r["failed"] for r in rs)
        p = statistics.median(r["p99_ms"] for r in rs)
        ps = statistics.median(r["p99_steady_ms"] for r in rs)
        scenario = ROWS[name][1]
        vs = f"{fs / base[scenario]:.2f}x" if scenario in base and base[scenario] > 0 else "-"
        print(f"{name:28s} {fs:11.0f} ms {vs:>10s} {failed:8.0f} {p:7.1f} ms {p / ps if ps else 0:9.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
