"""`haru agent [--config host.json | --config '{…}']`: run this host's agent (one per domain) until SIGTERM/SIGINT.

SIGTERM (a restart, an upgrade: what `systemctl restart` sends) stops the agent and leaves every
runtime serving for the next agent to adopt; SIGINT (Ctrl-C, `haru up` stopping) unloads them first.

Exit statuses: 0 after a clean stop; CONFLICT (4) when another agent already runs the domain;
UNAVAILABLE (6) when NATS cannot be reached; USAGE (2) for no config or a config path that does not
exist; ERROR (1) for a config that cannot be used.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from haru.cli.common import ExitStatus, add_log_options, configure_logging, fail
from haru.host.metrics import add_metrics_options


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "agent",
        help="run the per-host agent: supervise runtimes and training, report residency, serve the domain",
        description="Run the Haru agent for one domain (one GPU host). See docs/agent.md for the config format.",
    )
    p.add_argument(
        "--config",
        default=None,
        help="the agent config (fleet, domain, NATS, GPUs, serving port): a JSON file, or inline JSON "
        "(env HARU_AGENT_CONFIG, else HARU_SUPERVISOR_CONFIG)",
    )
    add_log_options(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print what this host would run (source, role, admitted models and training slots) and exit",
    )
    p.add_argument("--json", action="store_true", help="with --dry-run: print JSON")
    add_metrics_options(p)
    p.set_defaults(handler=run)


async def run(args: argparse.Namespace) -> ExitStatus:
    import os

    from haru.agents.agent import Agent
    from haru.agents.config import config_from_env, is_inline, load_config
    from haru.agents.errors import AgentRefused
    from haru.agents.metrics import registry_for
    from haru.agents.serving_env import ServingEnv
    from haru.core.errors import ConfigError, LayoutError, LogUnavailable
    from haru.host.metrics import maybe_serve, metrics_address

    configure_logging(args.log_format, args.log_level)
    source = args.config or config_from_env()
    if not source:
        return fail("no agent config: pass --config FILE (or inline JSON), or set HARU_AGENT_CONFIG", ExitStatus.USAGE)
    if not is_inline(source) and not os.path.exists(source):
        return fail(
            f"the agent config {source!r} does not exist: pass --config FILE (or inline JSON), or set "
            f"HARU_AGENT_CONFIG",
            ExitStatus.USAGE,
        )
    try:
        config = load_config(source)
        serving_env = ServingEnv.from_env(os.environ)  # the environment, read once here and handed down
    except ConfigError as exc:
        return fail(str(exc))
    if args.dry_run:
        return await dry_run(config, as_json=args.json)
    loop = asyncio.get_running_loop()
    stop_signal: list[str] = []
    agent_box: list[Agent] = []

    def on_signal(name: str) -> None:
        stop_signal.append(name)
        if agent_box:
            agent_box[0].request_stop(f"signal {name}", keep_runtimes=name == "SIGTERM")

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    try:
        metrics = metrics_address(
            args.metrics_port if args.metrics_port is not None else config.metrics_port,
            args.metrics_host or config.metrics_host or None,
            os.environ,
        )
        async with Agent.start(config, serving_env=serving_env) as agent:
            agent_box.append(agent)
            if stop_signal:
                agent.request_stop(f"signal {stop_signal[0]}", keep_runtimes=stop_signal[0] == "SIGTERM")
            async with maybe_serve([registry_for(agent)], metrics):
                await agent.stopped()
    except AgentRefused as exc:
        return fail(str(exc), ExitStatus.CONFLICT)
    except LogUnavailable as exc:
        return fail(str(exc), ExitStatus.UNAVAILABLE)
    except (ConfigError, LayoutError) as exc:
        return fail(str(exc))
    return ExitStatus.OK


async def dry_run(config, *, as_json: bool) -> ExitStatus:
    """Resolve the slots exactly as the agent would, without claiming the domain or starting anything."""
    from haru.agents.agent import resolve_slots
    from haru.cli.common import emit_json
    from haru.core import subjects
    from haru.core.errors import ConfigError, LayoutError, LogUnavailable, StreamUnknown
    from haru.core.events import RouteMoved
    from haru.log.eventlog import EventLog

    try:
        async with EventLog.connect(
            config.servers(), writer=f"agent-dry-run:{config.fleet}/{config.domain}", creds=config.nats_creds
        ) as log:
            slots = await resolve_slots(config, log)
            try:
                route = await log.last(subjects.route(config.fleet))
            except StreamUnknown:
                route = None  # no event stream here yet (`haru up` creates it): no route either
    except LogUnavailable as exc:
        return fail(str(exc), ExitStatus.UNAVAILABLE)
    except (ConfigError, LayoutError) as exc:
        return fail(str(exc))
    active = route.event.active if route is not None and isinstance(route.event, RouteMoved) else slots.first_domain
    role = config.role if config.role != "auto" else ("active" if active == config.domain else "standby")
    out = {
        "fleet": config.fleet,
        "domain": config.domain,
        "source": slots.source,
        "role": role,
        "models": [
            {"name": m.name, "runtime": m.runtime, "gpu": m.gpu_index, "vram_bytes": m.vram_bytes}
            for m in slots.admitted_models
        ],
        "training": [{"slot": t.slot, "gpu": t.gpu_index, "command": t.command} for t in slots.admitted_training],
        "not_admitted": slots.not_admitted,
        "runtimes": _runtimes_on_start(config, slots),
    }
    if as_json:
        emit_json(out)
        return ExitStatus.OK
    print(f"{config.fleet}/{config.domain}: {role}, slots from {slots.source}")
    for m in out["models"]:
        print(f"  model    {m['name']:<32} {m['runtime']:<13} gpu {m['gpu']}  {m['vram_bytes'] / 1024**3:.1f} GiB")
    for t in out["training"]:
        print(f"  training {t['slot']:<32} gpu {t['gpu']}  {' '.join(t['command'])}")
    for name, short in slots.not_admitted.items():
        print(f"  not admitted {name} (short by {short / 1024**3:.1f} GiB)")
    for name, (verdict, why) in out["runtimes"].items():
        print(f"  on start {verdict:<8} {name}: {why}")
    return ExitStatus.OK


def _runtimes_on_start(config, slots) -> dict[str, tuple[str, str]]:
    """Per model, what a starting agent would do with the runtime a previous agent left (adopt, replace,
    stop, start), from the identity files in the state directory."""
    from haru.agents.runtime_files import read_identities, runtime_on_start
    from haru.agents.runtimes import make_runtime

    state_dir = config.state_path()
    found = read_identities(state_dir)
    gpu_memory = {g.index: g.memory_bytes for g in slots.domain.spec.gpus}
    direct = slots.domain.spec.serve == "direct"
    out: dict[str, tuple[str, str]] = {}
    for spec in slots.admitted_models:
        runtime = make_runtime(
            spec,
            session=None,  # type: ignore[arg-type]
            log_dir=state_dir,
            bind_host=config.serving.host if direct else "127.0.0.1",
            gpu_memory_bytes=gpu_memory.get(spec.gpu_index, 0),
        )
        doc = found.get(spec.name, (None, None))[1]
        if runtime.kind == "external":
            out[spec.name] = ("probe", "an external endpoint: never started or stopped")
        else:
            verdict = runtime_on_start(doc, runtime, spec)
            out[spec.name] = (verdict.action, verdict.why)
    for name, (_path, doc) in found.items():
        if name not in out and doc is not None:
            verdict = runtime_on_start(doc, None, None)
            out[name] = (verdict.action, verdict.why)
    return out
