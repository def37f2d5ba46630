"""`haru apply -f layout.json [--dry-run] [--no-roll] [--json]`: validate, plan, and record the differences.

A change that would interrupt a model the active domain serves (a changed model there) is then rolled
through the standby: `haru apply` requests a `rolling` operation (the promoter drives it; `haru op`
shows it), unless `--no-roll`."""

from __future__ import annotations

import argparse
import getpass
import socket
import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from haru.cli.common import ExitStatus, add_nats_options, emit_json, fail, nats_servers
from haru.core.apply import change_paths, describe, running_at_risk, waits_on_active
from haru.core.errors import Conflict, LayoutError, LogError, LogUnavailable
from haru.core.events import payload, tag_of
from haru.core.layout import load_layout
from haru.core.planner import Plan, verdict_line
from haru.core.planner import plan as plan_layout
from haru.core.sizes import format_gib
from haru.core.subjects import decl
from haru.log.apply import ApplyResult, apply

if TYPE_CHECKING:
    from haru.log.requests import RequestResult


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "apply",
        help="validate a fleet layout, plan its VRAM, and record what changed",
        description=(
            "Validate a layout, plan admission per GPU (first fit in declaration order), and append only "
            "the differences to haru.evt.<fleet>.decl. Re-applying the same layout appends nothing. "
            "Models that do not fit are recorded not_admitted with their shortfall; the rest are admitted."
        ),
    )
    p.add_argument("-f", "--file", required=True, metavar="LAYOUT.json", help="the layout file")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan, the differences and every running model a change would stop or unload, "
        "without writing; with NATS unreachable, validate and plan only (exit 0 when valid)",
    )
    p.add_argument(
        "--no-roll",
        action="store_true",
        help="record the changes only: a change on the active domain waits until it is the standby "
        "(request the rolling change later with `haru roll`)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_nats_options(p)
    p.set_defaults(handler=run)


def plan_lines(plan: Plan) -> list[str]:
    """The plan as hearth prints it: one summary line per GPU, one line per model and training slot."""
    lines: list[str] = []
    for d in plan.domains:
        for g in d.gpus:
            lines.append(f"domain {d.domain} gpu {g.index}: {g.summary()}")
            for v in g.models:
                lines.append("  " + verdict_line(v))
            for v in g.training:
                line = "  " + verdict_line(v)
                if v.admitted:
                    line += f" beside {format_gib(g.residual_bytes)} kept by sleeping runtimes"
                lines.append(line)
    return lines


def _result_json(result: ApplyResult) -> dict:
    verdicts = result.plan.verdicts()
    return {
        "fleet": result.fleet,
        "dry_run": result.dry_run,
        "subject": decl(result.fleet),
        "last_seq": result.last_seq,
        "changes": [
            {"type": tag_of(e), **payload(e), "seq": s}
            for e, s in zip(result.events, result.seqs or [0] * len(result.events), strict=True)
        ],
        "admitted": [
            {"domain": v.domain, "kind": v.kind, "name": v.name, "gpu_index": v.gpu_index, "vram_bytes": v.vram_bytes}
            for v in verdicts
            if v.admitted
        ],
        "not_admitted": [
            {
                "domain": v.domain,
                "kind": v.kind,
                "name": v.name,
                "gpu_index": v.gpu_index,
                "vram_bytes": v.vram_bytes,
                "short_by_bytes": v.short_by_bytes,
            }
            for v in verdicts
            if not v.admitted
        ],
        "gpus": [
            {
                "domain": g.domain,
                "index": g.index,
                "memory_bytes": g.memory_bytes,
                "reserve_bytes": g.reserve_bytes,
                "capacity_bytes": g.capacity_bytes,
                "held_bytes": g.held_bytes,
                "residual_bytes": g.residual_bytes,
                "training_bytes": g.training_bytes,
                "declared": g.declared,
                "admitted": g.admitted,
            }
            for d in result.plan.domains
            for g in d.gpus
        ],
    }


async def _active_domain(log, layout) -> str:
    """The fleet's active domain: the last route_moved, else the first declared domain."""
    from haru.core.events import RouteMoved
    from haru.core.subjects import route

    rec = await log.last(route(layout.fleet))
    if rec is not None and isinstance(rec.event, RouteMoved) and rec.event.active:
        return rec.event.active
    return layout.domains[0].spec.name if layout.domains else ""


def _writer() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name is not an error
        user = "unknown"
    return f"cli:{user}@{socket.gethostname()}"


async def _view(log, fleet: str):
    """The fleet's projected view (what runs now), or None when no projector wrote one."""
    from haru.core.views import view_decoder

    got = await log.get_view(f"fleet.{fleet}")
    return view_decoder.decode(got[0]) if got is not None else None


def _offline_plan(args: argparse.Namespace, layout, why: str) -> ExitStatus:
    """`--dry-run` without the log: the layout is valid and its plan needs nothing else."""
    the_plan = plan_layout(layout)
    note = (
        f"dry run without the running state: {why}; the layout is valid and the plan above is what "
        f"`haru apply` would record, but the differences from what is declared and the running models a "
        f"change would stop or unload were not read"
    )
    if args.json:
        doc = {
            "fleet": layout.fleet,
            "dry_run": True,
            "running_state_read": False,
            "note": note,
            "admitted": [
                {
                    "domain": v.domain,
                    "kind": v.kind,
                    "name": v.name,
                    "gpu_index": v.gpu_index,
                    "vram_bytes": v.vram_bytes,
                }
                for v in the_plan.verdicts()
                if v.admitted
            ],
            "not_admitted": [
                {
                    "domain": v.domain,
                    "kind": v.kind,
                    "name": v.name,
                    "gpu_index": v.gpu_index,
                    "vram_bytes": v.vram_bytes,
                    "short_by_bytes": v.short_by_bytes,
                }
                for v in the_plan.verdicts()
                if not v.admitted
            ],
        }
        emit_json(doc)
        return ExitStatus.OK
    for line in plan_lines(the_plan):
        print(line)
    print(note)
    return ExitStatus.OK


async def run(args: argparse.Namespace) -> ExitStatus:
    import os

    from haru.log.eventlog import EventLog

    if not os.path.exists(args.file):
        return fail(
            f"{args.file}: no such file: pass the path of a layout JSON file, e.g. deploy/examples/demo-fleet.json",
            ExitStatus.USAGE,
        )
    try:
        layout = load_layout(args.file)
    except LayoutError as exc:
        return fail(f"{args.file}: {exc}")
    now = datetime.now(UTC)
    at_risk: list[str] = []
    try:
        async with EventLog.connect(nats_servers(args.nats_url), writer="cli:apply", creds=args.nats_creds) as log:
            await log.ensure()
            view = await _view(log, layout.fleet)
            result = await apply(log, layout, now, dry_run=args.dry_run, by=_writer())
            active = await _active_domain(log, layout)
            at_risk = running_at_risk(result.events, view, active)
            rolling = None
            waiting = waits_on_active(result.events, active)
            if waiting and not args.dry_run and not args.no_roll and len(layout.domains) > 1:
                from haru.core.events import ModelChanged
                from haru.log.requests import request_operation

                cause = next(
                    s
                    for e, s in zip(result.events, result.seqs, strict=True)
                    if isinstance(e, ModelChanged) and f"{e.domain}/{e.spec.name}" in waiting
                )
                rolling = await request_operation(
                    log,
                    layout.fleet,
                    "rolling",
                    "",
                    by=_writer(),
                    now=now,
                    reason="layout_changed",
                    detail=f"changed on the active domain: {', '.join(waiting)}",
                    cause=cause,
                )
    except Conflict as exc:
        return fail(f"{exc}; another apply kept winning the race, run it again", ExitStatus.CONFLICT)
    except LogUnavailable as exc:
        if args.dry_run:
            # The layout is valid and the plan needs no log: show it, and say what was not read.
            return _offline_plan(args, layout, str(exc))
        return fail(str(exc), ExitStatus.UNAVAILABLE)
    except LogError as exc:
        return fail(str(exc))
    if args.json:
        doc = _result_json(result)
        doc["running_state_read"] = True
        doc["running_at_risk"] = at_risk
        if result.dry_run:
            doc["paths"] = change_paths(result.events, active)
        if rolling is not None:
            doc["rolling"] = {"status": rolling.status, "op_id": rolling.op_id, "message": rolling.message}
        emit_json(doc)
        return ExitStatus.OK
    _print_result(result, active, rolling, waiting, at_risk)
    return ExitStatus.OK


def _print_result(
    result: ApplyResult, active: str, rolling: RequestResult | None, waiting: list[str], at_risk: list[str]
) -> None:
    """What `haru apply` did (or would do), for a person: the plan, the events, how each change reaches
    the agents, the running models it stops or unloads, the rolling change, what was not admitted."""
    out = sys.stdout
    subject = decl(result.fleet)
    for line in plan_lines(result.plan):
        print(line, file=out)
    if not result.events:
        print(
            f"fleet {result.fleet} is up to date: nothing to append (last seq {result.last_seq} on {subject})", file=out
        )
    else:
        if result.dry_run:
            print(
                f"dry run: would append {len(result.events)} event(s) to {subject} after seq {result.last_seq}:",
                file=out,
            )
        else:
            print(
                f"appended {len(result.events)} event(s) to {subject} (seq {result.seqs[0]}..{result.seqs[-1]}):",
                file=out,
            )
        for e in result.events:
            print("  " + describe(e), file=out)
        if result.dry_run:
            paths = change_paths(result.events, active)
            if paths:
                print(
                    f"how each change reaches the running agents (active domain: {active}; agents that read a "
                    f"layout file of their own pick changes up when restarted):",
                    file=out,
                )
                for line in paths:
                    print("  " + line, file=out)
    if at_risk:
        verb = "would stop or unload" if result.dry_run else "stops or unloads"
        print(f"running models this change {verb} ({len(at_risk)}):", file=out)
        for line in at_risk:
            print("  " + line, file=out)
    elif result.events:
        print("no running model is stopped or unloaded by this change", file=out)
    if rolling is not None:
        if rolling.status in ("accepted", "joined"):
            verb = "requested" if rolling.status == "accepted" else "already in flight, joined"
            print(
                f"rolling change {rolling.op_id} {verb} for {', '.join(waiting)} (changed on the active domain "
                f"{active}): follow it with `haru op {rolling.op_id} --fleet {result.fleet}`",
                file=out,
            )
        else:
            print(
                f"haru: the changes to {', '.join(waiting)} wait on the active domain {active}: the rolling change was "
                f"not requested ({rolling.status}: {rolling.message}); "
                f"request it with `haru roll --fleet {result.fleet}`",
                file=sys.stderr,
            )
    elif waiting and not result.dry_run:
        print(
            f"the changes to {', '.join(waiting)} wait on the active domain {active} until it is the standby "
            f"(request the rolling change with `haru roll --fleet {result.fleet}`)",
            file=out,
        )
    refused = result.plan.not_admitted()
    if refused:
        names = ", ".join(f"{v.domain}/{v.name} (short by {format_gib(v.short_by_bytes)})" for v in refused)
        verb = "would be recorded" if result.dry_run else "recorded"
        print(f"{len(refused)} not admitted ({verb}): {names}", file=out)
