"""`haru up`: the whole control plane in one process, and with `--demo` a fleet that fails over on a laptop.

    haru up                     embedded nats-server (store under $HARU_HOME, default ~/.haru), streams
                                ensured, then projector + promoter + gateway in this process
    haru up --nats-url URL      the same against an existing NATS (or cluster)
    haru up --demo              also applies deploy/examples/demo-fleet.json and runs two agents
                                (domains a and b) on simulated GPUs, as child processes
    haru up --demo --real       the same fleet shape on real llama-servers (CPU, tiny generated
                                models): deploy/examples/demo-fleet-real.json

Ctrl-C or SIGTERM stops everything in order (agents first, so they record what they unload and reap
their runtimes; then the services; then nats-server) and leaves no child process behind.
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
from dataclasses import dataclass, field
from typing import Any
from datetime import datetime, timezone
from pathlib import Path

import structlog

from haru import apply as apply_mod
from haru.errors import ConfigError
from haru.eventlog import EventLog
from haru.layout import parse_layout
from haru.natsd import NatsServer, free_port
from haru.specs import Layout
from haru.tasks import cancel_and_wait

log = structlog.get_logger("haru.up")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_LAYOUT = REPO_ROOT / "deploy" / "examples" / "demo-fleet.json"
REAL_DEMO_LAYOUT = REPO_ROOT / "deploy" / "examples" / "demo-fleet-real.json"
DEFAULT_NATS_PORT = 4222
NATS_URL_FILE = "nats.url"  # `haru status` and friends read it when no --nats-url is given
AGENT_STOP_S = 20.0


def haru_home(explicit: str | None = None) -> Path:
    return Path(os.path.expanduser(explicit or os.environ.get("HARU_HOME") or "~/.haru"))


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# ----------------------------------------------------------------------------------------- demo


def demo_layout(home: Path, path: Path = DEMO_LAYOUT) -> Layout:
    """The demo layout made runnable here: a leading "python" becomes this interpreter, and
    checkpoints live under $HARU_HOME."""
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(
            f"cannot read the demo layout {path}: {exc.strerror}; run from a checkout installed with "
            "`pip install -e .`, or pass --layout deploy/examples/demo-fleet.json"
        ) from None
    py = sys.executable
    for domain in doc.get("domains", []):
        for slot in domain.get("slots", []):
            if slot.get("kind") == "training":
                cmd = slot.get("command", [])
                if cmd and cmd[0] == "python":
                    slot["command"] = [py, *cmd[1:]]
                slot["checkpoint_dir"] = str(home / "demo" / "checkpoints" / domain["name"] / slot["name"])
            for model in slot.get("models", []):
                binary = model.get("binary", [])
                if binary and binary[0] == "python":
                    model["binary"] = [py, *binary[1:]]
                if "agents.sim.vllm" in binary and "vram" in model:
                    # the simulated runtime holds what the model declares, so the sim GPU's numbers
                    # are the planner's: the standby cannot wake its models with training still running
                    model["env"] = {"HARU_SIM_VRAM": str(model["vram"]), **model.get("env", {})}
                if model.get("runtime") == "llama_server":
                    _real_llama_model(model, home)
    return parse_layout(doc)


def _real_llama_model(model: dict, home: Path) -> None:
    """A llama-server model of a demo layout made runnable here: the binary built (or found) by
    `agents.runtimes.llama_build`, and a relative `.gguf` source written as a tiny seeded model
    under $HARU_HOME/demo/models (the file name picks the seed: both domains get the same weights)."""
    import zlib

    from agents.runtimes.llama_build import ensure_binary
    from agents.runtimes.tiny_model import write_tiny_model

    if model.get("binary", ["llama-server"]) in ([], ["llama-server"]):
        model["binary"] = [str(ensure_binary(build=True))]
    source = str(model.get("source", ""))
    if source.endswith(".gguf") and not os.path.isabs(source):
        path = home / "demo" / "models" / source
        if not path.exists():
            write_tiny_model(path, seed=zlib.crc32(source.encode()) & 0xFFFF, name=Path(source).stem)
        model["source"] = str(path)


FRESH_PARTS = ("nats", "sim", "demo")  # what `haru up --demo` keeps between runs under $HARU_HOME


def fresh_start(home: Path, now: datetime | None = None) -> Path | None:
    """`haru up --demo --fresh`: move the state a previous demo left (its event log, simulated GPUs, agents)
    to `$HARU_HOME/previous/<UTC time>/`, never deleting it. None when there was nothing to move.
    Raises ConfigError when a `haru up` is running on this home."""
    url_file = home / NATS_URL_FILE
    if url_file.exists():
        url = url_file.read_text().strip()
        try:
            host, port = url.rsplit("//", 1)[-1].rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=0.5):
                pass
        except (OSError, ValueError):
            pass  # a stale file from an up that was killed
        else:
            raise ConfigError(f"a `haru up` is running on {home} (NATS at {url}); stop it before --fresh, or pass "
                              "--home for another state directory")
    parts = [home / p for p in FRESH_PARTS if (home / p).exists()]
    if not parts:
        return None
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    dest = home / "previous" / stamp
    dest.mkdir(parents=True, exist_ok=True)
    for p in parts:
        os.replace(p, dest / p.name)
    return dest


@dataclass
class AgentProcess:
    domain: str
    proc: subprocess.Popen
    log_path: Path


def _agent_config(layout: Layout, domain: str, nats_url: str, home: Path, gpus: str = "sim") -> dict:
    return {
        "fleet": layout.fleet,
        "domain": domain,
        "nats_url": nats_url,
        "gpus": gpus,
        "sim_dir": str(home / "sim" / domain),
        "state_dir": str(home / "demo" / "agents" / domain),
    }


def _prepare_sim_host(layout: Layout, domain: str, home: Path) -> None:
    from agents.sim.gpu_state import SimGpuState

    d = layout.domain(domain)
    assert d is not None
    sim_dir = home / "sim" / domain
    sim_dir.mkdir(parents=True, exist_ok=True)
    for gpu in d.spec.gpus:
        state = SimGpuState(sim_dir, gpu.index)
        state.ensure(gpu.memory_bytes, gpu.name or "sim-gpu")
        state.set_present(True)  # a new demo starts with every GPU attached


def start_agent(layout: Layout, domain: str, nats_url: str, home: Path, gpus: str = "sim") -> AgentProcess:
    if gpus == "sim":
        _prepare_sim_host(layout, domain, home)
    conf_dir = home / "demo" / "agents"
    conf_dir.mkdir(parents=True, exist_ok=True)
    conf = conf_dir / f"{domain}.json"
    conf.write_text(json.dumps(_agent_config(layout, domain, nats_url, home, gpus), indent=2))
    log_path = conf_dir / f"{domain}.log"
    env = {
        **os.environ,
        "HARU_SIM_DIR": str(home / "sim" / domain),
        "HARU_SIM_DOMAIN": domain,
        "HARU_HOME": str(home),  # the agent's model store is $HARU_HOME/models (layouts may name references)
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])),
    }
    out = open(log_path, "ab")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "haru.cli", "agent", "--config", str(conf), "--log-format", "json"],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=str(REPO_ROOT),
            start_new_session=True,  # Ctrl-C reaches us; we stop the agents in order
        )
    finally:
        out.close()
    return AgentProcess(domain, proc, log_path)


async def stop_agents(agents: list[AgentProcess], timeout: float = AGENT_STOP_S) -> None:
    """SIGTERM each agent (it records what it unloads and reaps its runtimes), then SIGKILL stragglers."""
    for a in agents:
        if a.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                a.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for a in agents:
        while a.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if a.proc.poll() is None:
            log.warning("up.agent_killed", domain=a.domain, after_s=timeout)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(a.proc.pid, signal.SIGKILL)
            a.proc.wait()
        # whatever the agent left in its process group goes with it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(a.proc.pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------- up


@dataclass
class UpOptions:
    home: Path
    nats_url: str | None = None
    nats_port: int = DEFAULT_NATS_PORT
    demo: bool = False
    gateway_host: str | None = None
    gateway_port: int | None = None
    layout_path: Path = DEMO_LAYOUT
    ready_file: Path | None = None  # written (JSON) once everything is up: for scripts and tests
    services: tuple[str, ...] = ("projector", "promoter", "gateway")
    # `haru serve`: this fleet instead of the demo's, its agents' GPUs ("sim" or "nvml"), and a hook run
    # once the fleet is applied (it records the pulls that preceded it)
    layout: Layout | None = None
    agent_gpus: str = "sim"
    after_apply: Any = None


@dataclass
class Running:
    nats_url: str
    gateway_url: str = ""
    agents: list[AgentProcess] = field(default_factory=list)


async def up(opts: UpOptions, stop: asyncio.Event) -> Running:
    """Run until `stop` is set; return what ran. Raises HaruError subclasses for what cannot start."""
    from gateway.config import from_env
    from gateway.server import Gateway
    from haru.promoter.service import run_promoter
    from projections.projector import Projector

    opts.home.mkdir(parents=True, exist_ok=True)
    url_file = opts.home / NATS_URL_FILE
    async with contextlib.AsyncExitStack() as stack:
        if opts.nats_url:
            nats_url = opts.nats_url
        else:
            port = opts.nats_port
            if port and not _port_free(port):
                chosen = free_port()
                log.warning("up.nats_port_busy", port=port, using=chosen,
                            hint="another nats-server or `haru up` is running; this one uses a free port")
                port = chosen
            server = NatsServer(opts.home / "nats", port=port)
            await server.start()
            stack.push_async_callback(server.stop)
            nats_url = server.url
            url_file.write_text(nats_url + "\n")
            stack.callback(lambda: url_file.unlink(missing_ok=True))
        running = Running(nats_url=nats_url)

        events = await EventLog.open(nats_url, writer="up")
        stack.push_async_callback(events.close)
        await events.ensure()

        layout = opts.layout
        if opts.demo:
            layout = demo_layout(opts.home, opts.layout_path)
        if layout is not None:
            result = await apply_mod.apply(events, layout, datetime.now(timezone.utc),
                                           by="up:demo" if opts.demo else "up:serve")
            log.info("up.applied", fleet=layout.fleet, events=len(result.events))
            if opts.after_apply is not None:
                await opts.after_apply(events, layout)

        tasks: list[asyncio.Task] = []
        stack.push_async_callback(_cancel_all, tasks)
        if "projector" in opts.services:
            tasks.append(asyncio.create_task(Projector(events).run(), name="projector"))
        if "promoter" in opts.services:
            promoter_ready = asyncio.Event()
            tasks.append(asyncio.create_task(
                run_promoter(events, identity=f"promoter:{socket.gethostname()}:up", ready=promoter_ready),
                name="promoter"))
        if "gateway" in opts.services:
            config = from_env(os.environ, host=opts.gateway_host, port=opts.gateway_port)
            gw = Gateway(config, events)
            await stack.enter_async_context(gw)
            running.gateway_url = gw.url

        if layout is not None:
            for d in layout.domains:
                running.agents.append(start_agent(layout, d.spec.name, nats_url, opts.home, opts.agent_gpus))
            stack.push_async_callback(stop_agents, running.agents)

        _banner(running, opts, layout)
        if opts.ready_file:
            opts.ready_file.write_text(json.dumps({
                "nats_url": running.nats_url, "gateway_url": running.gateway_url,
                "agents": {a.domain: a.proc.pid for a in running.agents}, "pid": os.getpid()}))

        watchers = [asyncio.create_task(stop.wait(), name="stop")] + tasks
        done, _ = await asyncio.wait(watchers, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t.get_name() != "stop" and not t.cancelled() and t.exception() is not None:
                log.error("up.service_failed", service=t.get_name(), error=repr(t.exception()))
        watchers[0].cancel()
        for a in running.agents:
            if a.proc.poll() is not None:
                log.warning("up.agent_exited", domain=a.domain, status=a.proc.returncode, log=str(a.log_path))
        log.info("up.stopping")
    return running


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    await cancel_and_wait(*tasks)


def redact(urls: str) -> str:
    """NATS URLs without their passwords, for printing."""
    import re

    return re.sub(r"//([^:/@,]+):[^@/,]*@", r"//\1:***@", urls)


def _banner(running: Running, opts: UpOptions, layout: Layout | None) -> None:
    out = sys.stdout
    out.write(f"haru up: NATS {redact(running.nats_url)}" + ("" if opts.nats_url else f" (embedded, store {opts.home / 'nats'})") + "\n")
    if running.gateway_url:
        out.write(f"haru up: gateway {running.gateway_url}  (OpenAI-compatible: {running.gateway_url}/v1)\n")
    if layout is not None:
        models = ", ".join(m.name for m in layout.domains[0].models)
        out.write(f"haru up: {'demo ' if opts.demo else ''}fleet {layout.fleet!r}: domains {', '.join(d.spec.name for d in layout.domains)}; "
                  f"models {models}\n")
        out.write(f"haru up: agent logs in {opts.home / 'demo' / 'agents'}; try `haru status` in another terminal\n")
    out.write("haru up: Ctrl-C stops everything\n")
    out.flush()
