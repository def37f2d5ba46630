"""`haru route [--fleet F] [--watch] [--json]`: the fleet's route intent, and with --watch every change."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone

from haru.cli.common import LinkReporter, ExitStatus, add_fleet_option, add_nats_options, emit_json, fail, nats_servers


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "route",
        help="the route intent routers act on: active and standby domains, one answer per model",
        description=(
            "Print the fleet's last route intent (haru.route.<fleet>): the route revision, the active and "
            "standby domains with their serving URLs and eligibility, and the router answer for each model. "
            "With --watch, print every change as it is published (Ctrl-C to stop)."
        ),
    )
    add_nats_options(p)
    add_fleet_option(p)
    p.add_argument("--watch", action="store_true", help="keep printing every new intent, in order")
    p.add_argument("--json", action="store_true", help="one JSON RouteIntent per line (for_ms as of printing)")
    p.set_defaults(handler=run)


def _print(ri, as_json: bool) -> None:
    from haru.core.intents import at
    from haru.projections.status import render_intent

    now = datetime.now(timezone.utc)
    if as_json:
        emit_json(at(ri, now))
    else:
        print(render_intent(ri, now))
    sys.stdout.flush()


async def run(args: argparse.Namespace) -> ExitStatus:
    from haru.core.errors import HaruError, InvalidName, LogUnavailable
    from haru.log.route import RouteWatcher
    from haru.core.subjects import check_name

    try:
        check_name("fleet", args.fleet)
    except InvalidName as exc:
        return fail(str(exc), ExitStatus.USAGE)
    try:
        async with RouteWatcher(nats_servers(args.nats_url), args.fleet, creds=args.nats_creds, writer="cli:route") as w:
            if not args.watch:
                if w.current is None:
                    return fail(
                        f"no route intent for fleet {args.fleet!r} yet: declare it with `haru apply` and make sure "
                        f"`haru projector` runs (`haru up` starts one)",
                        ExitStatus.NOT_FOUND,
                    )
                _print(w.current, args.json)
                return ExitStatus.OK
            # The listener goes before the connection does: closing it is not the control plane going away.
            forget = w.log.on_link_change(LinkReporter(args.nats_url, "the route shown")) if w.log is not None else None
            try:
                if w.current is None and not args.json:
                    print(f"(no route intent for fleet {args.fleet!r} yet; waiting)", file=sys.stderr)
                first = True
                async for ri in w:
                    if not first and not args.json:
                        print()
                    first = False
                    _print(ri, args.json)
            finally:
                if forget is not None:
                    forget()
    except LogUnavailable as exc:
        return fail(str(exc), ExitStatus.UNAVAILABLE)
    except HaruError as exc:
        return fail(str(exc))
    return ExitStatus.OK
