"""`haru projector`: fold HARU_EVENTS into fleet views (KV haru_views) and route intents."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

from haru.cli.common import ExitStatus, add_nats_options, fail, nats_servers


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "projector",
        help="fold the event log into fleet views and route intents (run 1..n replicas)",
        description=(
            "Replay HARU_EVENTS from the stored views' checkpoint, fold, write each fleet's view to KV "
            "haru_views with compare-and-swap, and publish a route intent on haru.route.<fleet> whenever "
            "it changes. Several projectors may run at once. Stop with Ctrl-C or SIGTERM."
        ),
    )
    add_nats_options(p)
    p.add_argument(
        "--replicas",
        type=int,
        default=int(os.environ.get("HARU_REPLICAS", "1")),
        help="replicas for the streams and bucket if this projector creates them (env HARU_REPLICAS; default %(default)s)",
    )
    p.add_argument(
        "--log-format",
        choices=("auto", "console", "json"),
        default=os.environ.get("HARU_LOG_FORMAT", "auto"),
        help="diagnostics on stderr: console, json, or auto (console on a terminal) (env HARU_LOG_FORMAT)",
    )
    p.set_defaults(handler=run)


def configure_logging(fmt: str) -> None:
    import structlog

    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


async def run(args: argparse.Namespace) -> ExitStatus:
    configure_logging(args.log_format)
    import structlog

    from haru.errors import LogUnavailable
    from haru.eventlog import EventLog
    from projections.projector import Projector

    writer = f"projector:{socket.gethostname()}:{os.getpid()}"
    structlog.contextvars.bind_contextvars(projector=writer)
    try:
        async with EventLog.connect(nats_servers(args.nats_url), writer=writer, creds=args.nats_creds) as log:
            await log.ensure(replicas=args.replicas)
            task = asyncio.create_task(Projector(log).run())
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, task.cancel)
            try:
                await task
            except asyncio.CancelledError:
                pass
    except LogUnavailable as exc:
        return fail(str(exc), ExitStatus.UNAVAILABLE)
    return ExitStatus.OK
