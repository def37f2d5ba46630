"""How the control plane's costs grow with fleets: 1, 10, 50, 100 fleets in one run, each figure against N = 1.

    .venv/bin/python bench/scale.py [--levels 1,10,50,100] [--window-s 60] [--quick] [--no-takeover]
    .venv/bin/python bench/scale.py --durability --levels 100 --window-s 30   (always vs the default)

One real nats-server; `haru projector`, `haru promoter` and `haru gateway` as child processes (what is
measured is Haru); the agents are `agents.sim.hosts.SimHosts`: two simulated hosts per fleet (domains
`a` and `b`, three vLLM models each) in this process, speaking the agents' real protocol (residency
events with expected sequences through the agent's Recorder, heartbeats every second, the agents'
`nats.micro` command service, a serving port per host answering chat). The fleets are added while the
plane runs (1, then 10, ...): at each level, once every fleet is steady (a route, the standby asleep),
a window of `--window-s` seconds with churn like bench/growth.py's faults on every fleet but one
(each fleet, every `--fault-every-s` on average: detach the active's GPU and give it back 10 s later,
kill a runtime on the standby, SIGKILL the standby's agent and start it again), while fleet f000 is
failed over `--failovers` times (its active's GPU detached).

Measured in the window, from JetStream's own timestamps where there are two ends:
- projector lag: an event appended -> the first view of its fleet in KV that folded it (p50, p99);
- route change -> gateway: `route_moved` appended -> the gateway's `gateway.route_moved` log line for
  that revision (its structlog timestamp; same clock);
- failover control-plane overhead of f000 while the others churn: loss appended -> `route_moved`
  appended, minus the agents' own took_ms of the steps before the flip (as bench/failover.py);
- CPU of each process per unit of work: the promoter's per heartbeat received, the projector's and the
  gateway's per event appended; RSS of each process; KV view bytes per fleet.
Every figure is printed at each N and as the ratio against N = 1 (the goal: per-fleet costs flat,
<= 1.5x from 1 to 100 fleets).

Then, with every fleet: two promoters share them, the active's GPU of every fleet is detached at once
(wakes made slow so steps are in flight), and the promoter that started most steps is SIGKILLed: per
fleet, the time from the kill to the survivor's `step_started` for that operation, and how many
failovers completed.

The machine is shared: run under `flock /tmp/haru-cpu.lock`, and read ratios, not absolute figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from haru.agents.sim.hosts import SimHosts
from haru.core import subjects
from haru.core.events import (
    GpuObserved,
    ModelLost,
    PromotionRequested,
    RouteMoved,
    StepCompleted,
    StepStarted,
)
from haru.core.views import FleetView, view_decoder
from haru.host.natsd import NatsServer, free_port
from haru.log.eventlog import EventLog

BEFORE_FLIP = ("stop_training", "verify_gpu", "wake", "probe")
CLK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------- processes


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class Plane:
    """The control plane's processes: children of this one, with their logs."""

    url: str
    root: Path
    gateway_port: int = 0
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    others: dict[str, int] = field(default_factory=dict)  # processes measured but not ours to stop (nats-server)
    src: Path | None = None  # where the services' code comes from (--plane-src: another tree, for a before/after)

    def start(self, name: str, args: list[str], url: str = "") -> subprocess.Popen:
        env = {**os.environ, "HARU_NATS_URL": url or self.url, "PYTHONPATH": str(self.src or REPO)}
        log = open(self.root / f"{name}.log", "ab")
        p = subprocess.Popen(
            [sys.executable, "-m", "haru.cli", *args, "--log-format", "json"],
            env=env,
            cwd=self.src or REPO,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
        self.procs[name] = p
        return p

    def kill(self, name: str) -> None:
        p = self.procs.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()

    def stop(self) -> None:
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()


# ------------------------------------------------------------------------------------ collectors


class _Seq(msgspec.Struct):
    seq: int = 0


_seq_decoder = msgspec.json.Decoder(_Seq)


def _ack_fields(reply: str) -> tuple[int, int]:
    """(stream sequence, JetStream timestamp ns) from an ordered consumer's reply subject."""
    parts = reply.split(".")
    # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending> (older form, no domain/hash)
    if len(parts) == 9:
        return int(parts[5]), int(parts[7])
    return int(parts[-4]), int(parts[-2])


class Watch:
    """Every event appended and every view written, with their JetStream timestamps (a raw consumer each)."""

    def __init__(self) -> None:
        self.events: dict[str, list[tuple[int, int]]] = {}  # fleet -> [(seq, ts ns)]
        self.moves: list[tuple[str, int, int]] = []  # (fleet, seq, ts ns) of route subjects
        self.views: dict[str, list[tuple[int, int]]] = {}  # fleet -> [(view seq, ts ns)]
        self.heartbeats = 0
        self.subs: list = []

    async def start(self, log: EventLog) -> None:
        from nats.js import api

        js = log.js

        async def on_event(msg) -> None:
            seq, ts = _ack_fields(msg.reply)
            parts = msg.subject.split(".")
            fleet = parts[2]
            self.events.setdefault(fleet, []).append((seq, ts))
            if len(parts) == 4 and parts[3] == "route":
                self.moves.append((fleet, seq, ts))

        async def on_view(msg) -> None:
            _, ts = _ack_fields(msg.reply)
            fleet = msg.subject.rsplit(".", 1)[1]
            with contextlib.suppress(msgspec.DecodeError):
                self.views.setdefault(fleet, []).append((_seq_decoder.decode(msg.data).seq, ts))

        async def on_hb(msg) -> None:
            self.heartbeats += 1

        self.subs = [
            await js.subscribe(
                subjects.ALL_EVENTS,
                cb=on_event,
                stream=subjects.EVENTS_STREAM,
                ordered_consumer=True,
                deliver_policy=api.DeliverPolicy.NEW,
                pending_msgs_limit=-1,
                pending_bytes_limit=-1,
            ),
            await js.subscribe(
                "$KV.haru_views.>",
                cb=on_view,
                stream="KV_haru_views",
                ordered_consumer=True,
                deliver_policy=api.DeliverPolicy.NEW,
                pending_msgs_limit=-1,
                pending_bytes_limit=-1,
            ),
            await log.nc.subscribe("haru.hb.>", cb=on_hb),
        ]

    async def stop(self) -> None:
        for s in self.subs:
            with contextlib.suppress(Exception):
                await s.unsubscribe()

    def projector_lags_ms(self) -> tuple[list[float], int]:
        """Per event: its fleet's first view at or past it, in ms; and how many events no view reached."""
        lags: list[float] = []
        missing = 0
        for fleet, evs in self.events.items():
            views = sorted(self.views.get(fleet, []), key=lambda v: v[1])
            i = 0
            best = 0  # the highest view seq written so far, scanning views in time order
            for seq, ts in sorted(evs):
                while i < len(views) and best < seq:
                    best = max(best, views[i][0])
                    t_view = views[i][1]
                    i += 1
                if best >= seq:
                    lags.append(max(0.0, (t_view - ts) / 1e6) if i else 0.0)
                else:
                    missing += 1
        return lags, missing


def gateway_route_times(path: Path) -> dict[str, list[tuple[int, float]]]:
    """fleet -> [(revision, epoch s)] of the gateway's `gateway.route_moved` lines."""
    out: dict[str, list[tuple[int, float]]] = {}
    with open(path, "rb") as f:
        for line in f:
            if b"gateway.route_moved" not in line:
                continue
            with contextlib.suppress(ValueError, KeyError):
                rec = json.loads(line)
                t = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
                out.setdefault(rec["fleet"], []).append((int(rec["revision"]), t))
    return out


def route_lags_ms(moves: list[tuple[str, int, int]], gw: dict[str, list[tuple[int, float]]]) -> tuple[list[float], int]:
    lags, missing = [], 0
    for fleet, seq, ts in moves:
        seen = [t for rev, t in gw.get(fleet, []) if rev >= seq]
        if not seen:
            missing += 1
            continue
        lags.append(max(0.0, (min(seen) - ts / 1e9) * 1000))
    return lags, missing


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


# ---------------------------------------------------------------------------------------- faults


async def views_of(log: EventLog) -> dict[str, FleetView]:
    out = {}
    for k, v in (await log.views()).items():
        with contextlib.suppress(msgspec.DecodeError):
            out[k.removeprefix("fleet.")] = view_decoder.decode(v)
    return out


async def until_steady(log: EventLog, hosts: SimHosts, timeout: float, fleets=None) -> float:
    t0 = time.monotonic()
    while True:
        left = hosts.steady(await views_of(log), fleets)
        if not left:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"bench: {len(left)} fleet(s) not steady after {timeout:.0f} s: {left[:10]}")
        await asyncio.sleep(0.5)


async def churn(
    log: EventLog,
    hosts: SimHosts,
    fleets: list[str],
    every_s: float,
    stop: asyncio.Event,
    counts: dict[str, int],
    rng: random.Random,
    detached: list[tuple[str, float, str]] | None = None,
) -> None:
    """growth.py's faults in turn, one fleet at a time, each fleet about once per `every_s`."""
    if not fleets:
        await stop.wait()
        return
    turn: dict[str, int] = {}
    tasks: set[asyncio.Task] = set()
    gap = every_s / len(fleets)
    busy: set[str] = set()

    async def fault(f: str) -> None:
        busy.add(f)
        try:
            views = await views_of(log)
            v = views.get(f)
            active = v.active if v is not None and v.active else "a"
            standby = "b" if active == "a" else "a"
            kind = turn.get(f, rng.randrange(3)) % 3
            turn[f] = kind + 1
            if kind == 0:
                counts["gpu_detached"] += 1
                if detached is not None:
                    detached.append((f, time.time(), active))
                await hosts.host(f, active).detach_gpu()
                await asyncio.sleep(10)
                await hosts.host(f, active).attach_gpu()
            elif kind == 1:
                counts["runtime_killed"] += 1
                await hosts.host(f, standby).kill_runtime(rng.choice(list(hosts.host(f, standby).models)))
            else:
                counts["agent_killed"] += 1
                await hosts.host(f, standby).restart(hosts.heartbeat_timeout_ms / 1000 + 1.0)
        except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is reported, not fatal
            counts["fault_errors"] += 1
            print(f"  (fault on {f} failed: {exc!r})", flush=True)
        finally:
            busy.discard(f)

    order = list(fleets)
    rng.shuffle(order)
    i = 0
    while not stop.is_set():
        f = order[i % len(order)]
        i += 1
        if f not in busy:
            t = asyncio.create_task(fault(f))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(gap):
                await stop.wait()
    # let faults in progress finish (a detached GPU is given back)
    if tasks:
        await asyncio.wait(tasks, timeout=20)


async def failover_once(log: EventLog, hosts: SimHosts, fleet: str) -> dict | None:
    """Detach `fleet`'s active GPU; measure loss -> route_moved and the steps; give the GPU back."""
    v = None
    for _ in range(50):  # a view being rewritten can be missing from one read of the bucket
        v = (await views_of(log)).get(fleet)
        if v is not None and v.active:
            break
        await asyncio.sleep(0.1)
    if v is None or not v.active:
        return None
    active = v.active
    standby = "b" if active == "a" else "a"
    start = await log.last_seq()
    await hosts.host(fleet, active).detach_gpu()
    deadline = time.monotonic() + 30
    route = None
    while time.monotonic() < deadline and route is None:
        await asyncio.sleep(0.1)
        rec = await log.last(subjects.route(fleet))
        if rec is not None and rec.seq > start and isinstance(rec.event, RouteMoved) and rec.event.active == standby:
            route = rec
    await hosts.host(fleet, active).attach_gpu()
    if route is None:
        return None
    recs = await log.history(subjects.fleet_events(fleet), from_seq=start + 1)
    loss = next(
        r
        for r in recs
        if isinstance(r.event, ModelLost) or (isinstance(r.event, GpuObserved) and r.event.present is False)
    )
    op_id = route.event.op_id  # type: ignore[union-attr]
    request = next((r for r in recs if isinstance(r.event, PromotionRequested) and r.event.op_id == op_id), route)
    work = 0
    for r in recs:
        e = r.event
        if isinstance(e, StepCompleted) and e.op_id == op_id and e.step in BEFORE_FLIP:
            work += e.took_ms
    total = (route.time - loss.time).total_seconds() * 1000
    return {
        "total_ms": total,
        "work_ms": work,
        "overhead_ms": total - work,
        "decide_ms": (request.time - loss.time).total_seconds() * 1000,
    }


# ------------------------------------------------------------------------------------ one level


async def level(n: int, args, log: EventLog, hosts: SimHosts, plane: Plane, rng: random.Random) -> dict:
    t0 = time.monotonic()
    await hosts.grow(n)
    settle = await until_steady(log, hosts, 60 + 2 * n)
    print(
        f"[{n} fleets] grown and steady in {time.monotonic() - t0:.1f} s (last fleets steady after {settle:.1f} s)",
        flush=True,
    )
    watch = Watch()
    await watch.start(log)
    pids = {k: p.pid for k, p in plane.procs.items()} | plane.others
    pids["harness"] = os.getpid()
    cpu0 = {k: cpu_s(p) for k, p in pids.items()}
    stop = asyncio.Event()
    counts = {"gpu_detached": 0, "runtime_killed": 0, "agent_killed": 0, "fault_errors": 0}
    measured = hosts.fleets[0]
    churning = asyncio.create_task(churn(log, hosts, hosts.fleets[1:], args.fault_every_s, stop, counts, rng))
    w0 = time.monotonic()
    failovers = []
    for k in range(args.failovers):
        await asyncio.sleep(max(0.0, w0 + args.window_s * (k + 0.5) / args.failovers - time.monotonic() - 5))
        with contextlib.suppress(SystemExit):
            await until_steady(log, hosts, 20, [measured])
        got = await failover_once(log, hosts, measured)
        if got is not None:
            failovers.append(got)
    await asyncio.sleep(max(0.0, w0 + args.window_s - time.monotonic()))
    window = time.monotonic() - w0
    cpu1 = {k: cpu_s(p) for k, p in pids.items()}
    rss = {k: rss_mb(p) for k, p in pids.items()}
    heartbeats = watch.heartbeats
    stop.set()
    await churning
    await asyncio.sleep(3.0)  # the last views of the window are written
    await watch.stop()
    events = sum(len(v) for v in watch.events.values())
    lags, unwritten = watch.projector_lags_ms()
    rlags, rmissing = route_lags_ms(watch.moves, gateway_route_times(plane.root / "gateway.log"))
    views = await log.views()
    view_bytes = statistics.mean(len(v) for v in views.values()) if views else 0
    cpu = {k: cpu1[k] - cpu0[k] for k in pids}
    out = {
        "fleets": n,
        "events": events,
        "events_per_s": events / window,
        "heartbeats": heartbeats,
        "faults": dict(counts),
        "proj_lag_p50": pct(lags, 50),
        "proj_lag_p99": pct(lags, 99),
        "proj_unwritten": unwritten,
        "route_moves": len(watch.moves),
        "route_gw_p50": pct(rlags, 50),
        "route_gw_p99": pct(rlags, 99),
        "route_gw_missing": rmissing,
        "failover_overhead": statistics.median(f["overhead_ms"] for f in failovers) if failovers else float("nan"),
        "failover_total": statistics.median(f["total_ms"] for f in failovers) if failovers else float("nan"),
        "failovers": len(failovers),
        "promoter_us_per_hb": cpu["promoter"] / max(1, heartbeats) * 1e6,
        "projector_us_per_event": cpu["projector"] / max(1, events) * 1e6,
        "gateway_us_per_event": cpu["gateway"] / max(1, events) * 1e6,
        "nats_us_per_event": cpu["nats-server"] / max(1, events) * 1e6 if "nats-server" in cpu else float("nan"),
        "cpu_share": {k: v / window for k, v in cpu.items()},
        "promoter_ms_per_fleet_s": cpu["promoter"] / window / n * 1000,
        "projector_ms_per_fleet_s": cpu["projector"] / window / n * 1000,
        "gateway_ms_per_fleet_s": cpu["gateway"] / window / n * 1000,
        "failover_decide": statistics.median(f["decide_ms"] for f in failovers) if failovers else float("nan"),
        "rss": rss,
        "view_bytes": view_bytes,
    }
    print(
        f"[{n} fleets] window {window:.0f} s: {events} events ({events / window:.0f}/s), {heartbeats} heartbeats, "
        f"faults {counts}, {len(watch.moves)} route moves; projector lag p50 {out['proj_lag_p50']:.1f} "
        f"p99 {out['proj_lag_p99']:.1f} ms ({unwritten} unwritten); route->gateway p50 {out['route_gw_p50']:.1f} "
        f"p99 {out['route_gw_p99']:.1f} ms ({rmissing} unseen); "
        f"f000 failover overhead {out['failover_overhead']:.0f} ms "
        f"({len(failovers)} runs); CPU share " + ", ".join(f"{k} {v:.0%}" for k, v in out["cpu_share"].items()),
        flush=True,
    )
    return out


ROWS = [
    ("projector lag p99 (ms)", "proj_lag_p99", "{:.1f}"),
    ("projector lag p50 (ms)", "proj_lag_p50", "{:.1f}"),
    ("route -> gateway p99 (ms)", "route_gw_p99", "{:.1f}"),
    ("route -> gateway p50 (ms)", "route_gw_p50", "{:.1f}"),
    ("f000 failover overhead (ms)", "failover_overhead", "{:.0f}"),
    ("  of which loss -> promotion_requested", "failover_decide", "{:.0f}"),
    ("promoter CPU per heartbeat (us)", "promoter_us_per_hb", "{:.0f}"),
    ("promoter CPU per fleet (ms/s)", "promoter_ms_per_fleet_s", "{:.2f}"),
    ("projector CPU per fleet (ms/s)", "projector_ms_per_fleet_s", "{:.2f}"),
    ("gateway CPU per fleet (ms/s)", "gateway_ms_per_fleet_s", "{:.2f}"),
    ("projector CPU per event (us)", "projector_us_per_event", "{:.0f}"),
    ("gateway CPU per event (us)", "gateway_us_per_event", "{:.0f}"),
    ("nats-server CPU per event (us)", "nats_us_per_event", "{:.0f}"),
    ("KV view bytes per fleet", "view_bytes", "{:.0f}"),
]


def table(results: list[dict]) -> None:
    base = results[0]
    head = "".join(f"{'N=' + str(r['fleets']):>22}" for r in results)
    print(f"\n{'figure':<34}{head}")
    rows = [(name, key, fmt) for name, key, fmt in ROWS]
    for name, key, fmt in rows:
        cells = []
        for r in results:
            v, b = r[key], base[key]
            ratio = f"({v / b:.2f}x)" if b and b == b and v == v and r is not base else ""
            cells.append(f"{fmt.format(v)} {ratio}".rjust(22))
        print(f"{name:<34}{''.join(cells)}")
    for proc in ("nats-server", "projector", "promoter", "gateway", "harness"):
        cells = []
        for r in results:
            v, b = r["rss"].get(proc, 0), base["rss"].get(proc, 0)
            ratio = f"({v / b:.2f}x)" if b and r is not base else ""
            cells.append(f"{v:.0f} {ratio}".rjust(22))
        print(f"{'RSS ' + proc + ' (MB)':<34}{''.join(cells)}")
    print(f"{'events appended per s':<34}" + "".join(f"{r['events_per_s']:.0f}".rjust(22) for r in results))


# -------------------------------------------------------------------------------------- takeover


async def takeover(args, log: EventLog, hosts: SimHosts, plane: Plane) -> None:
    """Two promoters share every fleet; every active's GPU is detached at once; the busier promoter is
    SIGKILLed mid-wake: per fleet, kill -> the survivor's step_started for that operation."""
    plane.start("promoter2", ["promoter", "--id", "promoter:bench-2"])
    await asyncio.sleep(5)
    await until_steady(log, hosts, 60)
    for h in hosts.hosts.values():
        h.wake_ms = args.takeover_wake_ms
    start = await log.last_seq()
    views = await views_of(log)
    fleets = list(hosts.fleets)
    print(
        f"\n[takeover] 2 promoters, {len(fleets)} fleets: detaching "
        f"every active's GPU (wake {args.takeover_wake_ms} ms)",
        flush=True,
    )
    await asyncio.gather(*(hosts.host(f, views[f].active).detach_gpu() for f in fleets))
    # until most fleets have a wake step started
    t_deadline = time.monotonic() + 30
    while time.monotonic() < t_deadline:
        recs = await log.history("haru.evt.*.op", from_seq=start + 1)
        woken = {r.subject for r in recs if isinstance(r.event, StepStarted) and r.event.step == "wake"}
        if len(woken) >= 0.9 * len(fleets):
            break
        await asyncio.sleep(0.2)
    recs = await log.history("haru.evt.*.op", from_seq=start + 1)
    by: dict[str, int] = {}
    for r in recs:
        if isinstance(r.event, StepStarted):
            by[r.event.by] = by.get(r.event.by, 0) + 1
    victim_id = max(by, key=lambda k: by[k]) if by else "promoter:bench-1"
    victim = "promoter" if victim_id == "promoter:bench-1" else "promoter2"
    survivor_id = "promoter:bench-2" if victim == "promoter" else "promoter:bench-1"
    kill_seq = await log.last_seq()
    t_kill = time.time()
    plane.kill(victim)
    print(f"[takeover] steps started so far by {by}; SIGKILLed {victim_id}", flush=True)
    deadline = time.monotonic() + args.takeover_timeout_s
    moved: set[str] = set()
    while time.monotonic() < deadline and len(moved) < len(fleets):
        await asyncio.sleep(0.5)
        for f in fleets:
            if f not in moved:
                rec = await log.last(subjects.route(f))
                if rec is not None and rec.seq > start:
                    moved.add(f)
    recs = await log.history("haru.evt.*.op", from_seq=start + 1)
    # the fleets the victim held at the kill: its step_started was the op's last step record before the kill
    held: dict[str, str] = {}
    last_by: dict[str, tuple[str, str]] = {}
    for r in recs:
        if r.seq > kill_seq:
            break
        f = r.subject.split(".")[2]
        if isinstance(r.event, StepStarted):
            last_by[f] = (r.event.by, r.event.op_id)
        elif isinstance(r.event, StepCompleted):
            last_by.pop(f, None)
    held = {f: op for f, (who, op) in last_by.items() if who == victim_id}
    taken: dict[str, float] = {}
    for r in recs:
        if r.seq <= kill_seq:
            continue
        f = r.subject.split(".")[2]
        if f in held and f not in taken and isinstance(r.event, StepStarted) and r.event.by == survivor_id:
            taken[f] = r.time.timestamp() - t_kill
    times = sorted(taken.values())
    # the same step (operation, step, attempt) started by both promoters: a decision made on a view that
    # lacked the other's step_started, appended on top of it (one replica's step must never run twice)
    started: dict[tuple[str, str, int], int] = {}
    for r in recs:
        if isinstance(r.event, StepStarted):
            key = (r.event.op_id, r.event.step, r.event.attempt)
            started[key] = started.get(key, 0) + 1
    twice = sum(1 for n in started.values() if n > 1)
    print(
        f"[takeover] fleets whose step was in flight on the killed promoter: {len(held)}; taken over: {len(taken)}; "
        f"route moved afterwards: {len(moved)}/{len(fleets)}; steps started twice: {twice} of {len(started)}"
    )
    if times:
        print(
            f"[takeover] kill -> survivor's step_started, per fleet: min {times[0]:.2f} s, p50 {pct(times, 50):.2f} s, "
            f"p99 {pct(times, 99):.2f} s, max {times[-1]:.2f} s (the runner is taken for dead after "
            f"3.5 s of silence on haru.alive)"
        )
    for h in hosts.hosts.values():
        h.wake_ms = args.wake_ms


# ------------------------------------------------------------------------------------ the cluster


async def cluster_run(args) -> None:
    """The 3-node cluster of deploy/nats (its shipped configs, per-role users; R3 streams), the services
    with their own users, `--cluster-fleets` fleets churning, and the HARU_EVENTS stream leader killed a
    third into the window: every append the agents had acknowledged is in the stream afterwards, every
    failover due (an active's GPU detached) moved the route, and the figures during the election
    (the `--election-s` after the kill) are printed beside the rest of the window's."""
    from tests.support.cluster import ensure_r3, start_cluster

    root = Path(tempfile.mkdtemp(prefix="haru-bench-scale-cluster-"))
    n = args.cluster_fleets
    print(
        "bench/scale.py --cluster: 3 nodes (deploy/nats), R3, "
        f"{n} fleets, window {args.window_s:.0f} s, logs in {root}",
        flush=True,
    )
    cluster = start_cluster(root / "cluster")
    plane = Plane("", root, free_port())
    try:
        await ensure_r3(cluster)
        urls = {u: ",".join(cluster.urls(u)) for u in ("projector", "promoter", "gateway")}
        # The simulated hosts share one connection, so they use the admin user (each real agent has
        # its own user, which may publish only its own domain's subjects: tests/integration/test_deploy_cluster.py).
        async with EventLog.connect(cluster.urls("admin"), writer="sim:hosts") as log:
            async with SimHosts(
                log, heartbeat_timeout_ms=args.heartbeat_timeout_ms, wake_ms=args.wake_ms, keep_acks=True
            ) as hosts:
                await hosts.grow(n)
                plane.start("projector", ["projector"], urls["projector"])
                plane.start("promoter", ["promoter", "--id", "promoter:bench-1"], urls["promoter"])
                plane.start("gateway", ["gateway", "--port", str(plane.gateway_port)], urls["gateway"])
                settle = await until_steady(log, hosts, 120 + 2 * n)
                print(f"[cluster] {n} fleets steady after {settle:.1f} s", flush=True)
                watch = Watch()
                await watch.start(log)
                assert hosts.acked is not None
                acked_before = len(hosts.acked)
                stop = asyncio.Event()
                counts = {"gpu_detached": 0, "runtime_killed": 0, "agent_killed": 0, "fault_errors": 0}
                detached: list[tuple[str, float, str]] = []
                churning = asyncio.create_task(
                    churn(log, hosts, hosts.fleets, args.fault_every_s, stop, counts, random.Random(31), detached)
                )
                w0 = time.monotonic()
                await asyncio.sleep(args.window_s / 3)
                info = await log.js.stream_info(subjects.EVENTS_STREAM)
                leader = info.cluster.leader if info.cluster else None
                node = next(x for x in cluster.nodes if x.name == leader)
                t_kill = time.time()
                node.kill()
                print(f"[cluster] killed {leader}, the {subjects.EVENTS_STREAM} stream leader", flush=True)
                t_led = None
                while time.time() - t_kill < 30:
                    with contextlib.suppress(Exception):
                        info = await log.js.stream_info(subjects.EVENTS_STREAM)
                        if info.cluster and info.cluster.leader and info.cluster.leader != leader:
                            t_led = time.time()
                            break
                    await asyncio.sleep(0.1)
                print(
                    f"[cluster] new stream leader "
                    f"{info.cluster.leader if info.cluster else '?'} after {(t_led or time.time()) - t_kill:.1f} s",
                    flush=True,
                )
                await asyncio.sleep(max(0.0, w0 + args.window_s - time.monotonic()))
                stop.set()
                await churning
                # every detached GPU given back; the failovers due finish
                await asyncio.sleep(10)
                await watch.stop()
                # 1. nothing acknowledged lost
                stored = {(r.seq, r.subject) for r in await log.history(subjects.ALL_EVENTS, timeout=120)}
                acked = hosts.acked
                lost = [(subj, seq) for subj, seq in acked if (seq, subj) not in stored]
                # 2. every failover due was decided: a route move of that fleet after its detach
                moves = {}
                for f, _seq, ts in watch.moves:
                    moves.setdefault(f, []).append(ts / 1e9)
                late = [(f, t, a) for f, t, a in detached if not any(ts > t for ts in moves.get(f, []))]
                # 3. the figures during the election and outside it
                lags_in, lags_out = [], []
                election_end = t_kill + args.election_s
                for fleet, evs in watch.events.items():
                    views = sorted(watch.views.get(fleet, []), key=lambda v: v[1])
                    for seq, ts in evs:
                        first = next((vt for vs, vt in views if vs >= seq and vt >= ts), None)
                        if first is None:
                            continue
                        (lags_in if t_kill <= ts / 1e9 <= election_end else lags_out).append((first - ts) / 1e6)
                _, rmissing = route_lags_ms(watch.moves, gateway_route_times(root / "gateway.log"))
                gw = gateway_route_times(root / "gateway.log")
                r_in, r_out = [], []
                for f, _seq, ts in watch.moves:
                    seen = [t for rev, t in gw.get(f, []) if rev >= seq]
                    if seen:
                        (r_in if t_kill <= ts / 1e9 <= election_end else r_out).append((min(seen) - ts / 1e9) * 1000)
                print(
                    f"[cluster] faults {counts}; agents' appends "
                    f"acknowledged in the window: {len(acked) - acked_before} "
                    f"(all runs: {len(acked)}); of them missing from the stream: {len(lost)}"
                    + (f" {lost[:5]}" if lost else "")
                )
                print(
                    f"[cluster] failovers due (an active's GPU detached): {len(detached)}; route moved after: "
                    f"{len(detached) - len(late)}" + (f"; NOT moved: {late[:5]}" if late else "")
                )
                print(
                    f"[cluster] projector lag  during the election ({args.election_s:.0f} s after the kill): "
                    f"p50 {pct(lags_in, 50):.1f} p99 {pct(lags_in, 99):.1f} "
                    f"max {max(lags_in, default=float('nan')):.1f} ms "
                    f"({len(lags_in)} events); rest of the window p50 "
                    f"{pct(lags_out, 50):.1f} p99 {pct(lags_out, 99):.1f} ms "
                    f"({len(lags_out)} events)"
                )
                print(
                    "[cluster] route -> gateway during the election: "
                    f"p50 {pct(r_in, 50):.1f} p99 {pct(r_in, 99):.1f} ms "
                    f"({len(r_in)} moves); rest: p50 {pct(r_out, 50):.1f} "
                    f"p99 {pct(r_out, 99):.1f} ms ({len(r_out)} moves); "
                    f"{rmissing} moves the gateway never logged"
                )
    finally:
        plane.stop()
        cluster.stop()
    print(f"\nlogs: {root}")


# ------------------------------------------------------------------------------------------- main


async def main(args) -> None:
    if args.durability:
        await durability(args)
        return
    results, root = await run_levels(args, "always")
    if not args.takeover:  # else printed before the takeover
        table(results)
    print(f"\nlogs: {root}")


async def run_levels(args, sync_interval: str | None, takeover_after: bool = True) -> tuple[list[dict], Path]:
    """The levels on one embedded nats-server with this `sync_interval` (None = nats-server's default)."""
    levels = [int(x) for x in args.levels.split(",")]
    rng = random.Random(30)
    root = Path(tempfile.mkdtemp(prefix="haru-bench-scale-"))
    print(
        f"bench/scale.py: levels {levels}, window {args.window_s:.0f} s, faults every {args.fault_every_s:.0f} s per "
        f"fleet, sync_interval {sync_interval or 'default (2 min)'}, logs in {root}",
        flush=True,
    )
    results = []
    async with NatsServer(root / "nats", sync_interval=sync_interval) as server:
        async with EventLog.connect([server.url], writer="sim:hosts") as log:
            await log.ensure()
            plane = Plane(server.url, root, free_port(), src=args.plane_src)
            assert server.proc is not None
            plane.others["nats-server"] = server.proc.pid
            try:
                async with SimHosts(log, heartbeat_timeout_ms=args.heartbeat_timeout_ms, wake_ms=args.wake_ms) as hosts:
                    await hosts.grow(levels[0])
                    plane.start("projector", ["projector"])
                    plane.start("promoter", ["promoter", "--id", "promoter:bench-1"])
                    plane.start("gateway", ["gateway", "--port", str(plane.gateway_port)])
                    for n in levels:
                        results.append(await level(n, args, log, hosts, plane, rng))
                    if args.takeover and takeover_after:
                        table(results)
                        await takeover(args, log, hosts, plane)
            finally:
                plane.stop()
    return results, root


async def durability(args) -> None:
    """The same levels twice, on the shipped `sync_interval: always` and on nats-server's default, and
    the last level's figures side by side: the control plane's per-fleet costs under the fsync."""
    runs = {}
    for name, sync in (("always", "always"), ("default", None)):
        runs[name], _ = await run_levels(args, sync, takeover_after=False)
    a, d = runs["always"][-1], runs["default"][-1]
    print(f"\ndurability at N={a['fleets']}: sync_interval always (shipped) vs nats-server's default, per-fleet costs")
    print(f"{'figure':<34}{'always':>12}{'default':>12}{'ratio':>9}")
    for name, key, fmt in ROWS:
        v, b = a[key], d[key]
        ratio = v / b if b and b == b and v == v else float("nan")
        verdict = "" if ratio != ratio else ("  (<= 1.5x: meets)" if ratio <= 1.5 else "  (> 1.5x: BELOW)")
        print(f"{name:<34}{fmt.format(v):>12}{fmt.format(b):>12}{ratio:>8.2f}x{verdict}")
    print(f"{'events appended per s':<34}{a['events_per_s']:>12.0f}{d['events_per_s']:>12.0f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="1,10,50,100")
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--fault-every-s", type=float, default=30.0, help="per fleet, on average")
    ap.add_argument("--failovers", type=int, default=3, help="failovers of f000 per window")
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=3000)
    ap.add_argument("--wake-ms", type=int, default=200)
    ap.add_argument("--takeover-wake-ms", type=int, default=6000)
    ap.add_argument("--takeover-timeout-s", type=float, default=90.0)
    ap.add_argument("--no-takeover", dest="takeover", action="store_false")
    ap.add_argument("--quick", action="store_true", help="levels 1,10,50, 20 s windows, 2 failovers")
    ap.add_argument(
        "--plane-src",
        type=Path,
        default=None,
        help="run the projector, promoter and gateway from this source tree (e.g. an export of an older "
        "commit), to compare before and after a change; the simulated hosts stay this tree's",
    )
    ap.add_argument(
        "--cluster", action="store_true", help="the second mode: the 3-node cluster, its stream leader killed"
    )
    ap.add_argument(
        "--durability",
        action="store_true",
        help="run the levels twice, sync_interval always (shipped) and nats-server's default, and print the "
        "last level's per-fleet costs side by side with their ratio",
    )
    ap.add_argument("--cluster-fleets", type=int, default=50)
    ap.add_argument(
        "--election-s", type=float, default=10.0, help="--cluster: how long after the kill counts as the election"
    )
    a = ap.parse_args()
    if a.quick:
        a.levels, a.window_s, a.failovers = "1,10,50", 20.0, 2
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    asyncio.run(cluster_run(a) if a.cluster else main(a))
