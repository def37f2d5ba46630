"""`haru route [--fleet F] [--watch] [--json]`: the fleet's route intent, and with --watch every change.

`haru route weight DOMAIN=PERCENT... [--model M] [--fleet F] [--wait] [--json]` asks for traffic weights
(haru.core.weights): `haru route weight b=10` sends 10% of the fleet's traffic to b, the active the rest;
b is woken and probed first when it sleeps (a `weighting` operation). `haru route weight --reset
[--model M]` gives the active everything again. Exit statuses: accepted/joined/noop 0, invalid 2
(bad weights: the message names the fix), not_found 3, conflict 4 (another operation in flight),
refused 1 (the domain cannot be woken now); with --wait an aborted operation exits 1.

`haru route follow haproxy|nginx|envoy ...` or `haru route follow --exec CMD` keeps a router's upstreams on
the route and reports what it applied (haru.cli.follow)."""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime

from haru.cli.common import ExitStatus, LinkReporter, add_fleet_option, add_nats_options, emit_json, fail, nats_servers


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
    p.add_argument(
        "words",
        nargs="*",
        metavar="[weight DOMAIN=PERCENT ... | follow TARGET]",
        help="weight b=10 [c=5]: send that share of traffic to those domains (the active takes the rest); "
        "weight --reset: the active takes everything again",
    )
    p.add_argument(
        "--model", default="", help="with weight: split this model's traffic only (default: the whole fleet's)"
    )
    p.add_argument(
        "--reset", action="store_true", help="with weight: back to the default (the active takes everything)"
    )
    p.add_argument("--wait", action="store_true", help="with weight: follow the operation until the split is recorded")
    p.add_argument("--timeout", type=float, default=600.0, help="with weight --wait: give up after this many seconds")
    p.add_argument("--watch", action="store_true", help="keep printing every new intent, in order")
    p.add_argument("--json", action="store_true", help="one JSON RouteIntent per line (for_ms as of printing)")
    from haru.cli.follow import add_options

    add_options(p)
    p.set_defaults(handler=run)


def _print(ri, as_json: bool) -> None:
    from haru.core.intents import at
    from haru.projections.status import render_intent

    now = datetime.now(UTC)
    if as_json:
        emit_json(at(ri, now))
    else:
        print(render_intent(ri, now))
    sys.stdout.flush()


async def run(args: argparse.Namespace) -> ExitStatus:
    words = list(args.words)
    if words and words[0] == "weight":
        return await run_weight(args, words[1:])
    if words and words[0] == "follow":
        from haru.cli.follow import run_follow

        return await run_follow(args, words[1:])
    if words:
        return fail(
            f"haru route takes no arguments but `weight DOMAIN=PERCENT ...` or `follow TARGET`, "
            f"got {' '.join(words)!r}",
            ExitStatus.USAGE,
        )
    if args.model or args.reset:
        return fail("--model and --reset go with `haru route weight`", ExitStatus.USAGE)
    return await _show(args)


_WEIGHT_STATUS = {
    "noop": ExitStatus.OK,
    "accepted": ExitStatus.OK,
    "joined": ExitStatus.OK,
    "conflict": ExitStatus.CONFLICT,
    "refused": ExitStatus.ERROR,
    "not_found": ExitStatus.NOT_FOUND,
    "invalid": ExitStatus.USAGE,
}


async def run_weight(args: argparse.Namespace, pairs: list[str]) -> ExitStatus:
    """`haru route weight b=10 [--model M]` / `--reset`: a weighting operation (haru.log.requests)."""
    from haru.cli.promote import _by, _servers, answer_request
    from haru.core.errors import InvalidWeights, LogUnavailable
    from haru.core.weights import parse_pairs
    from haru.log.eventlog import EventLog
    from haru.log.requests import request_weights

    try:
        given = parse_pairs(pairs)
    except InvalidWeights as exc:
        return fail(str(exc), ExitStatus.USAGE)
    try:
        async with EventLog.connect(_servers(args), writer=_by(), creds=args.nats_creds) as log:
            result = await request_weights(
                log, args.fleet, given, model=args.model, reset=args.reset, by=_by(), now=datetime.now(UTC)
            )
            return await answer_request(log, args, result, _WEIGHT_STATUS[result.status])
    except LogUnavailable as exc:
        return fail(str(exc), ExitStatus.UNAVAILABLE)


async def _show(args: argparse.Namespace) -> ExitStatus:
    from haru.core.errors import HaruError, InvalidName, LogUnavailable
    from haru.core.subjects import check_name
    from haru.log.route import RouteWatcher

    try:
        check_name("fleet", args.fleet)
    except InvalidName as exc:
        return fail(str(exc), ExitStatus.USAGE)
    try:
        async with RouteWatcher(
            nats_servers(args.nats_url), args.fleet, creds=args.nats_creds, writer="cli:route"
        ) as w:
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
