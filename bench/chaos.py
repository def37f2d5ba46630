"""Chaos: a bounded chat load through `haru up --demo` while its parts are SIGKILLed one at a time.

    .venv/bin/python bench/chaos.py [--clients 8] [--observe-s 15] [--faults "agent a,projector,promoter,nats-server"]

One real `haru up --demo` (its own home and free ports); 8 chat clients (each one request at a
time, `qwen3-0.6b`, through the gateway) and one event writer (appends with expected sequences on
`haru.evt.chaos.w.agent`, every acknowledged sequence remembered). Once chat is steady, each fault
in turn: SIGKILL the child (its pid from `$HARU_HOME/up.json`), watch for `--observe-s`, wait until
chat is steady again. Printed per fault: requests sent and failed in the window, the failure window
(first failed request sent -> last failed request answered, 0 when none failed), and acknowledged
events lost (stored events checked against the writer's acks after each fault). Goals from issue
16: 0 lost; a failure window <= 2 s for every fault.

`agent a` is the active domain's agent: its runtimes and its serving port outlive it (issue 14), so
chat waits for `haru up` to restart it and the new agent to adopt them; only requests it was
forwarding at the kill can fail.
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
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp

from haru.core import subjects
from haru.core.errors import LogError
from haru.core.events import AgentStopping
from haru.host.natsd import free_port
from haru.log.eventlog import EventLog

MODEL = "qwen3-0.6b"
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}).encode()
WRITER_SUBJECT = subjects.agent("chaos", "w")


@dataclass
class Load:
    requests: list[tuple[float, float, bool]] = field(default_factory=list)  # (sent, answered, ok)
    acked: dict[int, bytes] = field(default_factory=dict)
    stop: asyncio.Event = field(default_factory=asyncio.Event)


def demo_layout(dst: Path) -> Path:
    doc = json.loads((REPO / "deploy" / "examples" / "demo-fleet.json").read_text())
    for domain in doc["domains"]:
        domain["serving_url"] = f"http://127.0.0.1:{free_port()}"
        for slot in domain["slots"]:
            for model in slot.get("models", []):
                model["port"] = free_port()
    dst.write_text(json.dumps(doc))
    return dst


@contextlib.asynccontextmanager
async def demo_up(root: Path, layout: Path | None = None):
    """`haru up --demo` on free ports, its home under `root`, until it is ready: yields (ready-file
    info, home). SIGTERM on the way out (after the caller's own clean-up). chaos, rolling and growth
    share it."""
    home, ready = root / "home", root / "ready.json"
    env = {**os.environ, "HARU_HOME": str(home)}
    for name in ("HARU_NATS_URL", "HARU_API_TOKEN", "HARU_NO_PDEATHSIG"):
        env.pop(name, None)  # the real behaviour: no test-only switches
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "haru.cli",
            "up",
            "--demo",
            "--nats-port",
            "0",
            "--port",
            str(free_port()),
            "--layout",
            str(layout or demo_layout(root / "demo.json")),
            "--ready-file",
            str(ready),
            "--log-format",
            "json",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(root / "up.err", "wb"),
        env=env,
        cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            if time.monotonic() > deadline or up.poll() is not None:
                raise SystemExit(f"haru up did not start:\n{(root / 'up.err').read_text()[-3000:]}")
            await asyncio.sleep(0.2)
        yield json.loads(ready.read_text()), home
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()


async def chat_client(url: str, load: Load) -> None:
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        while not load.stop.is_set():
            sent = time.monotonic()
            ok = False
            try:
                async with s.post(
                    url + "/v1/chat/completions", data=BODY, headers={"Content-Type": "application/json"}
                ) as r:
                    await r.read()
                    ok = r.status == 200
            except (TimeoutError, aiohttp.ClientError):
                ok = False
            load.requests.append((sent, time.monotonic(), ok))
            await asyncio.sleep(0.02 if ok else 0.05)


async def writer(nats_url: str, load: Load) -> None:
    log = await EventLog.open(nats_url, writer="chaos", timeout=2.0)
    try:
        expect, n = 0, 0
        while not load.stop.is_set():
            n += 1
            body = f'"append {n}"'.encode()
            event = AgentStopping(at=datetime.now(UTC), by="chaos", domain="w", reason=f"append {n}")
            try:
                expect = await log.append(WRITER_SUBJECT, event, expect=expect)
                load.acked[expect] = body
            except LogError:
                await asyncio.sleep(0.2)
                with contextlib.suppress(LogError):
                    expect = await log.last_seq_of(WRITER_SUBJECT)  # the failed one may have landed
            await asyncio.sleep(0.01)
    finally:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await log.close()


async def lost_events(nats_url: str, acked: dict[int, bytes]) -> int:
    async with EventLog.connect([nats_url], writer="chaos-check") as log:
        stored = {r.seq: r.data for r in await log.history(WRITER_SUBJECT)}
    return sum(1 for seq, body in acked.items() if seq not in stored or body not in stored[seq])


async def steady(load: Load, seconds: float, timeout: float) -> bool:
    """Until every request sent in the last `seconds` succeeded (and some were sent)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        now = time.monotonic()
        recent = [ok for sent, _, ok in load.requests if sent >= now - seconds]
        if len(recent) > 5 and all(recent):
            return True
    return False


def window(load: Load, start: float, end: float) -> tuple[int, int, float]:
    reqs = [r for r in load.requests if start <= r[0] < end]
    failed = [r for r in reqs if not r[2]]
    if not failed:
        return len(reqs), 0, 0.0
    return len(reqs), len(failed), max(r[1] for r in failed) - min(r[0] for r in failed)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--observe-s", type=float, default=15.0)
    ap.add_argument("--faults", default="agent a,projector,promoter,nats-server")
    args = ap.parse_args()

    load = Load()
    tasks: list[asyncio.Task] = []
    with tempfile.TemporaryDirectory(prefix="haru-chaos-") as tmp:
        async with demo_up(Path(tmp)) as (info, home):
            try:
                tasks = [asyncio.create_task(chat_client(info["gateway_url"], load)) for _ in range(args.clients)]
                tasks.append(asyncio.create_task(writer(info["nats_url"], load)))
                if not await steady(load, 3.0, 120):
                    raise SystemExit("chat never became steady")
                print(f"haru up --demo steady: {args.clients} chat clients, 1 event writer", flush=True)
                print(
                    f"{'fault':<14} {'requests':>8} {'failed':>7} {'window_s':>9} {'acked':>7} {'lost':>5}  recovered"
                )
                for fault in [f.strip() for f in args.faults.split(",") if f.strip()]:
                    pid = json.loads((home / "up.json").read_text())["children"][fault]
                    t0 = time.monotonic()
                    os.kill(pid, signal.SIGKILL)
                    await asyncio.sleep(args.observe_s)
                    recovered = await steady(load, 3.0, 120)
                    sent, failed, span = window(load, t0, t0 + args.observe_s)
                    lost = await lost_events(info["nats_url"], dict(load.acked))
                    print(
                        f"{fault:<14} {sent:>8} {failed:>7} {span:>9.2f} {len(load.acked):>7} {lost:>5}  "
                        f"{'yes' if recovered else 'NO'}",
                        flush=True,
                    )
            finally:
                await stop_load(load, tasks)


async def stop_load(load: Load, tasks: list[asyncio.Task]) -> None:
    """Stop the chat clients and writer, waiting a bounded time for each."""
    load.stop.set()
    for t in tasks:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(t, 15)


if __name__ == "__main__":
    asyncio.run(main())
