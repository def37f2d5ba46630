"""Helpers for the agent's integration tests: layouts on the simulator, agents as real subprocesses."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from haru.agents.sim.gpu_state import GiB, SimGpuState
from haru.core import subjects

PY = sys.executable
SIM_VLLM = [PY, "-m", "haru.agents.sim.vllm"]
REPO = Path(__file__).resolve().parents[2]

FAST_POLICY = {
    "probe_interval_ms": 200,
    "restart_backoff_ms": 200,
    "restart_backoff_max_ms": 1000,
    "training_grace_ms": 1000,
    "heartbeat_timeout_ms": 3000,
    "probe_timeout_ms": 2000,
    "wake_timeout_ms": 10000,
}


def sim_model(name: str, sim_dir: Path, domain: str, *, vram: str = "4GiB", load_ms: int = 200, **env: str) -> dict:
    e = {
        "HARU_SIM_DIR": str(sim_dir),
        "HARU_SIM_DOMAIN": domain,
        "HARU_SIM_VRAM": vram,
        "HARU_SIM_LOAD_MS": str(load_ms),
        "HARU_SIM_WAKE_MS": "50",
        "HARU_SIM_SLEEP_MS": "20",
        "HARU_SIM_TOKENS_PER_S": "2000",
        "HARU_SIM_GPU_INDEX": "0",
    }
    e.update(env)
    return {"name": name, "runtime": "vllm", "vram": vram, "source": f"sim/{name}", "binary": SIM_VLLM, "env": e}


def trainer_slot(
    sim_dir: Path, ckpt: Path, *, vram: str = "8GiB", extra: list[str] | None = None, grace_ms: int = 0
) -> dict:
    slot = {
        "name": "lora",
        "kind": "training",
        "gpu": 0,
        "command": [PY, "-m", "haru.agents.sim.trainer", "--vram", vram, "--sim-dir", str(sim_dir), *(extra or [])],
        "checkpoint_dir": str(ckpt),
        "vram": vram,
    }
    if grace_ms:
        slot["grace_ms"] = grace_ms
    return slot


def write_layout(
    path: Path,
    tmp: Path,
    *,
    models: dict[str, dict] | None = None,
    training: dict | None = None,
    policy: dict | None = None,
    fleet: str = "f",
) -> Path:
    """Two mirrored domains a and b, one 24 GiB GPU each, the sim host of domain d at tmp/sim/d."""
    domains = []
    for d in ("a", "b"):
        sim_dir = tmp / "sim" / d
        sim_dir.mkdir(parents=True, exist_ok=True)
        SimGpuState(sim_dir, 0).ensure(24 * GiB)
        ms = [sim_model(name, sim_dir, d, **(kw or {})) for name, kw in (models or {"m1": {}}).items()]
        slots = [{"name": "chat", "gpu": 0, "models": ms}]
        if training is not None:
            slots.append(trainer_slot(sim_dir, tmp / "ckpt" / d, **training))
        domains.append({"name": d, "gpus": [{"index": 0, "memory": "24GiB", "reserve": "1GiB"}], "slots": slots})
    doc = {"fleet": fleet, "policy": {**FAST_POLICY, **(policy or {})}, "domains": domains}
    path.write_text(json.dumps(doc))
    return path


def write_config(
    path: Path, nats_url: str, tmp: Path, *, domain: str = "a", layout: Path | None = None, fleet: str = "f", **extra
) -> Path:
    cfg = {
        "nats_url": nats_url,
        "fleet": fleet,
        "domain": domain,
        "gpus": "sim",
        "sim_dir": str(tmp / "sim" / domain),
        "serving": {"host": "127.0.0.1", "port": 0},
        "state_dir": str(tmp / "state" / domain),
    }
    if layout is not None:
        cfg["layout"] = str(layout)
    cfg.update(extra)
    path.write_text(json.dumps(cfg))
    return path


class AgentProcess:
    def __init__(self, config: Path, log_path: Path, env: dict[str, str]) -> None:
        self.config = config
        self.log_path = log_path
        self.env = env
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [PY, "-m", "haru.cli", "agent", "--config", str(config), "--log-format", "json"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(REPO),
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    async def wait(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"agent did not exit in {timeout}s; output:\n{self.output()[-4000:]}")
            await asyncio.sleep(0.05)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the agent, then what outlives an agent by design (its runtimes and its serving
        port's holder): a test ends with nothing of it left."""
        if self.proc.poll() is None:
            with_suppress(lambda: os.killpg(self.proc.pid, signal.SIGKILL))
            self.proc.wait(10)
        self._log.close()
        if self.state_dir is not None:
            kill_runtimes(self.state_dir)

    @property
    def state_dir(self) -> Path | None:
        """The agent config's `state_dir` (None: the config names none, or is gone)."""
        try:
            state_dir = json.loads(self.config.read_text()).get("state_dir")
        except (OSError, ValueError):
            return None
        return Path(state_dir) if state_dir else None


def kill_agents(procs: list[AgentProcess]) -> None:
    """`kill` each agent of a test's fleet (its runtimes and port holder too), whatever happens to the others."""
    for p in procs:
        try:
            p.kill()
        except Exception:  # noqa: BLE001 - one agent's teardown must not leave the next one running
            pass


def kill_runtimes(state_dir: Path) -> list[int]:
    """SIGKILL the process group of every runtime an agent left in `state_dir` (its identity files,
    when the recorded process is still the one started), and stop its serving port's holder. Runtimes
    and the holder outlive their agent on purpose (a restart adopts them); a test that wants them gone
    with the agent kills them here. Returns the runtime pids signalled."""
    from haru.agents.portholder import stop_holder
    from haru.agents.runtime_files import read_identities
    from haru.host.procfs import stat

    killed = []
    for _path, doc in read_identities(state_dir).values():
        if doc is None:
            continue
        pid = int(doc["pid"])
        st = stat(pid)
        if st is not None and st.start == int(doc["start"]):
            with_suppress(lambda pid=pid: os.killpg(pid, signal.SIGKILL))
            killed.append(pid)
    stop_holder(state_dir)
    return killed


def with_suppress(fn) -> None:
    try:
        fn()
    except (ProcessLookupError, PermissionError):
        pass


def agent_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("HARU_SERVING_TOKEN", None)
    env.update(extra)
    return env


async def wait_event(log, subject_filter: str, pred, *, timeout: float = 20.0, agent: AgentProcess | None = None):
    """The first record on `subject_filter` matching `pred`, polling until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        for rec in await log.history(subject_filter):
            if rec.event is not None and pred(rec):
                return rec
        if time.monotonic() > deadline:
            tags = [
                (r.seq, r.subject, type(r.event).__struct_config__.tag if r.event else r.error)
                for r in await log.history(subject_filter)
            ]
            out = agent.output()[-6000:] if agent else ""
            raise AssertionError(f"no matching event on {subject_filter} in {timeout}s; saw {tags}\n{out}")
        if agent is not None and agent.proc.poll() is not None:
            raise AssertionError(f"the agent exited ({agent.proc.returncode}):\n{agent.output()[-6000:]}")
        await asyncio.sleep(0.1)


def tag(rec) -> str:
    return type(rec.event).__struct_config__.tag


def is_(name: str, **fields):
    def pred(rec) -> bool:
        if tag(rec) != name:
            return False
        return all(getattr(rec.event, k) == v for k, v in fields.items())

    return pred


async def model_tags(log, fleet: str, domain: str, model: str) -> list[str]:
    return [tag(r) for r in await log.history(subjects.model(fleet, domain, model))]


async def sim_fault(base_url: str, fault: str) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{base_url}/_sim/{fault}") as r:
            assert r.status == 200, await r.text()


async def get_json(url: str, **kw):
    async with aiohttp.ClientSession() as s:
        async with s.get(url, **kw) as r:
            return r.status, await r.json(content_type=None)
