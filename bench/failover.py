"""Failover latency: from the active's loss being appended to `route_moved` acked.

    .venv/bin/python bench/failover.py [--runs 5] [--wake-ms 400] [--stop-ms 300] [--probe-tokens-per-s 20]

Real nats-server, two real agents (subprocesses) on the simulator, the promoter in this process.
The simulated work has set durations: training ignores SIGTERM so stopping it takes exactly the
grace (`--stop-ms`), a level-1 wake takes `--wake-ms`, a probe is one token at
`--probe-tokens-per-s`. Each run detaches the active's GPU (a `gpu_detached` loss fails the active
at once), measures, then gives the GPU back and waits for the old active to be the standby again.

Printed per run and as medians: each step's wall time (its step_started to its step_completed) and
the agents' own took_ms, the total (loss recorded -> route_moved recorded, both JetStream
timestamps), and the control-plane overhead = total - the agents' took_ms for the steps before the
flip (target: <= 50 ms). Heartbeat-silence detection is reported separately: the active's agent is
SIGKILLed and the time from its last heartbeat to `domain_unreachable` is measured, then that
failover's total.

An aborted-then-retried failover: the standby's runtime is made to fail its next wake once
(`/_sim/oom_on_wake`, as a wake does when memory a killed trainer held is not back yet), the active's
GPU is detached, the first promotion aborts at its wake step, and the promoter retries it after
`failover_retry_ms` (policy; not after max(degraded_grace_ms, heartbeat_timeout_ms), 60 s here).
Printed: abort -> route_moved, against the retry's own steps and the backoff (goal <= 2 s plus the
retry's steps).

Three domains (`--domains 3`): a serves, b and c are ranked standbys (b first). Each case runs in a
fresh world (nats-server, three agents on the simulator), `--runs` times:

- baseline: a's GPU is detached, the failover goes to b (what a single standby gives);
- first-ranked dead, not yet noticed: b's agent is SIGKILLed just before a's GPU is detached, so the
  promotion targets b (its heartbeats are not yet overdue), b's first command finds no agent, and the
  same operation moves on to c (`promotion_retargeted`);
- first-ranked dead, noticed: b is already `unreachable` when a fails: the ranking skips it, c is promoted;
- first-ranked hung: b's agent is SIGSTOPped (alive to the OS, answering nothing), so its first
  command runs into its bound (training_grace_ms + command_timeout_ms) before the move to c.

Printed: each case's loss -> route_moved against the baseline, and the goal: <= the baseline plus
one probe timeout (policy probe_timeout_ms).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from haru.agents.sim.gpu_state import GiB, SimGpuState
from haru.core import ranking, subjects
from haru.core.events import (
    DomainUnreachable,
    GpuObserved,
    ModelLoading,
    ModelLost,
    OperationAborted,
    PromotionRequested,
    RouteMoved,
    StepCompleted,
    StepStarted,
)
from haru.core.fold import empty, fold
from haru.core.layout import load_layout
from haru.core.residency import Resident, Sleeping
from haru.host.natsd import NatsServer
from haru.log.apply import apply
from haru.log.eventlog import EventLog
from haru.promoter.service import Promoter
from tests.support.agent_harness import kill_runtimes

FLEET = "bench"
PY = sys.executable
BEFORE_FLIP = ("stop_training", "verify_gpu", "wake", "probe")


def write_layout(root: Path, args, names: str = "ab", policy: dict | None = None) -> Path:
    domains = []
    for d in names:
        sim = root / "sim" / d
        sim.mkdir(parents=True, exist_ok=True)
        SimGpuState(sim, 0).ensure(24 * GiB)
        env = {
            "HARU_SIM_DIR": str(sim),
            "HARU_SIM_DOMAIN": d,
            "HARU_SIM_VRAM": "4GiB",
            "HARU_SIM_LOAD_MS": "200",
            "HARU_SIM_WAKE_MS": str(args.wake_ms),
            "HARU_SIM_SLEEP_MS": "50",
            "HARU_SIM_TOKENS_PER_S": str(args.probe_tokens_per_s),
            "HARU_SIM_GPU_INDEX": "0",
        }
        domains.append(
            {
                "name": d,
                "gpus": [{"index": 0, "memory": "24GiB", "reserve": "1GiB"}],
                "slots": [
                    {
                        "name": "chat",
                        "gpu": 0,
                        "models": [
                            {
                                "name": "m1",
                                "runtime": "vllm",
                                "vram": "4GiB",
                                "source": "sim/m1",
                                "binary": [PY, "-m", "haru.agents.sim.vllm"],
                                "env": env,
                            }
                        ],
                    },
                    {
                        "name": "lora",
                        "kind": "training",
                        "gpu": 0,
                        "vram": "8GiB",
                        "grace_ms": args.stop_ms,
                        "command": [
                            PY,
                            "-m",
                            "haru.agents.sim.trainer",
                            "--vram",
                            "8GiB",
                            "--sim-dir",
                            str(sim),
                            "--ignore-sigterm",
                        ],
                        "checkpoint_dir": str(root / "ckpt" / d),
                    },
                ],
            }
        )
    doc = {
        "fleet": FLEET,
        "policy": {
            "heartbeat_timeout_ms": 1500,
            "degraded_grace_ms": 60000,
            "probe_interval_ms": 100,
            "restart_backoff_ms": 200,
            "training_grace_ms": args.stop_ms,
            **(policy or {}),
        },
        "domains": domains,
    }
    path = root / "layout.json"
    path.write_text(json.dumps(doc))
    return path


def start_agent(root: Path, url: str, domain: str, layout: Path) -> subprocess.Popen:
    cfg = {
        "nats_url": url,
        "fleet": FLEET,
        "domain": domain,
        "gpus": "sim",
        "sim_dir": str(root / "sim" / domain),
        "serving": {"host": "127.0.0.1", "port": 0},
        "state_dir": str(root / "state" / domain),
        "layout": str(layout),
    }
    path = root / f"agent-{domain}.json"
    path.write_text(json.dumps(cfg))
    log = open(root / f"agent-{domain}.log", "ab")
    # The bench SIGKILLs the active's agent and never restarts it: its runtimes and port holder outlive it
    # (as they outlive a restarted agent in production), so the bench kills them itself (kill_runtimes).
    env = {**os.environ, "PYTHONPATH": str(REPO), "HARU_NO_UVLOOP": "1"}
    return subprocess.Popen(
        [PY, "-m", "haru.cli", "agent", "--config", str(path), "--log-format", "json"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=str(REPO),
        start_new_session=True,
    )


async def view_of(log):
    records = await log.history(subjects.fleet_events(FLEET))
    return fold((r.seq, r.subject, r.event) for r in records).get(FLEET, empty(FLEET))


def steady(view, active: str) -> bool:
    standby = "b" if active == "a" else "a"
    if view.operation is not None or view.active != active or not view.domains[standby].eligible:
        return False
    act, sb = view.domains[active], view.domains[standby]
    return (
        all(isinstance(m.residency, Resident) for m in act.models.values())
        and all(isinstance(m.residency, Sleeping) for m in sb.models.values())
        and all(t.running for t in sb.training.values())
    )


async def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await check()
        if got:
            return got
        await asyncio.sleep(0.05)
    raise SystemExit(f"bench: timed out after {timeout}s waiting for {what}")


async def measure(log, from_seq: int, loss_type) -> dict:
    """The failover after `from_seq`: the loss record, the steps, and route_moved."""
    recs = await log.history(subjects.fleet_events(FLEET), from_seq=from_seq)
    # The first sign of the loss: a GPU observed gone, or the model lost / the domain unreachable.
    loss = next(
        r
        for r in recs
        if isinstance(r.event, loss_type) or (isinstance(r.event, GpuObserved) and r.event.present is False)
    )
    route = next(r for r in recs if isinstance(r.event, RouteMoved))
    op_id = route.event.op_id
    request = next(r for r in recs if isinstance(r.event, PromotionRequested) and r.event.op_id == op_id)
    steps: dict[str, dict] = {}
    for r in recs:
        e = r.event
        if isinstance(e, StepStarted) and e.op_id == op_id:
            steps.setdefault(e.step, {})["started"] = r.time
        elif isinstance(e, StepCompleted) and e.op_id == op_id:
            steps.setdefault(e.step, {}).update(completed=r.time, took_ms=e.took_ms, detail=e.detail)
    total = (route.time - loss.time).total_seconds() * 1000
    work = sum(steps[s].get("took_ms", 0) for s in BEFORE_FLIP if s in steps)
    return {
        "total_ms": total,
        "work_ms": work,
        "overhead_ms": total - work,
        "decide_ms": (request.time - loss.time).total_seconds() * 1000,
        "steps": {
            s: {
                "wall_ms": (v["completed"] - v["started"]).total_seconds() * 1000,
                "agent_ms": v.get("took_ms", 0),
                "detail": v.get("detail", ""),
            }
            for s, v in steps.items()
            if "completed" in v and "started" in v
        },
        "route_seq": route.seq,
        "active": route.event.active,
    }


async def main(args) -> None:
    root = Path(tempfile.mkdtemp(prefix="haru-bench-failover-"))
    agents: dict[str, subprocess.Popen] = {}
    async with NatsServer(root / "nats") as server:
        async with EventLog.connect([server.url], writer="bench") as log:
            await log.ensure()
            layout = write_layout(root, args)
            await apply(log, load_layout(layout), datetime.now(UTC))
            for d in ("a", "b"):
                agents[d] = start_agent(root, server.url, d, layout)
            plog = await EventLog.open([server.url], writer="promoter:bench")
            promoter = Promoter(plog, identity="promoter:bench")
            task = asyncio.create_task(promoter.run())
            heard: dict[str, float] = {}

            async def on_hb(msg) -> None:
                heard[msg.subject.rsplit(".", 1)[1]] = time.time()

            await log.bus.subscribe(subjects.heartbeats(FLEET), on_hb)
            try:

                async def is_steady(active):
                    return steady(await view_of(log), active)

                await wait_for(lambda: is_steady("a"), 60, "the first route")
                # Baseline: one NATS request/reply round trip to an agent (status), the floor of a step.
                from haru.core.commands import Command
                from haru.log.bus import send

                rtts = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    await send(log.bus, FLEET, "b", "status", Command(), timeout=5.0)
                    rtts.append((time.perf_counter() - t0) * 1000)
                rtt = statistics.median(rtts)

                runs = []
                active = "a"
                for i in range(args.runs):
                    standby = "b" if active == "a" else "a"
                    start = await log.last_seq()
                    gpu = SimGpuState(root / "sim" / active, 0)
                    gpu.set_present(False)
                    await wait_for(
                        lambda standby=standby: is_steady_route(log, standby), 30, f"run {i}: route to {standby}"
                    )
                    m = await measure(log, start + 1, ModelLost)
                    runs.append(m)
                    print_run(i, active, standby, m)
                    gpu.set_present(True)
                    await wait_for(lambda standby=standby: is_steady(standby), 60, f"run {i}: {active} standby again")
                    active = standby

                retried = await abort_then_retry(log, root, active)
                active = "b" if active == "a" else "a"

                # Heartbeat silence: SIGKILL the active's agent.
                standby = "b" if active == "a" else "a"
                start = await log.last_seq()
                os.killpg(agents[active].pid, signal.SIGKILL)
                agents[active].wait()
                killed_at = time.time()
                kill_runtimes(root / "state" / active)  # its runtimes outlive it by design: not in this bench
                await wait_for(lambda: is_steady_route(log, standby), 30, "failover after heartbeat silence")
                recs = await log.history(subjects.fleet_events(FLEET), from_seq=start + 1)
                unreachable = next(r for r in recs if isinstance(r.event, DomainUnreachable))
                hb = await measure(log, start + 1, DomainUnreachable)
                silent_ms = (unreachable.time.timestamp() - heard.get(active, killed_at)) * 1000

                print()
                print("median over", len(runs), "gpu_detached failovers:")
                for step in ("stop_training", "verify_gpu", "wake", "probe", "flip"):
                    walls = [r["steps"][step]["wall_ms"] for r in runs if step in r["steps"]]
                    agent = [r["steps"][step]["agent_ms"] for r in runs if step in r["steps"]]
                    if walls:
                        print(
                            f"  {step:<14} wall {statistics.median(walls):7.1f} "
                            f"ms   agent {statistics.median(agent):7.1f} ms"
                        )
                total = statistics.median(r["total_ms"] for r in runs)
                work = statistics.median(r["work_ms"] for r in runs)
                over = statistics.median(r["overhead_ms"] for r in runs)
                decide = statistics.median(r["decide_ms"] for r in runs)
                print(f"  loss -> route_moved      {total:7.1f} ms")
                print(
                    f"  simulated work (agents)  {work:7.1f} ms   (stop "
                    f"{args.stop_ms} + wake {args.wake_ms} + probe + verify)"
                )
                print(
                    f"  control-plane overhead   {over:7.1f} ms   target <= 50 ms: {'met' if over <= 50 else 'NOT met'}"
                )
                print(f"    of which loss -> promotion_requested {decide:.1f} ms")
                print(
                    f"  baseline: agent request/reply round trip {rtt:.2f} "
                    f"ms; overhead = {over / rtt:.1f} round trips; "
                    f"total / work = {total / work:.3f}"
                )
                print()
                print("aborted then retried failover (the standby's first wake fails once):")
                backoff = retried["backoff_ms"]
                print(f"  promotion aborted at {retried['aborted_step']} ({retried['error'][:80]})")
                print(
                    f"  abort -> route_moved        {retried['abort_to_route_ms']:7.1f} ms   (attempt "
                    f"{retried['attempt']}; backoff {backoff} ms + the retry's steps {retried['retry_work_ms']} ms)"
                )
                print(
                    f"  goal <= 2000 ms + the retry's steps: "
                    f"{'met' if retried['abort_to_route_ms'] <= 2000 + retried['retry_work_ms'] else 'NOT met'}; "
                    f"before: the retry waited retry_ms = {retried['old_retry_ms']} ms "
                    f"({retried['old_retry_ms'] / max(1.0, retried['abort_to_route_ms']):.0f}x this)"
                )
                print()
                print("heartbeat silence (active's agent SIGKILLed):")
                print(f"  last heartbeat -> domain_unreachable   {silent_ms:7.1f} ms   (heartbeat_timeout_ms 1500)")
                print(
                    "  domain_unreachable -> route_moved       "
                    f"{hb['total_ms']:7.1f} ms   overhead {hb['overhead_ms']:.1f} ms"
                )
            finally:
                await stop_world(task, plog, agents, root)


async def abort_then_retry(log, root: Path, active: str) -> dict:
    """Make the standby's next wake fail once, detach the active's GPU, and measure abort -> route_moved."""
    import aiohttp

    from haru.promoter.failover import failover_retry_ms, retry_ms

    standby = "b" if active == "a" else "a"
    loads = [
        r
        for r in await log.history(subjects.model(FLEET, standby, "m1"))
        if isinstance(r.event, ModelLoading) and r.event.endpoint
    ]
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{loads[-1].event.endpoint}/_sim/oom_on_wake") as r:
            assert r.status == 200, await r.text()
    start = await log.last_seq()
    gpu = SimGpuState(root / "sim" / active, 0)
    gpu.set_present(False)
    await wait_for(lambda: is_steady_route(log, standby), 60, "the retried failover's route")
    recs = await log.history(subjects.fleet_events(FLEET), from_seq=start + 1)
    abort = next(r for r in recs if isinstance(r.event, OperationAborted))
    route = next(r for r in recs if isinstance(r.event, RouteMoved))
    retry = next(r for r in recs if isinstance(r.event, PromotionRequested) and r.event.op_id == route.event.op_id)
    work = sum(
        r.event.took_ms
        for r in recs
        if isinstance(r.event, StepCompleted) and r.event.op_id == route.event.op_id and r.event.step in BEFORE_FLIP
    )
    view = await view_of(log)
    failed_step = next(
        (r.event.step for r in recs if type(r.event).__name__ == "StepFailed" and r.event.op_id == abort.event.op_id),
        abort.event.step,
    )
    out = {
        "abort_to_route_ms": (route.time - abort.time).total_seconds() * 1000,
        "attempt": retry.event.attempt,
        "retry_work_ms": work,
        "backoff_ms": failover_retry_ms(view.policy, retry.event.attempt - 1),
        "aborted_step": failed_step,
        "error": abort.event.error,
        "old_retry_ms": retry_ms(view.policy),
    }
    gpu.set_present(True)
    await wait_for(lambda: _steady(log, standby), 60, f"{active} standby again after the retried failover")
    return out


async def _steady(log, active: str) -> bool:
    return steady(await view_of(log), active)


async def is_steady_route(log, active: str) -> bool:
    rec = await log.last(subjects.route(FLEET))
    return rec is not None and isinstance(rec.event, RouteMoved) and rec.event.active == active


def print_run(i: int, old: str, new: str, m: dict) -> None:
    steps = "  ".join(
        f"{s} {v['wall_ms']:.0f}/{v['agent_ms']}" for s, v in m["steps"].items() if s in (*BEFORE_FLIP, "flip")
    )
    print(
        f"run {i}: {old} -> {new}: total {m['total_ms']:.1f} ms, work {m['work_ms']} ms, "
        f"overhead {m['overhead_ms']:.1f} ms  [wall/agent ms: {steps}]"
    )
    print(f"        stop_training: {m['steps'].get('stop_training', {}).get('detail', '')}")


# ------------------------------------------------------------------------------------ three domains

THREE = "abc"
# Short command and probe bounds, so that a hung standby's cost is measured in seconds, not minutes.
THREE_POLICY = {"command_timeout_ms": 1000, "probe_timeout_ms": 2000}


def steady_n(view, active: str, names: str) -> bool:
    """`active` serves, every other domain is an eligible standby, asleep and training."""
    if view.operation is not None or view.active != active:
        return False
    if not all(isinstance(m.residency, Resident) for m in view.domains[active].models.values()):
        return False
    for d in names:
        if d == active:
            continue
        dv = view.domains[d]
        if not dv.eligible or dv.reachable is not True:
            return False
        if not (
            all(isinstance(m.residency, Sleeping) for m in dv.models.values())
            and all(t.running for t in dv.training.values())
        ):
            return False
    return True


async def three_domain_case(args, case: str) -> dict:
    """One run of one case in a fresh world; returns its measure (and how many standbys it tried)."""
    from haru.core.events import PromotionRetargeted

    root = Path(tempfile.mkdtemp(prefix=f"haru-bench-failover3-{case}-"))
    agents: dict[str, subprocess.Popen] = {}
    async with NatsServer(root / "nats") as server:
        async with EventLog.connect([server.url], writer="bench") as log:
            await log.ensure()
            layout = write_layout(root, args, THREE, THREE_POLICY)
            await apply(log, load_layout(layout), datetime.now(UTC))
            for d in THREE:
                agents[d] = start_agent(root, server.url, d, layout)
            plog = await EventLog.open([server.url], writer="promoter:bench")
            promoter = Promoter(plog, identity="promoter:bench")
            task = asyncio.create_task(promoter.run())
            try:

                async def is_steady() -> bool:
                    return steady_n(await view_of(log), "a", THREE)

                await wait_for(is_steady, 90, f"{case}: the first route, b and c asleep and training")
                if case == "noticed":
                    os.killpg(agents["b"].pid, signal.SIGKILL)
                    agents["b"].wait()

                    async def b_unreachable() -> bool:
                        return (await view_of(log)).domains["b"].reachable is False

                    await wait_for(b_unreachable, 30, "b unreachable")
                start = await log.last_seq()
                if case == "unnoticed":
                    os.killpg(agents["b"].pid, signal.SIGKILL)
                    agents["b"].wait()
                elif case == "hung":
                    os.killpg(agents["b"].pid, signal.SIGSTOP)
                SimGpuState(root / "sim" / "a", 0).set_present(False)
                want = "b" if case == "baseline" else "c"
                await wait_for(lambda: is_steady_route(log, want), 60, f"{case}: the route to {want}")
                m = await measure(log, start + 1, ModelLost)
                recs = await log.history(subjects.op(FLEET), from_seq=start + 1)
                m["tried"] = [r.event.previous for r in recs if isinstance(r.event, PromotionRetargeted)]
                view = await view_of(log)
                m["probe_timeout_ms"] = view.policy.probe_timeout_ms
                m["protection"] = ranking.protection(view)
                return m
            finally:
                await stop_world(task, plog, agents, root)


async def stop_world(task: asyncio.Task, plog, agents: dict[str, subprocess.Popen], root: Path) -> None:
    """End one world: its heartbeat task, the promoter's log, every agent (woken first if a case SIGSTOPped
    it), the runtimes and port holders they leave by design, and whatever else still runs from its root."""
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    await plog.close()
    for domain, p in agents.items():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGCONT)
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        kill_runtimes(root / "state" / domain)
    _kill_under(root)


def _kill_under(root: Path) -> None:
    """SIGKILL what is left of this world: a SIGKILLed agent's trainer (its own process group) outlives it."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if str(root).encode() in cmdline:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)


async def three_domains(args) -> None:
    cases = ("baseline", "unnoticed", "noticed", "hung")
    results: dict[str, list[dict]] = {c: [] for c in cases}
    for i in range(args.runs):
        for case in cases:
            m = await three_domain_case(args, case)
            results[case].append(m)
            tried = f", tried first {', '.join(m['tried'])}" if m["tried"] else ""
            print(
                f"run {i} {case:<9}: a -> {m['active']}: total {m['total_ms']:7.1f} ms  (work {m['work_ms']} ms, "
                f"overhead {m['overhead_ms']:.1f} ms{tried}; afterwards {m['protection'] or '-'})",
                flush=True,
            )
    base = statistics.median(r["total_ms"] for r in results["baseline"])
    probe_timeout = results["baseline"][0]["probe_timeout_ms"]
    print()
    print(f"three domains, median over {args.runs} run(s) each (loss of a -> route_moved):")
    print(f"  baseline: the first-ranked standby b takes over   {base:8.1f} ms")
    labels = {
        "unnoticed": "b dead, not yet noticed: cascade to c in the same operation",
        "noticed": "b dead and unreachable: the ranking skips it, c promoted",
        "hung": "b hung (SIGSTOP): its first command runs into its bound, then c",
    }
    for case in cases[1:]:
        total = statistics.median(r["total_ms"] for r in results[case])
        extra = total - base
        goal = total <= base + probe_timeout
        print(
            f"  {labels[case]:<62} {total:8.1f} ms  = baseline + {extra:7.1f} ms  ({total / base:.2f}x); "
            f"goal <= baseline + one probe timeout ({probe_timeout} ms): {'met' if goal else 'NOT met'}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--domains",
        type=int,
        default=2,
        choices=(2, 3),
        help="3: the three-domain cases (a dead first-ranked standby) instead of the two-domain bench",
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--wake-ms", type=int, default=400)
    parser.add_argument("--stop-ms", type=int, default=300)
    parser.add_argument("--probe-tokens-per-s", type=float, default=20)
    parsed = parser.parse_args()
    asyncio.run(three_domains(parsed) if parsed.domains == 3 else main(parsed))
