"""`haru gateway` and `haru run` as child processes, in front of simulated vLLM upstreams."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from haru.agents.sim.vllm import runtime_path
from haru.core import subjects
from haru.core.residency import Answer, Resident
from haru.core.views import DomainView, FleetView, ModelView, RouteIntent, Target, view_encoder

MODEL = "qwen3.6:27b"


@contextlib.asynccontextmanager
async def sim_vllm(sim_dir: Path, domain: str, *, tokens_per_s: int = 1000):
    """One simulated vLLM server for `domain`; yields its URL; killed however the test ends."""
    sim_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "HARU_SIM_DIR": str(sim_dir),
        "HARU_SIM_DOMAIN": domain,
        "HARU_SIM_LOAD_MS": "50",
        "HARU_SIM_VRAM": "1GiB",
        "HARU_SIM_TOKENS_PER_S": str(tokens_per_s),
    }
    err = open(sim_dir / "stderr.log", "wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "haru.agents.sim.vllm",
        "serve",
        "/models/qwen",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--served-model-name",
        MODEL,
        env=env,
        stdout=err,
        stderr=err,
    )
    try:
        rt = runtime_path(sim_dir, MODEL)
        deadline = time.monotonic() + 20
        port = 0
        while not port:
            assert time.monotonic() < deadline and proc.returncode is None, (sim_dir / "stderr.log").read_text()
            with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
                info = json.loads(rt.read_text())
                if info["pid"] == proc.pid:
                    port = info["port"]
            await asyncio.sleep(0.01)
        url = f"http://127.0.0.1:{port}"
        while True:  # listening only once "loaded"
            with contextlib.suppress(OSError):
                _, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                break
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        yield url
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        err.close()


@contextlib.asynccontextmanager
async def haru_gateway(nats_url: str, tmp_path: Path, **env: str):
    """`haru gateway --port 0` as a child process; yields (url, process)."""
    log_path = tmp_path / "gateway.log"
    out = open(log_path, "wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "haru.cli",
        "gateway",
        "--port",
        "0",
        "--nats-url",
        nats_url,
        "--log-format",
        "json",
        env={**os.environ, "HARU_NO_UVLOOP": "0", **env},
        stdout=out,
        stderr=out,
    )
    try:
        deadline = time.monotonic() + 20
        url = ""
        while not url:
            assert time.monotonic() < deadline and proc.returncode is None, log_path.read_text()
            for line in log_path.read_text().splitlines():
                if line.startswith("haru gateway listening on "):
                    url = line.rsplit(" ", 1)[1]
            await asyncio.sleep(0.02)
        yield url, proc, log_path
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        out.close()


async def publish(
    log, fleet: str, url: str, answer: Answer, *, view_rev: int = 0, intent_seq: int = 0, revision: int = 1
) -> tuple[int, int]:
    model = ModelView(name=MODEL, admitted=True, residency=Resident())
    view = FleetView(
        fleet=fleet,
        domains={"a": DomainView(name="a", serving_url=url, models={MODEL: model})},
        active="a",
        route_revision=revision,
        seq=revision,
    )
    intent = RouteIntent(
        fleet=fleet, revision=revision, active=Target(domain="a", serving_url=url), answers={MODEL: answer}
    )
    rev = await log.put_view(subjects.view_key(fleet), view_encoder.encode(view), last=view_rev)
    seq = await log.publish_intent(fleet, view_encoder.encode(intent), expect=intent_seq)
    return rev, seq


async def run_repl(url: str, stdin: str, *extra: str, env: dict | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "haru.cli",
        "run",
        MODEL,
        "--url",
        url,
        "--fleet",
        "cli",
        *extra,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin.encode()), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode, out.decode(), err.decode()
