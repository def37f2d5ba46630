"""A simulated vLLM server run as a child process for the tests (`SimServer`), and the model it serves."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import aiohttp

from haru.agents.sim.vllm import runtime_path

MODEL = "qwen3.6:27b"


class SimServer:
    """One `python -m haru.agents.sim.vllm serve` child, reaped however the test ends."""

    def __init__(
        self,
        sim_dir: Path,
        *,
        model: str = MODEL,
        domain: str = "a",
        dev_mode: bool = True,
        sleep_mode: bool = True,
        args: tuple[str, ...] = (),
        **env: str,
    ) -> None:
        self.sim_dir, self.model, self.domain = sim_dir, model, domain
        self.env = {
            **os.environ,
            "HARU_SIM_DIR": str(sim_dir),
            "HARU_SIM_DOMAIN": domain,
            "HARU_SIM_LOAD_MS": "100",
            "HARU_SIM_WAKE_MS": "30",
            "HARU_SIM_SLEEP_MS": "10",
            "HARU_SIM_VRAM": "4GiB",
            "HARU_SIM_TOKENS_PER_S": "1000",
        }
        self.env.pop("VLLM_SERVER_DEV_MODE", None)
        if dev_mode:
            self.env["VLLM_SERVER_DEV_MODE"] = "1"
        self.env.update(env)
        self.argv = [
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
            model,
            "--gpu-memory-utilization",
            "0.9",
        ]
        if sleep_mode:
            self.argv.append("--enable-sleep-mode")
        self.argv += args
        self.proc: asyncio.subprocess.Process | None = None
        self.stderr_path = sim_dir / f"stderr-{domain}.log"
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text() if self.stderr_path.exists() else ""

    async def start(self, *, wait_ready: bool = True) -> SimServer:
        self.sim_dir.mkdir(parents=True, exist_ok=True)
        with open(self.stderr_path, "wb") as err:
            self.proc = await asyncio.create_subprocess_exec(*self.argv, env=self.env, stdout=err, stderr=err)
        rt = runtime_path(self.sim_dir, self.model)
        deadline = time.monotonic() + 20
        while True:
            if rt.exists():
                with contextlib.suppress(ValueError, OSError):  # OSError: removed by a server that just exited
                    info = json.loads(rt.read_text())
                    if info["pid"] == self.proc.pid:
                        self.port = info["port"]
                        break
            if self.proc.returncode is not None or time.monotonic() > deadline:
                return self
            await asyncio.sleep(0.01)
        if wait_ready:
            await self.wait_ready()
        return self

    async def wait_ready(self) -> None:
        deadline = time.monotonic() + 20
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                with contextlib.suppress(aiohttp.ClientConnectionError):
                    async with s.get(self.url + "/health") as r:
                        if r.status == 200:
                            return
                await asyncio.sleep(0.02)
        raise AssertionError(f"sim server never became healthy: {self.stderr}")

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
