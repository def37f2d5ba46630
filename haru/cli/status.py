"""`haru status [--fleet F] [--json]`: the fleet's view, in hearth's format."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime

from haru.cli.common import ExitStatus, add_fleet_option, add_nats_options, emit_json, fail
from haru.cli.stored import open_log, stopped_store


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "status",
        help="residency of every model on every GPU, the active domain, training and operations",
        description=(
            "Print the fleet's view as the projector last wrote it (KV haru_views): per domain and GPU "
            "what is held and admitted, each model's residency and for how long or why, the active domain "
            "and route revision, training slots, and the operation in flight."
        ),
    )
    add_nats_options(p)
    add_fleet_option(p)
    p.add_argument("--json", action="store_true", help="print the FleetView as JSON")
    p.add_argument(
        "--routers-wait",
        type=float,
        default=0.3,
        help="seconds to hear the routers that follow the fleet (haru route follow) report; 0: do not ask",
    )
    p.set_defaults(handler=run)


async def run(args: argparse.Namespace) -> ExitStatus:
    from haru.core import subjects
    from haru.core.errors import InvalidName, LogUnavailable
    from haru.core.views import view_decoder
    from haru.projections.status import render

    try:
        key = subjects.view_key(args.fleet)
    except InvalidName as exc:
        return fail(str(exc), ExitStatus.USAGE)
    try:
        routers = None
        async with open_log(args, "status") as log:
            got = await log.get_view(key)
            if got is not None and not args.json and args.routers_wait > 0 and stopped_store(args) is None:
                from haru.log.router_reports import ask_routers

                routers = await ask_routers(log.bus, args.fleet, args.routers_wait)
    except LogUnavailable as exc:
        return fail(str(exc), ExitStatus.UNAVAILABLE)
    if got is None:
        return fail(
            f"no view for fleet {args.fleet!r}: declare it with `haru apply`, and make sure `haru projector` runs "
            f"(`haru up` starts one)",
            ExitStatus.NOT_FOUND,
        )
    try:
        view = view_decoder.decode(got[0])
    except Exception as exc:  # noqa: BLE001 - a view from another version of Haru
        return fail(f"the stored view of fleet {args.fleet!r} cannot be read by this version: {exc}")
    if args.json:
        emit_json(view)
    else:
        print(render(view, datetime.now(UTC)))
        if routers is not None:
            from haru.core.router_acks import lines

            for line in lines(routers.lag(args.fleet, view.route_revision), view.route_revision, view.active):
                print(line)
    return ExitStatus.OK
