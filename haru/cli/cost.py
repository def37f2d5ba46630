"""`haru cost`: what a fleet's hosts cost over a period, what their hours did, and what they served.

Reads the fleet's history like `haru why` and `haru history` do (the running control plane's log, or a
stopped home's), folds it with `haru.core.cost.account`, and prints a table or `--json`. docs/cost.md
says how each figure is derived.
"""

from __future__ import annotations

import argparse
import re
import sys
from datetime import UTC, datetime, timedelta

from haru.cli.common import (
    ExitStatus,
    add_fleet_option,
    add_nats_options,
    add_replay_timeout_option,
    emit_json,
    fail,
)
from haru.cli.stored import open_log
from haru.core import subjects
from haru.core.cost import CLASSES, Accounting, account, cents
from haru.core.errors import LogDamaged
from haru.core.record import datetime_to_ns

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_HEADS = {
    "active": "active",
    "standby_training": "training",
    "standby_idle": "idle",
    "waking": "waking",
    "lost": "lost",
    "unreachable": "unreachable",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cost",
        help="what a fleet's hosts cost over a period: hours active, training, idle, waking, lost, unreachable; "
        "the HA premium, the training harvested, cost per million tokens",
    )
    add_fleet_option(p)
    p.add_argument(
        "--since",
        default="",
        help="start of the period: an ISO-8601 time, or a duration before --until (24h, 7d); "
        "default: the fleet's first event",
    )
    p.add_argument("--until", default="", help="end of the period (ISO-8601); default: now")
    p.add_argument(
        "--as-of",
        default="",
        help="cost the period as the log knew it at this ISO-8601 time (events recorded later are left out)",
    )
    p.add_argument("--json", action="store_true", help="print the accounting as JSON")
    add_nats_options(p)
    add_replay_timeout_option(p)
    p.set_defaults(handler=run_cost)


def parse_time(text: str, what: str) -> datetime:
    """An ISO-8601 time (a `Z` suffix allowed; no zone means UTC)."""
    try:
        t = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--{what} {text!r} is not an ISO-8601 time; write it like 2026-12-01T00:00:00Z") from None
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def parse_since(text: str, until: datetime) -> datetime:
    m = _DURATION.fullmatch(text.strip())
    if m:
        return until - timedelta(seconds=float(m.group(1)) * _UNIT[m.group(2)])
    return parse_time(text, "since")


async def run_cost(args: argparse.Namespace) -> ExitStatus:
    try:
        subjects.check_name("fleet", args.fleet)
        until = parse_time(args.until, "until") if args.until else datetime.now(UTC)
        since = parse_since(args.since, until) if args.since else None
        as_of = parse_time(args.as_of, "as-of") if args.as_of else None
    except ValueError as exc:
        return fail(str(exc), ExitStatus.USAGE)
    damaged: LogDamaged | None = None
    async with open_log(args, "cost", replay_timeout=args.timeout) as log:
        try:
            records = await log.history(subjects.fleet_events(args.fleet), strict=True)
        except LogDamaged as exc:
            damaged, records = exc, exc.records or []
    if as_of is not None:
        known = datetime_to_ns(as_of)
        records = [r for r in records if r.time_ns <= known]
    if not records:
        return fail(
            f"no history for fleet {args.fleet!r} (`haru status` lists the fleets; --fleet names one)",
            ExitStatus.NOT_FOUND,
        )
    if since is None:
        since = min(r.event.at for r in records if r.event is not None)
    if since >= until:
        return fail(f"--since {since.isoformat()} is not before --until {until.isoformat()}", ExitStatus.USAGE)
    acct = account(records, args.fleet, since=since, until=until)
    for problem in acct.problems:
        print(f"haru: {problem}", file=sys.stderr)
    if args.json:
        emit_json(acct.to_builtins())
    else:
        print(render(acct))
    if damaged is not None:
        return fail(f"the figures above may be incomplete: {damaged}", ExitStatus.LOG_DAMAGED)
    return ExitStatus.OK


def _hours(us: int) -> str:
    return f"{us / 3.6e9:.2f}"


def render(acct: Accounting) -> str:
    """The accounting as a terminal table and a few lines of sums."""
    cur = acct.currency or "(no price)"
    lines = [
        f"fleet {acct.fleet}   {acct.since.isoformat()} .. {acct.until.isoformat()}   hours, and money in {cur}",
        "",
    ]
    head = ["domain", "provider", "gpu", *(_HEADS[c] for c in CLASSES), "unpriced", "cost"]
    rows = [head]
    for name, d in acct.domains.items():
        rows.append(
            [
                name,
                d.provider,
                d.gpu_type,
                *(_hours(d.us[c]) for c in CLASSES),
                _hours(d.unpriced_total_us),
                str(cents(d.total_cost)),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        lines.append(
            "  ".join(v.ljust(w) if i < 3 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths, strict=True)))
        )
    lines.append("")
    training_us = sum(d.training_us for d in acct.domains.values())
    stopped = sum(d.stopped_by_failover for d in acct.domains.values())

    def per_m(value) -> str:
        got = acct.per_million(value)
        return "-" if got is None else str(cents(got))

    sums = [
        ("cost of the fleet", acct.cost, ""),
        ("  serving (one replica)", acct.serving_cost, ""),
        ("  HA premium (the standbys)", acct.ha_premium, ""),
        (
            "  harvested by training",
            acct.harvested,
            f"   {training_us / 3.6e9:.2f} slot-hours trained; {stopped} run(s) stopped early by failovers",
        ),
        ("  net of training", acct.net_cost, ""),
        ("two hot replicas", acct.two_hot_replicas, ""),
        ("difference", acct.difference, "   two hot replicas less the net cost"),
    ]
    width = max(len(str(cents(v))) for _, v, _ in sums)
    for label, value, note in sums:
        lines.append(f"{label:<30}{str(cents(value)).rjust(width)}{note}")
    lines.append(f"{'tokens':<30}{acct.total_tokens:,}")
    lines.append(
        f"{'per million tokens':<30}{per_m(acct.cost)} with HA, {per_m(acct.serving_cost)} without, "
        f"{per_m(acct.net_cost)} net of training"
    )
    if acct.failovers:
        lines.append("")
        lines.append("failovers:")
        for f in acct.failovers:
            took = "in flight" if f.seconds is None else f"{f.seconds:.1f} s"
            lines.append(f"  {f.op_id}  {f.source or '-'} -> {f.target}  {f.reason}  {f.outcome}  {took}")
    if acct.unpriced_us:
        lines.append("")
        unpriced = ", ".join(
            f"{name} {_hours(d.unpriced_total_us)} h" for name, d in acct.domains.items() if d.unpriced_total_us
        )
        lines.append(
            f"unpriced: {unpriced}: no price was in force for these hours; the sums above leave them out "
            f"(declare a price in the layout: docs/cost.md)"
        )
    return "\n".join(lines)
