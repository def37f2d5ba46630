"""`haru up`: the whole control plane in one process, and with `--demo` a fleet that fails over on a laptop.

    haru up                     embedded nats-server (store under $HARU_HOME, default ~/.haru), streams
                                ensured, then projector + promoter + gateway in this process
    haru up --nats-url URL      the same against an existing NATS (or cluster)
    haru up --demo              also applies the demo layout (haru/up/demo/demo-fleet.json) and runs two agents
                                (domains a and b) on simulated GPUs, as child processes
    haru up --demo --real       the same fleet shape on real llama-servers (CPU, tiny generated
                                models): haru/up/demo/demo-fleet-real.json

The gateway runs in this process; nats-server, the projector, the promoter and the agents are child
processes, each in a session of its own with a parent-death signal (`haru.host.children`), and each
kept running: a child that dies is restarted with backoff, and the log says why it died and when a
crash loop is being backed off (`haru.core.restarts`).

One `haru up` per home. The home is locked (`$HARU_HOME/up.lock`, flock: the OS releases it when
this process dies, however it dies) and `$HARU_HOME/up.json` says who holds it; a second `haru up`
on the same home is refused with the first one's pid and URLs. Children record themselves in
`$HARU_HOME/run/*.pid` (and nats-server in its store), with their /proc start time: a `haru up`
started after a crash stops whatever the last one left alive before it starts anything.

Ctrl-C or SIGTERM stops everything in order (agents first, so they record what they unload and reap
their runtimes; then the services; then nats-server) and leaves no child process behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from haru.core.errors import AlreadyRunning, ConfigError, StoreBusy
from haru.core.layout import parse_layout
from haru.core.restarts import POLICY, RestartPolicy, exit_reason, next_restart
from haru.core.specs import Layout
from haru.host import children, natsd
from haru.host.natsd import NatsServer, free_port
from haru.host.tasks import cancel_and_wait
from haru.log import apply as apply_mod
from haru.log.eventlog import EventLog

log = structlog.get_logger("haru.up.compose")

# The folder that holds the `haru` package (a checkout's root, or site-packages): the children's PYTHONPATH.
REPO_ROOT = Path(__file__).resolve().parents[2]
# The demo layouts ship inside the package (haru/up/demo/, package data), so `haru up --demo` runs
# from an installed wheel; deploy/examples/ keeps the same files for operators to copy.
DEMO_LAYOUT = Path(__file__).resolve().parent / "demo" / "demo-fleet.json"
REAL_DEMO_LAYOUT = Path(__file__).resolve().parent / "demo" / "demo-fleet-real.json"
VLLM_DEMO_LAYOUT = Path(__file__).resolve().parent / "demo" / "demo-fleet-vllm.json"
DEFAULT_NATS_PORT = 4222
NATS_URL_FILE = "nats.url"  # `haru status` and friends read it when no --nats-url is given
AGENT_STOP_S = 20.0
SERVICE_STOP_S = 10.0
LEFTOVER_STOP_S = 10.0
LOCK_FILE = "up.lock"
STATE_FILE = "up.json"
RUN_DIR = "run"
POLL_S = 0.2


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


MAX_DEMO_DOMAINS = 9


def widen(doc: dict[str, Any], domains: int) -> dict[str, Any]:
    """A layout document with `domains` domains (`haru up --demo --domains N`): the first `domains` of
    it, and as many more as its last domain copied, named c, d, ... each with its own region, serving
    port and model ports (the last domain's, plus 10 per domain added: 18621 -> 18631 -> ...) and
    checkpoints. Pure (a new document); 0 keeps the document as it is."""
    if not domains:
        return doc
    if not 1 <= domains <= MAX_DEMO_DOMAINS:
        raise ConfigError(f"--domains {domains}: a demo fleet has 1 to {MAX_DEMO_DOMAINS} domains")
    out = json.loads(json.dumps(doc))
    have = out.get("domains", [])
    if not have:
        raise ConfigError("the demo layout declares no domain to copy for --domains")
    if domains <= len(have):
        out["domains"] = have[:domains]
        return out
    last = have[-1]
    for k in range(1, domains - len(have) + 1):
        d = json.loads(json.dumps(last))
        name = chr(ord(last["name"][0]) + k) if len(last["name"]) == 1 else f"{last['name']}{k + 1}"
        d["name"] = name
        d["region"] = f"local-{len(have) + k}"
        if d.get("serving_url"):
            base, _, port = d["serving_url"].rpartition(":")
            d["serving_url"] = f"{base}:{int(port) + k}"
        for slot in d.get("slots", []):
            for model in slot.get("models", []):
                if model.get("port"):
                    model["port"] = int(model["port"]) + 10 * k
            if slot.get("checkpoint_dir"):
                slot["checkpoint_dir"] = slot["checkpoint_dir"].replace(f"/{last['name']}/", f"/{name}/")
        have.append(d)
    out["domains"] = have
    return out


def demo_layout(home: Path, path: Path = DEMO_LAYOUT, domains: int = 0) -> Layout:
    """The demo layout made runnable here: a leading "python" becomes this interpreter, and
    checkpoints live under $HARU_HOME. `domains` (0 = as the file says): the fleet widened or narrowed
    to that many domains (`widen`)."""
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(
            f"cannot read the demo layout {path}: {exc.strerror}; reinstall haru (the demo layouts are its "
            "package data), or pass --layout with a layout of your own"
        ) from None
    doc = widen(doc, domains)
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
                if "haru.agents.sim.vllm" in binary and "vram" in model:
                    # the simulated runtime holds what the model declares, so the sim GPU's numbers
                    # are the planner's: the standby cannot wake its models with training still running
                    model["env"] = {"HARU_SIM_VRAM": str(model["vram"]), **model.get("env", {})}
                if model.get("runtime") == "llama_server":
                    _real_llama_model(model, home)
                if model.get("runtime") == "vllm" and not binary and str(model.get("source", "")).startswith("./"):
                    _real_vllm_model(model, home)
    return parse_layout(doc)


def _real_llama_model(model: dict, home: Path) -> None:
    """A llama-server model of a demo layout made runnable here: the binary built (or found) by
    `agents.runtimes.llama_build`, and a relative `.gguf` source written as a tiny seeded model
    under $HARU_HOME/demo/models (the file name picks the seed: both domains get the same weights)."""
    import zlib

    from haru.agents.runtimes.llama_build import ensure_binary
    from haru.agents.runtimes.tiny_model import write_tiny_model

    if model.get("binary", ["llama-server"]) in ([], ["llama-server"]):
        model["binary"] = [str(ensure_binary(build=True))]
    source = str(model.get("source", ""))
    if source.endswith(".gguf") and not os.path.isabs(source):
        path = home / "demo" / "models" / source
        if not path.exists():
            write_tiny_model(path, seed=zlib.crc32(source.encode()) & 0xFFFF, name=Path(source).stem)
        model["source"] = str(path)


def _real_vllm_model(model: dict, home: Path) -> None:
    """A vLLM model of a demo layout made runnable here: the managed vLLM (made once by
    `agents.runtimes.vllm_env`, ~3.5 GB), and a `./name` source written as a tiny seeded safetensors
    llama under $HARU_HOME/demo/models/name (the name picks the seed: both domains get the same weights)."""
    import subprocess
    import zlib

    from haru.agents import runtimes
    from haru.agents.runtimes.vllm_env import ensure_env, launch_binary

    python = ensure_env(build=True)
    model["binary"] = launch_binary(python)
    name = str(model["source"])[2:].strip("/")
    path = home / "demo" / "models" / name
    if not (path / "model.safetensors").exists():
        # the writer runs in vLLM's interpreter: it has sentencepiece, numpy and safetensors
        subprocess.run(
            [
                str(python),
                str(Path(runtimes.__file__).parent / "tiny_hf_model.py"),
                str(path),
                "--seed",
                str(zlib.crc32(name.encode()) & 0xFFFF),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    model["source"] = str(path)


# ------------------------------------------------------------------------------- the home lock


class HomeLock:
    """One `haru up` per home: an flock on `$HARU_HOME/up.lock`, and `up.json` saying who holds it."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.fd: int | None = None

    @property
    def state_file(self) -> Path:
        return self.home / STATE_FILE

    def acquire(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.home / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AlreadyRunning(self._refusal()) from None
        self.fd = fd
        self.publish()

    def _refusal(self) -> str:
        try:
            doc = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            doc = {}
        pid = doc.get("pid", "?")
        urls = [f"NATS {redact(doc['nats_url'])}"] if doc.get("nats_url") else []
        urls += [f"gateway {doc['gateway_url']}"] if doc.get("gateway_url") else []
        running = f"pid {pid}" + (f", {', '.join(urls)}" if urls else ", still starting")
        return (
            f"haru up is already running on {self.home} ({running}): use that one (`haru status`), "
            f"stop it first (kill {pid}), or give this one another home (--home DIR or HARU_HOME)"
        )

    def publish(self, **info: object) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "home": str(self.home), **info}))
        os.replace(tmp, self.state_file)

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                self.state_file.unlink()
            os.close(fd)


def stop_leftovers(home: Path, *, embedded: bool) -> list[dict]:
    """Stop what a `haru up` that died on this home left alive: agents and services first, nats-server
    last. Only processes whose parent is gone are stopped; a live server on our store whose parent
    lives (another tool started it) is refused with StoreBusy."""
    files = sorted((home / RUN_DIR).glob("*.pid"))
    if embedded:
        files.append(home / "nats" / natsd.PID_FILE)
    stopped = []
    for f in files:
        doc = children.holder(f)
        if doc is not None and not children.orphaned(doc):
            if f.name == natsd.PID_FILE:
                raise StoreBusy(
                    f"the NATS store {f.parent} is held by nats-server pid {doc['pid']} (started by live pid "
                    f"{doc.get('parent')}, not a `haru up`): stop it first (kill {doc['pid']}) or use another home"
                )
            continue
        ended = children.stop_leftover(f, LEFTOVER_STOP_S)
        if ended is not None:
            log.warning(
                "up.leftover_stopped",
                what=ended.get("what"),
                pid=ended["pid"],
                ended=ended["ended"],
                why="a previous haru up on this home died and left it running",
            )
            stopped.append(ended)
    return stopped


FRESH_PARTS = ("nats", "sim", "demo")  # what `haru up --demo` keeps between runs under $HARU_HOME


def fresh_start(home: Path, now: datetime | None = None) -> Path | None:
    """`haru up --demo --fresh`: move the state a previous demo left (its event log, simulated GPUs, agents)
    to `$HARU_HOME/previous/<UTC time>/`, never deleting it. None when there was nothing to move.
    Raises AlreadyRunning (a ConfigError) when a `haru up` holds this home."""
    lock = HomeLock(home)
    lock.acquire()  # the same lock `haru up` holds: never move a live store away
    try:
        parts = [home / p for p in FRESH_PARTS if (home / p).exists()]
        if not parts:
            return None
        stamp = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")
        dest = home / "previous" / stamp
        dest.mkdir(parents=True, exist_ok=True)
        for p in parts:
            os.replace(p, dest / p.name)
        return dest
    finally:
        lock.release()


# ----------------------------------------------------------------------------- the children


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


def _spawn_python(args: list[str], *, name: str, home: Path, log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    out = open(log_path, "ab")
    try:
        # SIGKILL when haru up dies: NATS dies with it, so nothing could be recorded on the way out, and
        # each of these is built to be killed (the log is the truth; the next start reconciles). A
        # SIGTERM would leave an agent retrying its last appends against a log that is gone.
        return children.spawn(
            [sys.executable, "-m", "haru.cli", *args],
            death_signal=signal.SIGKILL,
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
    layout: Layout, domain: str, nats_url: str, home: Path, metrics_port: int | None = None, gpus: str = "sim"
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
            ["agent", "--config", str(conf), "--log-format", "json"], name=name, home=home, log_path=log_path, env=env
        )

    proc = _spawn_python(
        ["agent", "--config", str(conf), "--log-format", "json"], name=name, home=home, log_path=log_path, env=env
    )
    return Child(name, log_path, restart, proc, domain=domain, metrics_port=metrics_port)


def read_model_dsn(env: Mapping[str, str]) -> str:
    """The Postgres read model's DSN: HARU_DATABASE_URL, else DATABASE_URL ('' = none: no sink)."""
    return (env.get("HARU_DATABASE_URL") or env.get("DATABASE_URL") or "").strip()


def start_service(kind: str, nats_url: str, home: Path, metrics_port: int | None = None) -> Child:
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
        return _spawn_python(argv(child.metrics_port), name=kind, home=home, log_path=log_path, env=env)

    return Child(
        kind,
        log_path,
        restart,
        _spawn_python(argv(metrics_port), name=kind, home=home, log_path=log_path, env=env),
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
    child: Child, running: Running, policy: RestartPolicy = POLICY, on_restart: Callable[[], None] | None = None
) -> None:
    """Restart `child` whenever it dies (until `running.stopping`), with backoff, saying why."""
    failures = 0
    started = time.monotonic()
    while True:
        while child.proc is not None and child.proc.poll() is None:
            await asyncio.sleep(POLL_S)
        if running.stopping:
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
        if running.stopping:
            return
        started = time.monotonic()
        if child.metrics_port and not _port_free(child.metrics_port):
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
    demo_domains: int = 0  # `--domains N`: the demo fleet with N domains (0 = as its layout says)
    ready_file: Path | None = None  # written (JSON) once everything is up: for scripts and tests
    services: tuple[str, ...] = ("projector", "promoter", "gateway")
    metrics_port: int | None = None  # None: HARU_METRICS_PORT, else 9400 (a free port when taken)
    metrics_host: str | None = None
    # `haru serve`: this fleet instead of the demo's, its agents' GPUs ("sim" or "nvml"), and a hook run
    # once the fleet is applied (it records the pulls that preceded it)
    layout: Layout | None = None
    agent_gpus: str = "sim"
    after_apply: Any = None


@dataclass
class Running:
    nats_url: str
    gateway_url: str = ""
    metrics_url: str = ""  # projector + promoter, gathered from their own endpoints (haru/host/metrics.py)
    agents: list[Child] = field(default_factory=list)
    services: list[Child] = field(default_factory=list)
    nats: Child | None = None
    stopping: bool = False

    def children(self) -> dict[str, int | None]:
        kids = ([self.nats] if self.nats else []) + self.services + self.agents
        return {c.name: c.pid for c in kids}


async def up(opts: UpOptions, stop: asyncio.Event) -> Running:
    """Run until `stop` is set; return what ran. Raises HaruError subclasses for what cannot start
    (AlreadyRunning when another live `haru up` holds the home)."""
    from haru.gateway.config import from_env
    from haru.gateway.server import Gateway

    lock = HomeLock(opts.home)
    lock.acquire()
    try:
        return await _up(opts, stop, lock, from_env, Gateway)
    finally:
        lock.release()


async def _up(opts: UpOptions, stop: asyncio.Event, lock: HomeLock, from_env, Gateway) -> Running:
    url_file = opts.home / NATS_URL_FILE
    embedded = not opts.nats_url
    await asyncio.to_thread(stop_leftovers, opts.home, embedded=embedded)  # waits for them to stop
    async with contextlib.AsyncExitStack() as stack:
        nats_url, nats_child = (opts.nats_url, None) if opts.nats_url else await _start_nats(opts, stack, url_file)
        running = Running(nats_url=nats_url, nats=nats_child)
        lock.publish(nats_url=nats_url)

        events = await EventLog.open(nats_url, writer="up")
        stack.push_async_callback(events.close)
        await events.ensure()

        layout = opts.layout
        if opts.demo:
            layout = demo_layout(opts.home, opts.layout_path, opts.demo_domains)
        if layout is not None:
            result = await apply_mod.apply(events, layout, datetime.now(UTC), by="up:demo" if opts.demo else "up:serve")
            log.info("up.applied", fleet=layout.fleet, events=len(result.events))
            if opts.after_apply is not None:
                await opts.after_apply(events, layout)

        # Unwound in reverse: the restart loops stop first, then the agents, the gateway, the services.
        for kind in ("projector", "promoter"):
            if kind in opts.services:
                running.services.append(start_service(kind, nats_url, opts.home, metrics_port=free_port()))
        if read_model_dsn(os.environ) and "projector" in opts.services:
            # DATABASE_URL (Haru's server required one) is honoured: the Postgres read model runs too.
            running.services.append(start_service("sink", nats_url, opts.home))
        stack.push_async_callback(stop_children, running.services, SERVICE_STOP_S)
        if running.services:
            metrics = await stack.enter_async_context(_serve_metrics(opts, running))
            running.metrics_url = metrics.url
        if "gateway" in opts.services:
            config = from_env(os.environ, host=opts.gateway_host, port=opts.gateway_port)
            gw = Gateway(config, events)
            await stack.enter_async_context(gw)
            running.gateway_url = gw.url

        if layout is not None:
            for d in layout.domains:
                running.agents.append(
                    start_agent(layout, d.spec.name, nats_url, opts.home, free_port(), opts.agent_gpus)
                )
        stack.push_async_callback(stop_agents, running.agents)

        def publish() -> None:  # up.json names every child's current pid
            lock.publish(nats_url=nats_url, gateway_url=running.gateway_url, children=running.children())

        keepers = [
            asyncio.create_task(keep_running(c, running, on_restart=publish), name=f"keep {c.name} running")
            for c in ([nats_child] if nats_child else []) + running.services + running.agents
        ]
        stack.push_async_callback(_cancel_all, keepers)

        def stopping() -> None:
            running.stopping = True

        stack.callback(stopping)  # runs first: nothing is restarted once stopping began

        _banner(running, opts, layout)
        publish()
        if opts.ready_file:
            opts.ready_file.write_text(
                json.dumps(
                    {
                        "nats_url": running.nats_url,
                        "gateway_url": running.gateway_url,
                        "agents": {a.domain: a.pid for a in running.agents},
                        "pid": os.getpid(),
                        "children": running.children(),
                        "metrics": {"up": running.metrics_url, **{a.domain: a.metrics_url for a in running.agents}},
                    }
                )
            )

        await stop.wait()
        running.stopping = True
        log.info("up.stopping")
    return running


async def _start_nats(opts: UpOptions, stack: contextlib.AsyncExitStack, url_file: Path) -> tuple[str, Child]:
    """The embedded nats-server (on a free port when the asked one is busy), stopped with `stack`."""
    port = opts.nats_port
    if port and not _port_free(port):
        chosen = free_port()
        log.warning(
            "up.nats_port_busy",
            port=port,
            using=chosen,
            hint="another nats-server is using it; this one uses a free port",
        )
        port = chosen
    server = NatsServer(opts.home / "nats", port=port)
    await server.start()
    stack.push_async_callback(server.stop)
    url_file.write_text(server.url + "\n")
    stack.callback(lambda: url_file.unlink(missing_ok=True))

    async def restart_nats(_: Child) -> subprocess.Popen:
        await server.start()
        assert server.proc is not None
        return server.proc

    return server.url, Child("nats-server", server.log_file, restart_nats, server.proc)


def _children_registry(running: Running):
    """haru up's own figures: each child it keeps running, whether it runs and how often it was restarted."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class Children:
        def collect(self):
            kids = ([running.nats] if running.nats else []) + running.services + running.agents
            up = GaugeMetricFamily("haru_up_child_running", "1 while the child process runs", labels=["child"])
            restarts = CounterMetricFamily(
                "haru_up_child_restarts", "times haru up restarted the child", labels=["child"]
            )
            for c in kids:
                up.add_metric([c.name], 1.0 if c.proc is not None and c.proc.poll() is None else 0.0)
                restarts.add_metric([c.name], float(c.restarts))
            return [up, restarts]

    registry = CollectorRegistry()
    registry.register(Children())
    return registry


@contextlib.asynccontextmanager
async def _serve_metrics(opts: UpOptions, running: Running):
    """One endpoint for the control plane: haru up's own figures, then the projector's and the
    promoter's, gathered from their own endpoints at each scrape (they are child processes, restarted
    by haru up: a child that is down or restarting is left out of that scrape, and
    `haru_up_child_running` says so). The default port moves when taken."""
    import aiohttp

    from haru.host.metrics import DOCUMENTED_PORTS, MetricsServer, metrics_address

    address = metrics_address(opts.metrics_port, opts.metrics_host, default_port=DOCUMENTED_PORTS["up"])
    assert address is not None
    host, port = address
    explicit = opts.metrics_port is not None or os.environ.get("HARU_METRICS_PORT", "").strip()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:

        def gather(child: Child):
            async def scrape() -> bytes:
                async with session.get(child.metrics_url) as resp:
                    resp.raise_for_status()
                    return await resp.read()

            return scrape

        sources = [(c.name, gather(c)) for c in running.services if c.metrics_url]
        server = MetricsServer([_children_registry(running)], host=host, port=port, sources=sources)
        try:
            await server.__aenter__()
        except ConfigError:
            if explicit or not port:
                raise
            # the default port is taken (another haru up, or one that was free a moment ago): any free one
            server = MetricsServer([_children_registry(running)], host=host, port=0, sources=sources)
            await server.__aenter__()
            log.warning("up.metrics_port_busy", port=port, using=server.port)
        try:
            yield server
        finally:
            await server.__aexit__(None, None, None)


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    await cancel_and_wait(*tasks)


def redact(urls: str) -> str:
    """NATS URLs without their passwords, for printing."""
    import re

    return re.sub(r"//([^:/@,]+):[^@/,]*@", r"//\1:***@", urls)


def _banner(running: Running, opts: UpOptions, layout: Layout | None) -> None:
    out = sys.stdout
    out.write(
        f"haru up: NATS {redact(running.nats_url)}"
        + ("" if opts.nats_url else f" (embedded, store {opts.home / 'nats'})")
        + "\n"
    )
    if running.gateway_url:
        out.write(
            f"haru up: gateway {running.gateway_url}  (OpenAI-compatible: {running.gateway_url}/v1; "
            f"console: {running.gateway_url}/ui)\n"
        )
    if running.metrics_url:
        agents = "".join(f", agent {a.domain} {a.metrics_url}" for a in running.agents if a.metrics_url)
        out.write(f"haru up: metrics {running.metrics_url} (projector + promoter){agents}\n")
    if layout is not None:
        models = ", ".join(m.name for m in layout.domains[0].models)
        out.write(
            f"haru up: {'demo ' if opts.demo else ''}fleet {layout.fleet!r}: domains {', '.join(d.spec.name for d in layout.domains)}; "
            f"models {models}\n"
        )
        out.write(f"haru up: agent logs in {opts.home / 'demo' / 'agents'}; try `haru status` in another terminal\n")
    if running.services:
        out.write(
            f"haru up: {', '.join(c.name for c in running.services)} logs in {opts.home / 'logs'}; "
            f"children are restarted if they die (see {opts.home / 'up.json'})\n"
        )
    out.write("haru up: Ctrl-C stops everything\n")
    out.flush()
