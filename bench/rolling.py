"""Change without an outage: chat through `haru up --demo` while the active domain's agent restarts,
and while a layout change rolls through the standby.

    .venv/bin/python bench/rolling.py [--clients 8] [--phase-s 10] [--restarts 3] [--skip-restarts]

One real `haru up --demo` (its own home and free ports; simulated vLLM runtimes); `--clients` chat
clients through the gateway, each one request at a time. Phases, in one run and on the same load:

    baseline   nothing happens for --phase-s
    sigterm    the active domain's agent gets SIGTERM --restarts times (haru up restarts it; the new
               agent adopts the runtimes and takes the serving port from its holder)
    sigkill    the same with SIGKILL (an agent that crashed)
    rolling    a layout change that would interrupt the chatted model on the active domain (its
               context length, on both domains), applied as `haru apply` does it: the declarations,
               then a `rolling` operation through the standby (apply there, wake, probe, flip, apply
               to the old active, settle); the phase lasts until the operation ends

Printed per phase: requests, failed, p50 and p99 latency, p99 / baseline p99, the model_loading
events the phase caused on the active domain (0 = nothing reloaded), and the promotions requested
(`haru up` backs off restarting an agent that keeps dying: 0.2 s doubling, so a later restart can
outlast the demo's 3 s heartbeat timeout and the promoter fails over to the standby meanwhile). For
the rolling phase, `loading` counts the changed model reloading on the old active (expected: 1) and
`failovers` the promotions requested beside the rolling operation (expected: 0); its outcome and
duration are printed after the table. Goals (issue 14): 0 failed, p99 within 2x of the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


from haru.core import subjects
from haru.log.eventlog import EventLog

sys.path.insert(0, str(REPO / "bench"))
from chaos import MODEL, Load, chat_client, demo_layout, demo_up, steady, stop_load


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def phase(load: Load, start: float, end: float) -> tuple[int, int, float, float]:
    reqs = [r for r in load.requests if start <= r[0] < end]
    lat = [(a - s) * 1000 for s, a, ok in reqs if ok]
    return len(reqs), sum(1 for r in reqs if not r[2]), pct(lat, 50), pct(lat, 99)


async def counts(nats_url: str, fleet: str, domain: str) -> tuple[int, int]:
    """(model_loading events on `domain`, promotions requested in the fleet) so far."""
    async with EventLog.connect([nats_url], writer="rolling-check") as log:
        recs = await log.history(f"haru.evt.{fleet}.{domain}.model.>")
        ops = await log.history(subjects.op(fleet))
    return (
        sum(1 for r in recs if r.event is not None and type(r.event).__name__ == "ModelLoading"),
        sum(1 for r in ops if r.event is not None and type(r.event).__name__ == "PromotionRequested"),
    )


async def settled(nats_url: str, fleet: str, timeout_s: float) -> str:
    """Wait (outside any timed phase) until no operation is in flight and the standby may take over: a
    SIGKILL phase can end in a failover whose old active is recovered and demoted only seconds later,
    and a rolling change through an ineligible standby is refused. Returns '' or what still waits."""
    from haru.log.requests import current_view

    deadline = time.monotonic() + timeout_s
    why = "no view"
    async with EventLog.connect([nats_url], writer="rolling-check") as log:
        while time.monotonic() < deadline:
            got = await current_view(log, fleet)
            if got is not None:
                view = got[0]
                standby = view.standby()
                dv = view.domains.get(standby) if standby else None
                if view.operation is not None and view.operation.state == "running":
                    why = f"{view.operation.kind} {view.operation.op_id} in flight"
                elif dv is None or not dv.eligible or dv.reachable is not True:
                    why = f"standby {standby or '?'} not eligible or not reachable"
                else:
                    return ""
            await asyncio.sleep(0.5)
    return why


async def roll_a_change(nats_url: str, home: Path, layout_path: Path, *, timeout_s: float) -> str:
    """Change the chatted model's context length on both domains, as `haru apply` does (the declarations,
    then the rolling operation it requests), and wait for the operation to end. Returns one line on it."""
    import msgspec

    from haru.core.apply import waits_on_active
    from haru.log.apply import apply
    from haru.log.requests import request_operation
    from haru.up.demo_layout import demo_layout as runnable

    layout = runnable(home, layout_path)  # the layout as `haru up` applied it (interpreter, checkpoints)
    domains = []
    for d in layout.domains:
        models = [
            msgspec.structs.replace(m, context_length=(m.context_length or 8192) * 2) if m.name == MODEL else m
            for m in d.models
        ]
        domains.append(msgspec.structs.replace(d, models=models))
    changed = msgspec.structs.replace(layout, domains=domains)
    async with EventLog.connect([nats_url], writer="cli:bench-rolling") as log:
        now = datetime.now(UTC)
        route = await log.last(subjects.route(layout.fleet))
        active = route.event.active if route is not None and route.event is not None else ""
        result = await apply(log, changed, now, by="cli:bench-rolling")
        waiting = waits_on_active(result.events, active)
        if not waiting:
            return f"rolling: nothing waits on the active domain {active!r} ({len(result.events)} declaration(s))"
        t0 = time.monotonic()
        req = await request_operation(
            log,
            layout.fleet,
            "rolling",
            "",
            by="cli:bench-rolling",
            now=now,
            reason="layout_changed",
            detail=", ".join(waiting),
        )
        if req.status != "accepted":
            return f"rolling: not requested ({req.status}: {req.message})"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for rec in reversed(await log.history(subjects.op(layout.fleet), from_seq=req.seq)):
                if getattr(rec.event, "op_id", "") == req.op_id and type(rec.event).__name__ in (
                    "OperationCompleted",
                    "OperationAborted",
                ):
                    outcome = type(rec.event).__name__.removeprefix("Operation").lower()
                    return (
                        f"rolling {req.op_id}: {outcome} in {time.monotonic() - t0:.1f} s "
                        f"({', '.join(waiting)} changed; active {active} -> the standby)"
                    )
            await asyncio.sleep(0.2)
        return f"rolling {req.op_id}: not finished after {timeout_s:.0f} s"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--phase-s", type=float, default=10.0)
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--skip-restarts", action="store_true", help="only the baseline and the rolling phase")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="haru-rolling-") as tmp:
        root = Path(tmp)
        layout = demo_layout(root / "demo.json")
        fleet = json.loads(layout.read_text())["fleet"]
        load = Load()
        tasks: list[asyncio.Task] = []
        async with demo_up(root, layout) as (info, home):
            try:
                tasks = [asyncio.create_task(chat_client(info["gateway_url"], load)) for _ in range(args.clients)]
                if not await steady(load, 3.0, 120):
                    raise SystemExit("chat never became steady")
                nats_url = info["nats_url"]
                print(f"haru up --demo steady: {args.clients} chat clients", flush=True)
                print(
                    f"{'phase':<9} {'requests':>8} {'failed':>7} "
                    f"{'p50_ms':>7} {'p99_ms':>7} {'p99_x':>6} {'loading':>8} "
                    f"{'failovers':>9}"
                )
                base_p99 = None
                rolled = ""
                phases = (
                    ("baseline", "rolling") if args.skip_restarts else ("baseline", "sigterm", "sigkill", "rolling")
                )
                for name in phases:
                    if name == "rolling":
                        waits = await settled(nats_url, fleet, 120)
                        if waits:
                            print(
                                f"rolling: the fleet did not settle in 120 s ({waits}); requesting anyway", flush=True
                            )
                    before = await counts(nats_url, fleet, "a")
                    t0 = time.monotonic()
                    if name == "baseline":
                        await asyncio.sleep(args.phase_s)
                    elif name == "rolling":
                        rolled = await roll_a_change(nats_url, home, layout, timeout_s=300)
                    else:
                        sig = signal.SIGTERM if name == "sigterm" else signal.SIGKILL
                        for _ in range(args.restarts):
                            pid = json.loads((home / "up.json").read_text())["children"]["agent a"]
                            os.kill(pid, sig)
                            # haru up restarts it; wait for the new one before the next signal
                            while True:
                                await asyncio.sleep(0.2)
                                with contextlib.suppress(OSError, ValueError, KeyError):
                                    now_pid = json.loads((home / "up.json").read_text())["children"]["agent a"]
                                    if now_pid != pid:
                                        break
                            await asyncio.sleep(args.phase_s / args.restarts)
                    t1 = time.monotonic()
                    sent, failed, p50, p99 = phase(load, t0, t1)
                    base_p99 = base_p99 or p99
                    after = await counts(nats_url, fleet, "a")
                    print(
                        f"{name:<9} {sent:>8} {failed:>7} {p50:>7.1f} {p99:>7.1f} {p99 / base_p99:>6.2f} "
                        f"{after[0] - before[0]:>8} {after[1] - before[1]:>9}",
                        flush=True,
                    )
                if rolled:
                    print(rolled, flush=True)
            finally:
                await stop_load(load, tasks)


if __name__ == "__main__":
    asyncio.run(main())
