"""A real llama-server for the tests: the binary (built once per machine), tiny models, fleets of them.

`llama_binary()` finds the binary `python -m haru.agents.runtimes.llama_build` built (or
$HARU_LLAMA_SERVER). Tests never build it themselves (a build is ~10 minutes, far past a test's
timeout): `.ci/run` builds or reuses it before pytest and sets HARU_REQUIRE_LLAMA=1, so in CI a
missing binary FAILS the tests; elsewhere they are skipped with the command that builds it.

Every llama-server here runs with one compute thread (`args: --threads 1`), so two domains of them
leave the 2 cores of a CI machine to everything else. Not `--threads-http 1`: one HTTP thread serves
one keep-alive connection at a time, and a second client (the agent's probe beside a chat) waits
for the first connection's 5 s keep-alive timeout (measured: a 5 s stall in bench/runtime.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from datetime import UTC, datetime
from pathlib import Path

import pytest

from haru.agents.runtimes.llama_build import ensure_binary, find_binary
from haru.agents.runtimes.tiny_model import write_tiny_model

LLAMA_ARGS = ["--threads", "1"]
REAL_POLICY = {
    "probe_interval_ms": 500,
    "restart_backoff_ms": 500,
    "restart_backoff_max_ms": 4000,
    "training_grace_ms": 1000,
    "heartbeat_timeout_ms": 3000,
    "probe_timeout_ms": 5000,
    "wake_timeout_ms": 10000,
    "command_timeout_ms": 10000,
}


def llama_binary() -> Path:
    """The llama-server binary, or fail (HARU_REQUIRE_LLAMA=1, as in CI) / skip saying how to build it."""
    try:
        path = find_binary()
    except Exception as exc:  # noqa: BLE001 - a bad HARU_LLAMA_SERVER: say so, whatever the mode
        pytest.fail(str(exc))
    if path is None and os.environ.get("HARU_LLAMA_BUILD") == "1":
        path = ensure_binary(build=True)
    if path is not None:
        return path
    how = (
        "no llama-server binary: build it once with `python -m haru.agents.runtimes.llama_build` (~10 min on 2 "
        "cores, cached per machine) or point HARU_LLAMA_SERVER at one"
    )
    if os.environ.get("HARU_REQUIRE_LLAMA") == "1":
        pytest.fail(f"HARU_REQUIRE_LLAMA=1 and {how}")
    pytest.skip(how)


def tiny_models(root: Path, seeds: dict[str, int]) -> dict[str, Path]:
    """One GGUF per name, each from its own seed (so two domains' answers can be told apart)."""
    return {
        name: write_tiny_model(root / f"{name.replace('/', '_').replace(':', '_')}.gguf", seed=seed)
        for name, seed in seeds.items()
    }


def llama_model(name: str, binary: Path, gguf: Path, **extra) -> dict:
    return {
        "name": name,
        "runtime": "llama_server",
        "vram": "64MiB",
        "context_length": 2048,
        "source": str(gguf),
        "binary": [str(binary)],
        "args": list(LLAMA_ARGS),
        **extra,
    }


def real_layout(
    path: Path,
    tmp: Path,
    domains: dict[str, list[dict]],
    *,
    policy: dict | None = None,
    fleet: str = "default",
    training: bool = False,
) -> Path:
    """Domains of llama-server models, each on one simulated 24 GiB GPU (the GPU is simulated; the
    runtimes are not: llama-server runs on the CPU)."""
    import sys

    from haru.agents.sim.gpu_state import GiB, SimGpuState
    from tests.support.ports import lasting_port

    doc_domains = []
    for d, models in domains.items():
        sim_dir = tmp / "sim" / d
        sim_dir.mkdir(parents=True, exist_ok=True)
        SimGpuState(sim_dir, 0).ensure(24 * GiB)
        slots = [{"name": "chat", "gpu": 0, "models": models}]
        if training:
            slots.append(
                {
                    "name": "lora",
                    "kind": "training",
                    "gpu": 0,
                    "command": [
                        sys.executable,
                        "-m",
                        "haru.agents.sim.trainer",
                        "--vram",
                        "2GiB",
                        "--sim-dir",
                        str(sim_dir),
                    ],
                    "checkpoint_dir": str(tmp / "ckpt" / d),
                    "vram": "2GiB",
                }
            )
        doc_domains.append(
            {
                "name": d,
                "gpus": [{"index": 0, "memory": "24GiB", "reserve": "1GiB"}],
                "slots": slots,
                "serving_url": f"http://127.0.0.1:{lasting_port()}",
            }
        )
    path.write_text(json.dumps({"fleet": fleet, "policy": {**REAL_POLICY, **(policy or {})}, "domains": doc_domains}))
    return path


@contextlib.asynccontextmanager
async def real_fleet(
    tmp_path: Path, nats_server, event_log, layout: Path, *, fleet: str = "default", env: dict[str, str] | None = None
):
    """The layout applied, one agent per domain (real subprocesses, `env` added to theirs), and in this process
    a projector, a promoter and a gateway. Yields the gateway."""
    from haru.core.layout import load_layout
    from haru.gateway.config import GatewayConfig
    from haru.gateway.server import Gateway
    from haru.host.tasks import cancel_and_wait
    from haru.log.apply import apply
    from haru.projections.projector import Projector
    from tests.support.agent_harness import AgentProcess, agent_env, kill_agents, write_config
    from tests.support.promoter import promoters

    spec = load_layout(layout)
    await apply(event_log, spec, datetime.now(UTC))
    procs: list[AgentProcess] = []
    projector = asyncio.create_task(Projector(event_log).run(), name="projector")
    try:
        for d in spec.domains:
            name = d.spec.name
            cfg = write_config(
                tmp_path / f"agent-{name}.json",
                nats_server.url,
                tmp_path,
                domain=name,
                layout=layout,
                fleet=fleet,
                serving={"host": "127.0.0.1", "port": 0},
            )  # the serving_url's port
            procs.append(AgentProcess(cfg, tmp_path / f"agent-{name}.log", agent_env(**(env or {}))))
        async with promoters(nats_server.url):
            async with Gateway(GatewayConfig(port=0), event_log) as gw:
                gw.agents = procs  # for the tests: the agent processes, in domain order
                yield gw
    finally:
        kill_agents(procs)
        await cancel_and_wait(projector)
