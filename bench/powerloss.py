"""Power loss and disk faults under load: one row per fault, the shipped durability and nats-server's default
side by side where it applies.

    .venv/bin/python bench/powerloss.py [--faults a,b,c,d,e] [--acks 100]

Needs FUSE (tests/support/lazyfs.py: every nats-server store on a filesystem that forgets what was never
fsynced). Each row: a fleet declared, `haru projector` running, a router following the route intent
(`RouteWatcher`), and a load (tests/support/powerloss.py): writers appending sequence-checked events and
a promoter-like writer with a promotion always in flight (an operation's steps, the route moving),
recording what its receipts find as the promoter does (`log_regressed`). Then the fault:

  a   single embedded node loses power (the projector on that machine dies with it and restarts)
  b   all three nodes of the shipped cluster lose power at once
  c   the cluster's stream leader loses power while the other two are cut from each other; it restarts
      during the partition, the partition heals
  d   bit flips in one node's HARU_EVENTS block file and its HARU_ROUTE block file cut in half (cluster:
      the leader's node; single: the only one)
  e   single node: the projector is stopped, the power goes right after a flip's acknowledgement, before
      its route intent was published

Reported per row: acknowledged events lost (and how many of them no receipt named), what Haru said (the
writers' receipts, `log_regressed` events in the log, `haru_log_regressions_total`, `haru verify`'s exit
status), the time from the log being back to the projected view and the router's route equal to what
the log holds (the issue's bound: 5 s), and how many route pointers the router was given after the log
was back that the log no longer holds (must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from haru.core import events as ev
from haru.core import subjects
from haru.core.errors import LogError
from haru.core.sizes import GiB
from haru.core.specs import DomainSpec, GpuSpec, Policy
from haru.core.views import view_decoder
from haru.host.natsd import NatsServer
from haru.log.eventlog import EventLog
from haru.log.receipts import RegressionCollector
from haru.log.route import RouteWatcher
from tests.support.lazyfs import LazyFS, fuse_missing
from tests.support.powerloss import FaultCluster, Load, covered, haru_said

FLEET = "pl"
HARU = str(Path(sys.executable).parent / "haru")


# ------------------------------------------------------------------------------------------ targets


class Single:
    """`haru up`'s single embedded node, its store on a lazy filesystem."""

    name = "single"

    def __init__(self, root: Path, sync_interval: str | None) -> None:
        self.root = root
        self.fs = LazyFS(root / "store")
        self.sync_interval = sync_interval
        self.server: NatsServer | None = None

    async def __aenter__(self) -> Single:
        self.fs.mount()
        self.server = NatsServer(self.fs.mountpoint, sync_interval=self.sync_interval, log_file=self.root / "nats.log")
        await self.server.start()
        async with EventLog.connect([self.server.url], writer="admin") as log:
            await log.ensure()
        self.fs.writeback()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.kill()
        self.fs.unmount()

    def urls(self, user: str) -> list[str]:
        assert self.server is not None
        return [self.server.url]

    def log(self, writer: str) -> contextlib.AbstractAsyncContextManager[EventLog]:
        return EventLog.connect(self.urls("admin"), writer=writer, timeout=2.0)


class Clustered:
    name = "cluster"

    def __init__(self, root: Path, sync_interval: str | None) -> None:
        self.fc = FaultCluster(root, sync_always=sync_interval == "always")

    async def __aenter__(self) -> Clustered:
        await self.fc.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.fc.__aexit__(*exc)

    def urls(self, user: str) -> list[str]:
        return self.fc.all_urls(user)

    def log(self, writer: str) -> contextlib.AbstractAsyncContextManager[EventLog]:
        return self.fc.log("admin", writer=writer)


# ------------------------------------------------------------------------------------------ the run


@dataclass
class Run:
    target: Any
    log: EventLog
    root: Path
    load: Load | None = None
    projector: subprocess.Popen | None = None
    notes: list[str] = field(default_factory=list)

    def start_projector(self) -> None:
        n = len(list(self.root.glob("projector-*.log")))
        with open(self.root / f"projector-{n}.log", "ab") as err:
            self.projector = subprocess.Popen(
                [HARU, "projector", "--nats-url", ",".join(self.target.urls("projector"))],
                stdout=subprocess.DEVNULL,
                stderr=err,
            )

    def kill_projector(self) -> None:
        if self.projector is not None and self.projector.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.projector.pid, signal.SIGCONT)
            self.projector.kill()
            self.projector.wait(10)


async def declare_fleet(log: EventLog) -> None:
    s = subjects.decl(FLEET)
    seq = await log.append(s, ev.FleetDeclared(at=datetime.now(UTC), fleet=FLEET, policy=Policy()), expect=0)
    for d in ("a", "b"):
        spec = DomainSpec(name=d, serving_url=f"http://{d}:9000", gpus=[GpuSpec(index=0, memory_bytes=48 * GiB)])
        seq = await log.append(s, ev.DomainDeclared(at=datetime.now(UTC), spec=spec), expect=seq)


async def single_power_loss(run: Run) -> None:
    t: Single = run.target
    assert t.server is not None
    t.server.kill()  # the power goes: nats-server and the projector on that machine, then the page cache
    run.kill_projector()
    dropped = t.fs.power_loss()
    run.notes.append(f"{dropped['bytes']} unsynced bytes dropped")
    await t.server.start()
    run.start_projector()


async def fault_a(run: Run) -> None:
    await single_power_loss(run)


async def fault_e(run: Run) -> None:
    assert run.projector is not None
    os.kill(run.projector.pid, signal.SIGSTOP)  # the projector has not run since the flip
    flips = run.load.flips
    async with asyncio.timeout(30):
        while run.load.flips == flips:
            await asyncio.sleep(0.001)
    await single_power_loss(run)


async def fault_b(run: Run) -> None:
    fc = run.target.fc
    for node in fc.nodes:
        node.kill()
    dropped = sum(disk.power_loss()["bytes"] for disk in fc.disks)
    run.notes.append(f"{dropped} unsynced bytes dropped on 3 nodes")
    await asyncio.to_thread(fc.restart_all)


async def fault_c(run: Run) -> None:
    fc = run.target.fc
    leader = await fc.stream_leader(run.log) or 1
    x, y = (n.index for n in fc.nodes if n.index != leader)
    fc.partition(x, y)
    dropped = fc.power_loss(leader)
    run.notes.append(f"leader {leader} lost power ({dropped['bytes']} bytes) while {x}|{y} cut")
    await asyncio.sleep(3)
    await asyncio.to_thread(fc.restart, leader)
    await run.load.more(20, timeout=60)
    fc.heal(x, y)


async def fault_d_cluster(run: Run) -> None:
    fc = run.target.fc
    victim = await fc.stream_leader(run.log) or 1
    disk = fc.disks[victim - 1]
    fc.nodes[victim - 1].kill()
    damage(run, disk, fc.block_files(victim), fc.block_files(victim, subjects.ROUTE_STREAM))
    await asyncio.to_thread(fc.restart, victim)
    await run.load.more(20, timeout=60)
    admin = await fc.cluster.raw("admin")
    try:
        for stream in (subjects.EVENTS_STREAM, subjects.ROUTE_STREAM):  # the damaged replica may lead
            with contextlib.suppress(Exception):
                await admin.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=5)
    finally:
        await admin.close()


async def fault_d_single(run: Run) -> None:
    t: Single = run.target
    assert t.server is not None
    t.server.kill()
    run.kill_projector()
    mount = t.fs.mountpoint
    files = [str(p.relative_to(mount)) for p in sorted(mount.glob("**/msgs/*.blk"))]
    damage(
        run,
        t.fs,
        [f for f in files if f"/{subjects.EVENTS_STREAM}/" in f],
        [f for f in files if f"/{subjects.ROUTE_STREAM}/" in f],
    )
    await t.server.start()
    run.start_projector()


def damage(run: Run, disk: LazyFS, events_blks: list[str], route_blks: list[str]) -> None:
    flipped = disk.flip_bits(events_blks[0], count=16, seed=35)
    size = (disk.mountpoint / route_blks[0]).stat().st_size
    cut = disk.truncate(route_blks[0], size // 2)
    run.notes.append(
        f"16 bits flipped in {flipped['size']} B of events, route block cut {cut['was']} -> {cut['size']} B"
    )


FAULTS: dict[str, tuple[str, Any, Callable[[Run], Awaitable[None]]]] = {
    "a": ("single node loses power", Single, fault_a),
    "b": ("all three nodes lose power", Clustered, fault_b),
    "c": ("one node's power loss + partition", Clustered, fault_c),
    "d": ("bit flips + truncation, one node", Clustered, fault_d_cluster),
    "d1": ("bit flips + truncation, single node", Single, fault_d_single),
    "e": ("power loss after a flip's ack", Single, fault_e),
}


async def view_route(log: EventLog) -> tuple[int, str] | None:
    got = await log.get_view(subjects.view_key(FLEET))
    if got is None:
        return None
    view = view_decoder.decode(got[0])
    return view.route_revision, view.active


async def route_truth(log: EventLog) -> tuple[int, str] | None:
    rec = await log.last(subjects.route(FLEET))
    if rec is None or not isinstance(rec.event, ev.RouteMoved):
        return None
    return rec.seq, rec.event.active


def verify(urls: list[str]) -> int:
    done = subprocess.run([HARU, "verify", "--nats-url", ",".join(urls)], capture_output=True, text=True, timeout=120)
    return done.returncode


async def row(key: str, sync_interval: str | None, acks: int) -> dict[str, Any]:
    what, kind, fault = FAULTS[key]
    with tempfile.TemporaryDirectory(prefix="haru-powerloss-") as tmp:
        root = Path(tmp)
        async with kind(root / "t", sync_interval) as target:
            async with target.log("promoter:bench") as log:
                log.receipt_guard.record_as()  # as the promoter does: what it finds becomes log_regressed
                await declare_fleet(log)
                run = Run(target, log, root)
                run.start_projector()
                seen: list[tuple[float, int, str | None]] = []
                async with RouteWatcher(target.urls("router"), FLEET, stall_interval=0.5) as router:

                    async def follow() -> None:
                        async for ri in router:
                            seen.append((time.monotonic(), ri.revision, ri.active.domain if ri.active else None))

                    following = asyncio.create_task(follow())
                    await router.wait_for(lambda ri: ri is not None, 60)
                    run.load = Load(log, FLEET)
                    await run.load.until(acks, timeout=120)
                    await fault(run)
                    # the log is back: it answers a read again
                    async with asyncio.timeout(60):
                        while True:
                            with contextlib.suppress(LogError):
                                await log.last_seq()
                                break
                            await asyncio.sleep(0.05)
                    t_back = time.monotonic()
                    with contextlib.suppress(TimeoutError):
                        await run.load.more(20, timeout=30)
                    await run.load.stop()
                    lost = await run.load.lost(log)
                    said = await haru_said(log)
                    async with asyncio.timeout(30):  # the guard's recorder appends after it found
                        while len(said) and not log.receipt_guard.recorded:
                            await asyncio.sleep(0.05)
                    t_quiet = time.monotonic()
                    truth = await route_truth(log)
                    took = None
                    deadline = time.monotonic() + 30
                    # the log holds no route_moved any more: the truth is "never routed" (view: revision 0)
                    viewed_truth = truth if truth is not None else (0, "")
                    routed: tuple[int, str] | None = None
                    viewed: tuple[int, str] | None = None
                    while time.monotonic() < deadline:
                        ri = router.current
                        routed = None if ri is None or ri.active is None else (ri.revision, ri.active.domain)
                        viewed = await view_route(log)
                        if routed == truth and viewed == viewed_truth:
                            took = time.monotonic() - t_quiet
                            break
                        await asyncio.sleep(0.05)
                    if took is None:
                        run.notes.append(f"the log's route {truth}, the router's {routed}, the view's {viewed}")
                    following.cancel()
                    if router.withheld:
                        run.notes.append(f"the router held back {router.withheld} intent(s) naming a lost route_moved")
                    rewound = 0
                    for t, revision, active in seen:
                        if t < t_back or revision == 0 or active is None:  # not a pointer (never routed)
                            continue
                        rec = await log.read_seq(revision)
                        if not (
                            rec is not None and isinstance(rec.event, ev.RouteMoved) and rec.event.active == active
                        ):
                            rewound += 1
                    recorded = [
                        r
                        for r in [await log.last(subjects.integrity(FLEET))]
                        if r is not None and isinstance(r.event, ev.LogRegressed)
                    ]
                    metric = sum(s.value for m in RegressionCollector(log.receipt_guard).collect() for s in m.samples)
                    status = await asyncio.to_thread(verify, target.urls("admin"))
                run.kill_projector()
    return {
        "fault": key,
        "what": what,
        "where": kind.name,
        "config": sync_interval or "default",
        "acked": len(run.load.acked),
        "lost": len(lost),
        "unnamed": len(covered(lost, said)),
        "receipts": len(said),
        "event": len(recorded),
        "metric": metric,
        "verify": status,
        "true_s": took,
        "rewound": rewound,
        "notes": "; ".join(run.notes),
    }


def show(r: dict[str, Any]) -> None:
    true_s = "never (30 s)" if r["true_s"] is None else f"{r['true_s']:.2f} s"
    verdict = (
        "ok" if r["unnamed"] == 0 and r["rewound"] == 0 and r["true_s"] is not None and r["true_s"] <= 5 else "FAILS"
    )
    print(
        f"{r['fault']:<3}{r['what']:<38}{r['where']:<8}{r['config']:<8}{r['acked']:>6}{r['lost']:>6}{r['unnamed']:>8}"
        f"{r['receipts']:>9}{r['event']:>6}{r['metric']:>7.0f}{r['verify']:>7}{true_s:>14}{r['rewound']:>8}  {verdict}",
        flush=True,
    )


HEAD = (
    f"{'':<3}{'fault':<38}{'where':<8}{'config':<8}{'acked':>6}{'lost':>6}{'unnamed':>8}"
    f"{'receipts':>9}{'event':>6}{'metric':>7}{'verify':>7}{'true again':>14}{'rewound':>8}"
)


async def main(faults: list[str], acks: int) -> None:
    plan = []
    for key in faults:
        plan.append((key, "always"))
        if key in ("a", "b", "c", "e"):
            plan.append((key, None))
    print(
        "power loss under load (appends, a promotion in flight): shipped `sync_interval: always` and nats-server's "
        "default side by side\n"
        "lost = acknowledged events the log no longer holds; unnamed = of those, named by no receipt; receipts = "
        "ranges the writer's receipts found; event = log_regressed in the log; metric = haru_log_regressions_total; "
        "verify = `haru verify` exit status (0 ok, 11 lost ranges); true again = view and route equal the log, from "
        "the log back and quiet (bound 5 s); rewound = route pointers given to the router after the log was back "
        "that the log no longer holds\n"
    )
    print(HEAD, flush=True)
    results = []
    for key, sync in plan:
        try:
            r = await row(key, sync, acks)
        except Exception as exc:  # noqa: BLE001 - one fault's harness failing must not hide the other rows
            print(f"{key:<3}{FAULTS[key][0]:<38}{sync or 'default'}: the row failed: {exc!r}", flush=True)
            continue
        results.append(r)
        show(r)
    print()
    for r in results:
        if r["notes"]:
            print(f"{r['fault']} ({r['where']}, {r['config']}): {r['notes']}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", default="a,b,c,d,d1,e")
    p.add_argument("--acks", type=int, default=100, help="acknowledged appends before the fault")
    a = p.parse_args()
    if (why := fuse_missing()) is not None:
        sys.exit(f"bench/powerloss.py needs FUSE: {why}")
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    asyncio.run(main(a.faults.split(","), a.acks))
