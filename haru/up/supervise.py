"""The children `haru up` keeps running: nats-server, the projector, the promoter, the sink and the agents.

start_agent(layout, domain, ...), start_service(kind, ...)   each a `haru` child process (`Child`), in a
                                                             session of its own with a parent-death signal
keep_running(child, stopping)                                restarts it whenever it dies, with backoff,
                                                             saying why (`haru.core.restarts`)
stop_children(kids, timeout), stop_agents(agents)            SIGTERM (agents SIGINT), then SIGKILL the
                                                             stragglers' process groups
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from haru.core.restarts import POLICY, RestartPolicy, exit_reason, next_restart
from haru.core.specs import Layout
from haru.host import children
from haru.host.natsd import free_port
from haru.up.home import RUN_DIR

log = structlog.get_logger("haru.up.supervise")

# The folder that holds the `haru` package (a checkout's root, or site-packages): the children's PYTHONPATH.
REPO_ROOT = Path(__file__).resolve().parents[2]
AGENT_STOP_S = 20.0
SERVICE_STOP_S = 10.0
POLL_S = 0.2
# What each child gets when haru up dies (`haru.host.children`): SIGKILL, see `_spawn_python`. None: nothing
# (`UpOptions.death_signals`, tests only), so a test can leave real orphans behind.
DEATH_SIGNAL = signal.SIGKILL


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {
        **os.environ,
        **(extra or {}),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])),
    }


@dataclass
class Child:
    """A child process kept running: how to (re)start it, and the one running now."""

    name: str  # "agent a", "projector", "promoter", "nats-server"
    log_path: Path
    restart: Callable[[Child], Awaitable[subprocess.Popen]]  # starts it again, as `child` now says
    proc: subprocess.Popen | None = None
    restarts: int = 0
    domain: str = ""  # agents only
    metrics_port: int | None = None  # its Prometheus endpoint (haru/host/metrics.py), if it has one

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics" if self.metrics_port else ""


def _spawn_python(
    args: list[str], *, name: str, home: Path, log_path: Path, env: dict[str, str], death_signal: int | None
) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    out = open(log_path, "ab")
    try:
        # SIGKILL when haru up dies: NATS dies with it, so nothing could be recorded on the way out, and
        # each of these is built to be killed (the log is the truth; the next start reconciles). A
        # SIGTERM would leave an agent retrying its last appends against a log that is gone.
        return children.spawn(
            [sys.executable, "-m", "haru.cli", *args],
            death_signal=death_signal,
            pidfile=home / RUN_DIR / f"{name.replace(' ', '-')}.pid",
            what=name,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=str(REPO_ROOT),
        )
    finally:
        out.close()


def _agent_config(
    layout: Layout, domain: str, nats_url: str, home: Path, metrics_port: int | None = None, gpus: str = "sim"
) -> dict[str, object]:
    conf: dict[str, object] = {
        "fleet": layout.fleet,
        "domain": domain,
        "nats_url": nats_url,
        "gpus": gpus,
        "sim_dir": str(home / "sim" / domain),
        "state_dir": str(home / "demo" / "agents" / domain),
    }
    if metrics_port is not None:
        conf["metrics_port"] = metrics_port
    return conf


def _prepare_sim_host(layout: Layout, domain: str, home: Path) -> None:
    from haru.agents.sim.gpu_state import SimGpuState

    d = layout.domain(domain)
    assert d is not None
    sim_dir = home / "sim" / domain
    sim_dir.mkdir(parents=True, exist_ok=True)
    for gpu in d.spec.gpus:
        state = SimGpuState(sim_dir, gpu.index)
        state.ensure(gpu.memory_bytes, gpu.name or "sim-gpu")
        state.set_present(True)  # a new demo starts with every GPU attached


def start_agent(
    layout: Layout,
    domain: str,
    nats_url: str,
    home: Path,
    metrics_port: int | None = None,
    gpus: str = "sim",
    death_signal: int | None = DEATH_SIGNAL,
) -> Child:
    if gpus == "sim":
        _prepare_sim_host(layout, domain, home)
    conf_dir = home / "demo" / "agents"
    conf_dir.mkdir(parents=True, exist_ok=True)
    conf = conf_dir / f"{domain}.json"
    written = {"port": metrics_port}

    def write_conf(port: int | None) -> None:
        conf.write_text(json.dumps(_agent_config(layout, domain, nats_url, home, port, gpus), indent=2))
        written["port"] = port

    write_conf(metrics_port)
    log_path = conf_dir / f"{domain}.log"
    env = _child_env(
        {
            "HARU_SIM_DIR": str(home / "sim" / domain),
            "HARU_SIM_DOMAIN": domain,
            "HARU_HOME": str(home),  # the agent's model store is $HARU_HOME/models (layouts may name references)
        }
    )
    env.pop("HARU_METRICS_PORT", None)  # haru up's own port: each agent's is in its config
    name = f"agent {domain}"

    async def restart(child: Child) -> subprocess.Popen:
        # a restarted agent finds its GPUs as the provider left them: no _prepare_sim_host here
        if child.metrics_port != written["port"]:  # moved off a port taken meanwhile; else the file is as it is
            write_conf(child.metrics_port)
        return _spawn_python(
            ["agent", "--config", str(conf), "--log-format", "json"],
            name=name,
            home=home,
            log_path=log_path,
            env=env,
            death_signal=death_signal,
        )

    proc = _spawn_python(
        ["agent", "--config", str(conf), "--log-format", "json"],
        name=name,
        home=home,
        log_path=log_path,
        env=env,
        death_signal=death_signal,
    )
    return Child(name, log_path, restart, proc, domain=domain, metrics_port=metrics_port)


def start_service(
    kind: str, nats_url: str, home: Path, metrics_port: int | None = None, death_signal: int | None = DEATH_SIGNAL
) -> Child:
    """The projector or the promoter, as `haru projector` / `haru promoter` children (each with its own
    metrics endpoint on `metrics_port`, which `haru up`'s own endpoint gathers)."""
    log_path = home / "logs" / f"{kind}.log"
    # the Postgres read model: its DSN stays in the environment (DATABASE_URL), never on the argv
    args = ["sink", "postgres", "--log-format", "json"] if kind == "sink" else [kind, "--log-format", "json"]
    if kind == "promoter":
        # stable across restarts: a restarted promoter resumes its own unfinished step at once
        args += ["--id", f"promoter:{socket.gethostname()}:up"]

    def argv(port: int | None) -> list[str]:
        return args + (["--metrics-port", str(port)] if port is not None else [])

    # the URL by environment, not argv: a URL with a password would be readable in `ps` otherwise
    env = _child_env({"HARU_NATS_URL": nats_url})
    env.pop("HARU_METRICS_PORT", None)  # haru up's own port: the child's is on its command line

    async def restart(child: Child) -> subprocess.Popen:
        return _spawn_python(
            argv(child.metrics_port), name=kind, home=home, log_path=log_path, env=env, death_signal=death_signal
        )

    return Child(
        kind,
        log_path,
        restart,
        _spawn_python(argv(metrics_port), name=kind, home=home, log_path=log_path, env=env, death_signal=death_signal),
        metrics_port=metrics_port,
    )


async def stop_children(kids: list[Child], timeout: float, sig: int = signal.SIGTERM) -> None:
    """SIGTERM each child (an agent records what it unloads and reaps its runtimes), then SIGKILL the
    stragglers' process groups; whatever a child left in its group goes with it."""
    for c in kids:
        if c.proc is not None and c.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                c.proc.send_signal(sig)
    deadline = time.monotonic() + timeout
    for c in kids:
        if c.proc is None:
            continue
        while c.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if c.proc.poll() is None:
            log.warning("up.child_killed", child=c.name, after_s=timeout)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(c.proc.pid, signal.SIGKILL)


async def stop_agents(agents: list[Child], timeout: float = AGENT_STOP_S) -> None:
    """SIGINT: an agent stopping for good unloads its runtimes (SIGTERM would leave them for a next agent)."""
    await stop_children(agents, timeout, sig=signal.SIGINT)


async def keep_running(
    child: Child,
    stopping: Callable[[], bool],
    policy: RestartPolicy = POLICY,
    on_restart: Callable[[], None] | None = None,
) -> None:
    """Restart `child` whenever it dies (until `stopping()` says haru up is stopping), with backoff, saying why."""
    failures = 0
    started = time.monotonic()
    while True:
        while child.proc is not None and child.proc.poll() is None:
            await asyncio.sleep(POLL_S)
        if stopping():
            return
        why = exit_reason(child.proc.returncode) if child.proc is not None else "failed to start"
        failures, delay, looping = next_restart(policy, failures, time.monotonic() - started)
        fields = dict(
            child=child.name, why=why, restart_in_s=delay, failures_in_a_row=failures, log=str(child.log_path)
        )
        if looping:
            log.error(
                "up.crash_loop",
                **fields,
                message=f"{child.name} keeps dying ({failures} times in a row, each within "
                f"{policy.stable_s:.0f}s of starting): backing off {delay:.1f}s; its log says why",
            )
        else:
            log.warning("up.child_died", **fields)
        await asyncio.sleep(delay)
        if stopping():
            return
        started = time.monotonic()
        if child.metrics_port and not port_free(child.metrics_port):
            # something else took its metrics port while it was down: a restart on it would die at once, forever
            chosen = free_port()
            log.warning("up.metrics_port_busy", child=child.name, port=child.metrics_port, using=chosen)
            child.metrics_port = chosen
        try:
            child.proc = await child.restart(child)
        except Exception as exc:  # noqa: BLE001 - counted as a quick death, backed off, retried
            log.error("up.restart_failed", child=child.name, error=str(exc) or repr(exc))
            child.proc = None
            continue
        child.restarts += 1
        log.warning("up.child_restarted", child=child.name, pid=child.proc.pid, restarts=child.restarts)
        if on_restart is not None:
            on_restart()
