"""`haru projector`: fold HARU_EVENTS into fleet views (KV haru_views) and route intents."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket

from haru.cli.common import (
    ExitStatus,
    add_log_options,
    add_nats_options,
    configure_logging,
    env_count,
    env_default,
    fail,
    nats_servers,
)
from haru.host.metrics import add_metrics_options
from haru.host.tasks import run_until_signal


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
        type=env_count("HARU_REPLICAS"),
        default=env_default("HARU_REPLICAS"),
        help="replicas for the streams and bucket if this projector creates them (env HARU_REPLICAS; default: 3 "
        "on a cluster of three or more servers, else 1)",
    )
    p.add_argument(
        "--from-checkpoint",
        action="store_true",
        help="rebuild: start each fleet from its newest checkpoint's view instead of the stored one "
        "(a fleet without a stored view always starts from its checkpoint)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=env_count("HARU_CHECKPOINT_EVERY"),
        default=env_default("HARU_CHECKPOINT_EVERY", "10000"),
        help="write a checkpoint every N events of a fleet (env HARU_CHECKPOINT_EVERY; default %(default)s)",
    )
    add_log_options(p)
    add_metrics_options(p)
    p.set_defaults(handler=run)


async def run(args: argparse.Namespace) -> ExitStatus:
    configure_logging(args.log_format, args.log_level)
    import structlog
    from prometheus_client import CollectorRegistry

    from haru.core.errors import LogUnavailable
    from haru.host.metrics import maybe_serve, metrics_address
    from haru.log.eventlog import EventLog
    from haru.projections.metrics import register as register_metrics
    from haru.projections.projector import Projector

    metrics = metrics_address(args.metrics_port, args.metrics_host, os.environ)
    writer = f"projector:{socket.gethostname()}:{os.getpid()}"
    structlog.contextvars.bind_contextvars(projector=writer)
    try:
        async with EventLog.connect(nats_servers(args.nats_url), writer=writer, creds=args.nats_creds) as log:
            await log.ensure(replicas=args.replicas)
            if args.checkpoint_every < 1:
                return fail(
                    f"--checkpoint-every {args.checkpoint_every}: give a positive number of events", ExitStatus.USAGE
                )
            projector = Projector(log, checkpoint_every=args.checkpoint_every, from_checkpoint=args.from_checkpoint)
            registry = CollectorRegistry()
            lag = register_metrics(registry, projector)
            async with maybe_serve([registry], metrics, refresh=[lag.refresh]):
                task = asyncio.create_task(projector.run())
                with contextlib.suppress(asyncio.CancelledError):
                    await run_until_signal(task)
    except LogUnavailable as exc:
        return fail(str(exc), ExitStatus.UNAVAILABLE)
    return ExitStatus.OK
