"""How fast the log grows: `haru up --demo` for a while, with faults injected, events counted per host.

    .venv/bin/python bench/growth.py [--minutes 60] [--fault-every-s 120]

One real `haru up --demo` (two simulated GPU hosts, `a` and `b`, the projector, the promoter, the gateway). Every
`--fault-every-s` seconds one fault in turn, from the simulator's own set: detach the active host's GPU (and attach it
30 s later), kill a runtime on the standby, SIGKILL the standby's agent (`haru up` restarts it). Every 5 minutes, and at
the end, it prints the events stored so far: per host (everything under `haru.evt.<fleet>.<domain>.`), fleet-level
(decl, op, route, checkpoint), the stream's bytes, and the rates (from what was stored after a baseline taken once the
demo is up) extrapolated to a day and a year per GPU host. The figures in docs/operations.md ("How big the log grows")
come from this.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from chaos import demo_up

from haru.core import subjects
from haru.log.eventlog import EventLog


async def census(nats_url: str) -> tuple[dict[str, int], int, int]:
    """(events per host or 'fleet', stream bytes, stream messages)."""
    async with EventLog.connect([nats_url], writer="bench:growth") as log:
        counts = await log.subject_counts(subjects.ALL_EVENTS)
        info = await log.js.stream_info(subjects.EVENTS_STREAM)
    out: dict[str, int] = {}
    for subject, n in counts.items():
        parts = subject.split(".")
        key = parts[3] if len(parts) >= 5 else "fleet"
        out[key] = out.get(key, 0) + n
    return out, info.state.bytes, info.state.messages


def report(
    label: str, elapsed_s: float, per: dict[str, int], nbytes: int, messages: int, base: tuple[dict[str, int], int, int]
) -> None:
    """Rates from what was stored since `base` (the census once the demo was up: declarations and
    the first route are not growth)."""
    hours = elapsed_s / 3600
    per = {k: v - base[0].get(k, 0) for k, v in per.items()}
    nbytes, messages = nbytes - base[1], messages - base[2]
    hosts = sorted(k for k in per if k != "fleet")
    per_host_h = {h: per[h] / hours for h in hosts}
    mean_h = sum(per_host_h.values()) / max(1, len(hosts))
    fleet_h = per.get("fleet", 0) / hours
    bpe = nbytes / max(1, messages)
    day = (mean_h + fleet_h / max(1, len(hosts))) * 24
    print(
        f"[{label}] {elapsed_s / 60:5.1f} min: {messages} events, {nbytes / 1e6:.2f} MB ({bpe:.0f} B/event); "
        + ", ".join(f"host {h}: {per[h]} ({per_host_h[h]:.0f}/h)" for h in hosts)
        + f"; fleet-level: {per.get('fleet', 0)} ({fleet_h:.0f}/h). Per GPU host (its share of fleet-level "
        f"included): {day:,.0f} events/day, {day * 365:,.0f} events/year, {day * 365 * bpe / 1e9:.2f} GB/year",
        flush=True,
    )


def sim(home: Path, *args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "haru.cli", "sim", *args, "--sim-root", str(home / "sim")],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=30,
    )


async def active_of(nats_url: str) -> str:
    async with EventLog.connect([nats_url], writer="bench:growth") as log:
        rec = await log.last(subjects.route("default"))
    return getattr(rec.event, "active", "a") if rec is not None else "a"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--fault-every-s", type=float, default=120.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="haru-growth-") as tmp:
        async with demo_up(Path(tmp)) as (info, home):
            nats_url = info["nats_url"]
            await asyncio.sleep(20)  # the first route settles
            base = await census(nats_url)
            print(f"baseline once up: {base[2]} events, {base[1] / 1e6:.2f} MB", flush=True)
            t0 = time.monotonic()
            end = t0 + args.minutes * 60
            next_fault, next_report, turn, faults = t0 + args.fault_every_s, t0 + 300, 0, 0
            while time.monotonic() < end:
                now = time.monotonic()
                if now >= next_fault:
                    active = await active_of(nats_url)
                    standby = "b" if active == "a" else "a"
                    kind = turn % 3
                    if kind == 0:
                        sim(home, "detach-gpu", active)
                        await asyncio.sleep(30)
                        sim(home, "attach-gpu", active)
                    elif kind == 1:
                        sim(home, "kill-runtime", standby, "qwen3-0.6b")
                    else:
                        pid = json.loads((home / "up.json").read_text())["children"].get(f"agent {standby}")
                        if pid:
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(pid, signal.SIGKILL)
                    turn += 1
                    faults += 1
                    next_fault = time.monotonic() + args.fault_every_s
                if now >= next_report:
                    report(f"{faults} faults", now - t0, *await census(nats_url), base)
                    next_report += 300
                await asyncio.sleep(1.0)
            report(f"end, {faults} faults", time.monotonic() - t0, *await census(nats_url), base)


if __name__ == "__main__":
    asyncio.run(main())
