"""A region lost under client load, at several inter-region round trips: what the failover costs.

    sudo .venv/bin/python bench/regions.py [--rtt 0,40,120] [--tail-s 3]

Needs root (network namespaces). For each round trip it builds the three-region harness of
tests/support/regions.py (a NATS node, a promoter, a projector and a gateway in every region; domain a's
agent in region 1, the active; b's in region 2, the standby; the simulated GPU and vLLM), sets the delay
proxy to half the round trip one way on every inter-region NATS path, runs closed-loop JSON and SSE
clients through region 3's gateway, measures a steady window, then partitions region 1 (scenario a) and
waits until region 3's gateway routes to b. From the log (JetStream's own record times):

    detect     the partition to `domain_unreachable` for a (the heartbeat timeout dominates)
    decide     that to `promotion_requested`
    flip       the partition to `route_moved`
    cp share   flip - detect - the wake and probe steps' own durations: what the control plane itself
               spends (appends, folds, commands), in ms and in inter-region round trips. Two readings:
               `cp` takes the wake and the probe as the agent measured them (its took_ms: the work
               alone, so the round trips to the agent count as the control plane's); `cp|wall` takes
               them as the promoter saw them (their wall_ms: a wake of a host in another region
               includes the trip there and back)
    failed/cut requests through region 3's gateway from the partition to the end of the tail
    p99        of those requests, against the steady window's p99 (a ratio)

The same run, the same machine: rows compare with each other, the 0 ms row is the baseline.

`--scenarios a,d,f` adds, on a fresh harness per round trip, scenario d (region 1's NATS node cut from
the two others while the active's agent is connected to it: the agent moves to a node with a majority)
and scenario f (region 1's link down 5 s and up 3 s for 30 s). Their rows have the same columns, measured
from the first fault; a note says when agent a left its node (d) and how many operations and flips the
flapping made (f). A column stays `-` when the scenario made no such event (d without a failover).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from haru.core import subjects  # noqa: E402
from haru.core.errors import LogError, LogUnavailable  # noqa: E402
from haru.core.events import DomainUnreachable, PromotionRequested, RouteMoved, StepCompleted  # noqa: E402
from haru.log.eventlog import EventLog  # noqa: E402
from tests.support.region_fleet import FLEET, ClientLoad, RegionFleet, p99, view  # noqa: E402
from tests.support.regions import Regions, netns_problem  # noqa: E402


async def wait(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


STREAMS = (subjects.EVENTS_STREAM, subjects.ROUTE_STREAM, "KV_" + subjects.VIEWS_BUCKET)


async def leaders(rg: Regions) -> str:
    """Where JetStream's meta group and each stream are led now: 'meta r1 evt r2 route r2 views r3'."""
    async with EventLog.connect(rg.test_urls(), writer="bench") as log:
        out = [f"meta r{rg.meta_leader()}"]
        for name, stream in zip(("evt", "route", "views"), STREAMS, strict=True):
            leader, _ = await rg.placement(log.js, stream)
            out.append(f"{name} r{leader}")
    return " ".join(out)


async def lead_from(rg: Regions, region: int, timeout: float = 30.0) -> None:
    """Move every stream's leadership into `region` (JetStream's leader step-down with a placement), so
    that losing that region loses the event, route and views streams' leaders at once. (The meta
    group's step-down is an API of the system account, which the harness's clients are not: where the
    meta leader sits is the cluster's choice, and the row says where.)"""
    placement = json.dumps({"placement": {"tags": [f"region:r{region}"]}}).encode()
    async with EventLog.connect(rg.test_urls(), writer="bench") as log:
        deadline = time.monotonic() + timeout
        said: list[str] = []
        while time.monotonic() < deadline:
            moved = True
            for stream in STREAMS:
                leader, _ = await rg.placement(log.js, stream)
                if leader != region:
                    moved = False
                    said.append(await ask(log, f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", placement))
            if moved:
                return
            await asyncio.sleep(2.0)
    raise RuntimeError(f"could not move JetStream's leaders into region {region}: {said[-4:]}")


async def ask(log: EventLog, subject: str, body: bytes) -> str:
    try:
        return (await log.nc.request(subject, body, timeout=5)).data.decode()[:200]
    except Exception as exc:  # noqa: BLE001 - a bench reports what the server said and goes on
        return f"{subject}: {exc!r}"


async def kept_in(rg: Regions, region: int, timeout: float = 60.0) -> None:
    """Wait until the promoters' `--stream-leaders` has every stream led from `region`."""
    deadline = time.monotonic() + timeout
    async with EventLog.connect(rg.test_urls(), writer="bench") as log:
        while time.monotonic() < deadline:
            if all([(await rg.placement(log.js, stream))[0] == region for stream in STREAMS]):
                return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"the promoters did not move the streams' leaders into region {region}: {await leaders(rg)}")


# --keep-leaders: the promoters' --stream-leaders, and the region the leaders are in before the fault
KEEP = {
    "witness": ("haru-nats-r3", 3),  # region 3 hosts no domain
    "standby": ("a=haru-nats-r1,b=haru-nats-r2,haru-nats-r3", 2),  # beside the standby (b, region 2 first)
}


async def one(rtt_ms: int, root: Path, steady_s: float, tail_s: float, lead: int = 0, keep: str = "") -> dict:
    with Regions(root / "rg") as rg:
        rg.nats()
        rg.set_delay(rtt_ms / 2)
        fleet = RegionFleet(rg, root / "fleet", stream_leaders=KEEP[keep][0] if keep else "")
        (root / "fleet").mkdir(parents=True, exist_ok=True)
        try:
            await fleet.start()

            async def steady() -> bool:
                v = await view(3, rg)
                return bool(
                    v
                    and v["active"] == "a"
                    and v["operation"] is None
                    and v["domains"]["b"]["models"]["m1"]["residency"]["state"] == "sleeping"
                )

            await wait(steady, 120, "a active and b asleep")
            if lead:
                await lead_from(rg, lead)
                await wait(steady, 60, "a active and b asleep after the leaders moved")
            if keep:
                await kept_in(rg, KEEP[keep][1])
            placed = await leaders(rg)
            async with ClientLoad(fleet.gateway_url(3)) as load:
                await asyncio.sleep(steady_s)
                t_fault = time.monotonic()
                wall_fault = time.time()
                rg.partition(1)

                async def moved() -> bool:
                    v = await view(3, rg)
                    return bool(v and v["active"] == "b" and v["operation"] is None)

                await wait(moved, 120, "b active")
                await asyncio.sleep(tail_s)
            async with EventLog.connect(rg.test_urls(), writer="bench") as log:
                recs = await log.history(subjects.fleet_events(FLEET))
        finally:
            fleet.kill_agents_runtimes()

    def first(kind, pred=lambda e: True) -> float | None:
        for r in recs:
            if isinstance(r.event, kind) and r.time_ns / 1e9 >= wall_fault and pred(r.event):
                return r.time_ns / 1e9 - wall_fault
        return None

    detect = first(DomainUnreachable, lambda e: e.domain == "a")
    decide = first(PromotionRequested)
    flip = first(RouteMoved)
    steps: dict[str, StepCompleted] = {}  # the failover's own wake and probe: the first after the fault (a
    for r in recs:  # later operation, a demotion settling the old active, has steps of the same names)
        if isinstance(r.event, StepCompleted) and r.time_ns / 1e9 >= wall_fault and r.event.step in ("wake", "probe"):
            steps.setdefault(r.event.step, r.event)
    after = load.since(t_fault)
    before = [d for d in load.done if d[0] < t_fault]
    cp_ms, cp_wall = control_plane(detect, flip, steps)
    return {
        "timeline": timeline(recs, wall_fault, rtt_ms),
        "leaders": placed,
        "rtt": rtt_ms,
        "detect": detect,
        "decide": None if decide is None or detect is None else decide - detect,
        "flip": flip,
        "cp_ms": cp_ms,
        "cp_rtts": None if cp_ms is None or not rtt_ms else cp_ms / rtt_ms,
        "cp_wall_rtts": None if cp_wall is None or not rtt_ms else cp_wall / rtt_ms,
        "requests": len(after),
        "failed": sum(1 for d in after if d[3].startswith("failed")),
        "cut": sum(1 for d in after if d[3] == "cut"),
        "p99": p99([d[1] - d[0] for d in after]),
        "p99_steady": p99([d[1] - d[0] for d in before]),
    }


def control_plane(
    detect: float | None, flip: float | None, steps: dict[str, StepCompleted]
) -> tuple[float | None, float | None]:
    """(cp ms, cp|wall ms): the failover from detection to the route move, less its wake and probe as the
    agent measured them (took_ms), and as the promoter saw them (wall_ms, the round trips included)."""
    if flip is None or detect is None:
        return None, None
    total = (flip - detect) * 1000
    took = sum(s.took_ms for s in steps.values())
    wall = sum(s.wall_ms or s.took_ms for s in steps.values())
    return total - took, total - wall


def timeline(recs, wall_fault: float, rtt_ms: int) -> list[str]:
    """Every record from the fault to the flip's completion, with the gap to the one before it (in ms and
    in round trips): the control plane's critical path as the log saw it."""
    out, prev = [], wall_fault
    for r in recs:
        t = r.time_ns / 1e9
        if t < wall_fault or r.event is None:
            continue
        gap_ms = (t - prev) * 1000
        what = getattr(r.event, "step", "") or getattr(r.event, "domain", "") or getattr(r.event, "active", "")
        took = getattr(r.event, "took_ms", 0)
        out.append(
            f"  {(t - wall_fault) * 1000:8.0f} ms  +{gap_ms:6.0f} ms ({gap_ms / rtt_ms if rtt_ms else 0:4.1f} rtt)  "
            f"{r.subject.rsplit('.', 1)[-1]:<9} {type(r.event).__name__:<20} {what:<18} "
            f"{f'took {took} ms' if took else ''} by {r.event.by}"
        )
        prev = t
        if isinstance(r.event, StepCompleted) and r.event.step == "flip":
            break
    return out


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    out = [
        "a: the active's region partitioned; d: one NATS node cut under its agents; f: a flapping link. "
        "Through region 3's gateway",
        f"{'sc':>2} {'rtt':>5} {'detect s':>9} {'decide s':>9} {'flip s':>7} {'cp ms':>7} {'cp rtts':>8} "
        f"{'cp|wall':>8} {'reqs':>5} {'failed':>6} {'cut':>4} {'p99 s':>6} {'x steady':>8}",
    ]
    for r in rows:
        ratio = r["p99"] / r["p99_steady"] if r["p99_steady"] else None
        out.append(
            f"{r.get('scenario', 'a'):>2} "
            f"{r['rtt']:>5} {fmt(r['detect'], '9.2f')} {fmt(r['decide'], '9.2f')} {fmt(r['flip'], '7.2f')} "
            f"{fmt(r['cp_ms'], '7.0f')} {fmt(r['cp_rtts'], '8.1f')} {fmt(r.get('cp_wall_rtts'), '8.1f')} "
            f"{r['requests']:>5} {r['failed']:>6} "
            f"{r['cut']:>4} {r['p99']:>6.2f} {fmt(ratio, '8.1f')}  {r.get('note', '')}".rstrip()
        )
    return "\n".join(out)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default="a", help="a, d, f: which scenarios to run, comma-separated")
    p.add_argument("--rtt", default="0,40,120", help="inter-region round trips to measure, ms, comma-separated")
    p.add_argument("--steady-s", type=float, default=3.0)
    p.add_argument("--tail-s", type=float, default=3.0)
    p.add_argument("--timeline", action="store_true", help="print each run's records from the fault to the flip")
    p.add_argument("--keep-logs", metavar="DIR", help="copy every process's log there (DIR/rtt<ms>/<name>.log)")
    p.add_argument(
        "--lead-from-lost",
        action="store_true",
        help="move JetStream's meta and stream leaders into region 1 first: its partition then loses every leader",
    )
    p.add_argument(
        "--keep-leaders",
        choices=sorted(KEEP),
        default="",
        help="run the promoters with --stream-leaders: on region 3's node (witness: it hosts no domain), or "
        "beside the fleet's standby, region 3's node when that cannot lead (standby)",
    )
    args = p.parse_args()
    if args.keep_leaders and args.lead_from_lost:
        raise SystemExit("bench/regions.py: --lead-from-lost and --keep-leaders place the leaders both: choose one")
    why = netns_problem()
    if why:
        raise SystemExit(f"bench/regions.py: {why}")
    rows, scenarios = [], [x.strip() for x in args.scenarios.split(",")]
    for rtt in [int(x) for x in args.rtt.split(",") if x.strip()] if "a" in scenarios else []:
        root = Path(tempfile.mkdtemp(prefix=f"haru-regions-{rtt}-"))
        try:
            try:
                rows.append(
                    await one(
                        rtt,
                        root,
                        args.steady_s,
                        args.tail_s,
                        lead=1 if args.lead_from_lost else 0,
                        keep=args.keep_leaders,
                    )
                )
            finally:
                if args.keep_logs:
                    shutil.copytree(root / "rg" / "logs", Path(args.keep_logs) / f"rtt{rtt}", dirs_exist_ok=True)
            if args.timeline:
                print(
                    f"records after the fault at {rtt} ms (leaders before it: {rows[-1]['leaders']}):",
                    *rows[-1]["timeline"],
                    sep="\n",
                    flush=True,
                )
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(table(rows), flush=True)
    for scenario, run in (("d", one_node_cut), ("f", flapping)):
        if scenario not in scenarios:
            continue
        for rtt in [int(x) for x in args.rtt.split(",") if x.strip()]:
            root = Path(tempfile.mkdtemp(prefix=f"haru-regions-{scenario}{rtt}-"))
            try:
                rows.append(await run(rtt, root, args.steady_s, args.tail_s))
            finally:
                shutil.rmtree(root, ignore_errors=True)
            print(table(rows), flush=True)


# ------------------------------------------------------------------------------------------ d and f


async def settled(rg: Regions) -> bool:
    """Region 3's gateway sees one domain active and resident, the other asleep and reachable, no operation."""
    v = await view(3, rg)
    if not v or v["operation"] is not None or v["active"] not in ("a", "b"):
        return False
    other = "b" if v["active"] == "a" else "a"
    models = {d: v["domains"][d]["models"]["m1"]["residency"]["state"] for d in ("a", "b")}
    return models[v["active"]] == "resident" and models[other] == "sleeping" and v["domains"][other]["reachable"]


def connected_to(rg: Regions, region: int, prefix: str) -> bool:
    conns = rg.monitor(region, "/connz?limit=1024").get("connections") or []
    return any(c.get("name", "").startswith(prefix) and not c.get("name", "").endswith(":probe") for c in conns)


async def faulted(rtt_ms: int, root: Path, steady_s: float, tail_s: float, scenario: str, fault) -> dict:
    """Build the harness, wait for a settled fleet, run `fault(rg)` under load through region 3's gateway
    (it returns a note), wait for a settled fleet again, and measure the row from the log."""
    with Regions(root / "rg") as rg:
        rg.nats()
        rg.set_delay(rtt_ms / 2)
        fleet = RegionFleet(rg, root / "fleet")
        (root / "fleet").mkdir(parents=True, exist_ok=True)
        try:
            await fleet.start()
            await wait(lambda: settled(rg), 120, "a settled fleet")
            async with ClientLoad(fleet.gateway_url(3)) as load:
                await asyncio.sleep(steady_s)
                t_fault, wall_fault = time.monotonic(), time.time()
                note = await fault(rg, t_fault)
                await wait(lambda: settled(rg), 120, "a settled fleet after the fault")
                await asyncio.sleep(tail_s)
            recs = await fleet_history(rg)
        finally:
            fleet.kill_agents_runtimes()
    after = [r for r in recs if r.time_ns / 1e9 >= wall_fault and r.event is not None]

    def first(kind, pred=lambda e: True) -> float | None:
        return next((r.time_ns / 1e9 - wall_fault for r in after if isinstance(r.event, kind) and pred(r.event)), None)

    detect = first(DomainUnreachable, lambda e: e.domain == "a")
    decide = first(PromotionRequested)
    flip = first(RouteMoved)
    steps: dict[str, StepCompleted] = {}
    for r in after:
        if isinstance(r.event, StepCompleted) and r.event.step in ("wake", "probe"):
            steps.setdefault(r.event.step, r.event)
    cp_ms, cp_wall = control_plane(detect, flip, steps)
    ops = sum(1 for r in after if isinstance(r.event, PromotionRequested))
    flips = sum(1 for r in after if isinstance(r.event, RouteMoved))
    done = load.since(t_fault)
    before = [d for d in load.done if d[0] < t_fault]
    failures = sorted({d[3][:60] for d in done if d[3] != "ok"})
    if failures:
        note += f"; failures: {failures[:3]}"
    return {
        "scenario": scenario,
        "rtt": rtt_ms,
        "detect": detect,
        "decide": None if decide is None or detect is None else decide - detect,
        "flip": flip,
        "cp_ms": cp_ms,
        "cp_rtts": None if cp_ms is None or not rtt_ms else cp_ms / rtt_ms,
        "cp_wall_rtts": None if cp_wall is None or not rtt_ms else cp_wall / rtt_ms,
        "requests": len(done),
        "failed": sum(1 for d in done if d[3].startswith("failed")),
        "cut": sum(1 for d in done if d[3] == "cut"),
        "p99": p99([d[1] - d[0] for d in done]),
        "p99_steady": p99([d[1] - d[0] for d in before]),
        "note": f"{note}; {ops} operations, {flips} flips",
    }


async def fleet_history(rg: Regions, within_s: float = 30.0) -> list:
    """The fleet's events, read through the majority: retried while JetStream elects after a heal."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            async with EventLog.connect(rg.test_urls(), writer="bench") as log:
                return await log.history(subjects.fleet_events(FLEET))
        except (LogUnavailable, LogError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def one_node_cut(rtt_ms: int, root: Path, steady_s: float, tail_s: float) -> dict:
    async def fault(rg: Regions, t_fault: float) -> str:
        rg.isolate_node(1)
        moved = None
        try:
            deadline = time.monotonic() + 30
            while moved is None and time.monotonic() < deadline:
                if any(connected_to(rg, r, f"agent:{FLEET}/a@") for r in (2, 3)):
                    moved = time.monotonic() - t_fault
                await asyncio.sleep(0.1)
            await asyncio.sleep(3)
        finally:
            rg.rejoin_node(1)
        return "agent a never left its node" if moved is None else f"agent a moved after {moved:.1f} s"

    return await faulted(rtt_ms, root, steady_s, tail_s, "d", fault)


async def flapping(rtt_ms: int, root: Path, steady_s: float, tail_s: float) -> dict:
    async def fault(rg: Regions, t_fault: float) -> str:
        flaps = 0
        try:
            while time.monotonic() - t_fault < 30:
                rg.partition(1)
                flaps += 1
                await asyncio.sleep(5)
                rg.heal_partition(1)
                await asyncio.sleep(3)
        finally:
            if 1 in rg.down:
                rg.heal_partition(1)
        return f"{flaps} flaps of region 1's link"

    return await faulted(rtt_ms, root, steady_s, tail_s, "f", fault)


if __name__ == "__main__":
    asyncio.run(main())
