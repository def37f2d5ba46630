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

This module composes; the parts live beside it: `haru.up.home` (the lock, leftovers, `--fresh`),
`haru.up.supervise` (the children, kept running), `haru.up.demo_layout` (the demo fleets).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from haru.core.errors import ConfigError
from haru.core.specs import Layout
from haru.host.natsd import NatsServer, free_port
from haru.host.tasks import cancel_and_wait
from haru.log import apply as apply_mod
from haru.log.eventlog import EventLog
from haru.up.demo_layout import DEMO_LAYOUT, demo_layout
from haru.up.home import NATS_URL_FILE, HomeLock, redact, stop_leftovers
from haru.up.supervise import (
    DEATH_SIGNAL,
    SERVICE_STOP_S,
    Child,
    keep_running,
    port_free,
    start_agent,
    start_service,
    stop_agents,
    stop_children,
)

log = structlog.get_logger("haru.up.compose")

DEFAULT_NATS_PORT = 4222


def read_model_dsn(env: Mapping[str, str]) -> str:
    """The Postgres read model's DSN: HARU_DATABASE_URL, else DATABASE_URL ('' = none: no sink)."""
    return (env.get("HARU_DATABASE_URL") or env.get("DATABASE_URL") or "").strip()


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
    # Tests only (`HARU_NO_PDEATHSIG=1` in haru up's environment, read by the command): False starts the
    # children without the parent-death signal, so a test can leave real orphans behind and watch the next
    # start find and stop them.
    death_signals: bool = True


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
                running.services.append(
                    start_service(kind, nats_url, opts.home, metrics_port=free_port(), death_signal=_death(opts))
                )
        if read_model_dsn(os.environ) and "projector" in opts.services:
            # DATABASE_URL (Haru's server required one) is honoured: the Postgres read model runs too.
            running.services.append(start_service("sink", nats_url, opts.home, death_signal=_death(opts)))
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
                    start_agent(layout, d.spec.name, nats_url, opts.home, free_port(), opts.agent_gpus, _death(opts))
                )
        stack.push_async_callback(stop_agents, running.agents)

        def publish() -> None:  # up.json names every child's current pid
            lock.publish(nats_url=nats_url, gateway_url=running.gateway_url, children=running.children())

        keepers = [
            asyncio.create_task(
                keep_running(c, lambda: running.stopping, on_restart=publish), name=f"keep {c.name} running"
            )
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
    if port and not port_free(port):
        chosen = free_port()
        log.warning(
            "up.nats_port_busy",
            port=port,
            using=chosen,
            hint="another nats-server is using it; this one uses a free port",
        )
        port = chosen
    server = NatsServer(opts.home / "nats", port=port, death_signal=signal.SIGTERM if opts.death_signals else None)
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

    address = metrics_address(opts.metrics_port, opts.metrics_host, os.environ, default_port=DOCUMENTED_PORTS["up"])
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


def _death(opts: UpOptions) -> int | None:
    """The signal the service and agent children get when haru up dies (None: none, tests only)."""
    return DEATH_SIGNAL if opts.death_signals else None


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    await cancel_and_wait(*tasks)


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
            f"haru up: {'demo ' if opts.demo else ''}fleet {layout.fleet!r}: "
            f"domains {', '.join(d.spec.name for d in layout.domains)}; models {models}\n"
        )
        out.write(f"haru up: agent logs in {opts.home / 'demo' / 'agents'}; try `haru status` in another terminal\n")
    if running.services:
        out.write(
            f"haru up: {', '.join(c.name for c in running.services)} logs in {opts.home / 'logs'}; "
            f"children are restarted if they die (see {opts.home / 'up.json'})\n"
        )
    out.write("haru up: Ctrl-C stops everything\n")
    out.flush()
