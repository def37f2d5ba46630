"""`haru promoter`, `haru promote <domain>`, `haru demote <domain>`.

    haru promoter [--fleet F ...] [--id ID]         run a promoter replica (any number may run)
    haru promote <domain> [--fleet F] [--wait] [--json]
    haru demote  <domain> [--fleet F] [--wait] [--json]
    haru roll [<standby>] [--fleet F] [--wait] [--json]  roll the declared layout through the standby
    haru op [<op_id>] [--fleet F] [--json]          list operations, or one operation's steps
    haru op abort [<op_id>] [--fleet F] [--json]    abort the operation in flight (before its point of no return)

promote/demote print the operation id; `--wait` follows `haru.evt.<fleet>.op` and prints each step
as it completes, then the outcome. Exit statuses: noop/accepted/joined 0, conflict 4, refused 1,
not_found 3; with --wait an aborted operation exits 1. `haru op abort` exits the same way (refused:
the operation has passed the step from which it cannot be aborted, e.g. a promotion's flip).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import os
import socket
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from haru.cli.common import (
    ExitStatus,
    add_fleet_option,
    add_log_options,
    add_nats_options,
    configure_logging,
    emit_json,
    fail,
    nats_servers,
)
from haru.core import subjects
from haru.core.errors import LogUnavailable
from haru.core.events import OperationAborted, OperationCompleted, payload, tag_of
from haru.core.operations import as_doc, fold_operations, progress_line
from haru.core.record import Record
from haru.host.metrics import add_metrics_options
from haru.host.tasks import cancel_and_wait, run_until_signal
from haru.log.eventlog import EventLog

if TYPE_CHECKING:
    from haru.log.requests import RequestResult

_STATUS = {
    "noop": ExitStatus.OK,
    "accepted": ExitStatus.OK,
    "joined": ExitStatus.OK,
    "conflict": ExitStatus.CONFLICT,
    "refused": ExitStatus.ERROR,
    "not_found": ExitStatus.NOT_FOUND,
}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "promoter",
        help="run a promoter: the failover saga, auto-failover, liveness",
        description=(
            "Follow the event log, turn heartbeat silence into domain_unreachable, fail over a failed active "
            "(policy auto_failover), and drive promotions and demotions step by step. Any number of replicas "
            "may run: every step is an append with an expected sequence, so exactly one drives each step."
        ),
    )
    p.add_argument("--fleet", action="append", default=None, help="only this fleet (repeatable; default: every fleet)")
    p.add_argument(
        "--id",
        default=os.environ.get("HARU_PROMOTER_ID"),
        help="this replica's writer id, stable across restarts and unique per replica "
        "(env HARU_PROMOTER_ID; default promoter:<host>:<pid>)",
    )
    _add_stream_leaders(p)
    add_nats_options(p)
    add_log_options(p)
    add_metrics_options(p)
    p.set_defaults(handler=run_service)

    helps = {
        "promotion": (
            "make a standby domain active (stop training, verify GPU, wake, probe, flip, settle the old active)"
        ),
        "demotion": "put a standby domain to sleep and start its training (the active cannot be demoted)",
        "rolling": "roll the declared layout through the standby: it applies the changes, is woken, probed and "
        "promoted, then the old active applies them (haru apply requests this itself for a change on the active)",
    }
    for kind, verb in (("promotion", "promote"), ("demotion", "demote"), ("rolling", "roll")):
        help_text = helps[kind]
        q = subparsers.add_parser(verb, help=help_text, description=help_text)
        if kind == "rolling":
            q.add_argument("domain", nargs="?", default="", help="the standby to roll through (default: the standby)")
        elif kind == "promotion":
            q.add_argument(
                "domain",
                nargs="?",
                default="",
                help="the standby to make active (default: the best fit standby in the ranking `haru status` "
                "shows; if it fails before the flip, the next fit one takes over in the same operation)",
            )
        else:
            q.add_argument("domain", help="the domain")
        add_fleet_option(q)
        q.add_argument("--wait", action="store_true", help="follow the operation and print each step, then the outcome")
        q.add_argument("--timeout", type=float, default=600.0, help="with --wait: give up after this many seconds")
        q.add_argument("--json", action="store_true", help="print JSON (with --wait: one object per line)")
        add_nats_options(q)
        q.set_defaults(handler=run_request, kind=kind)

    o = subparsers.add_parser(
        "op",
        help="list a fleet's operations (promotions, demotions, ...), show one's steps, or abort the one in flight",
        description=(
            "Read haru.evt.<fleet>.op: every operation (newest last), or the steps of one (`haru op <op_id>`). "
            "`haru op abort [<op_id>]` aborts the operation in flight (one at a time per fleet), unless it has "
            "passed its point of no return (a promotion's flip)."
        ),
    )
    o.add_argument(
        "words",
        nargs="*",
        metavar="[abort] [op_id]",
        help="nothing: list; an operation id (op-...): its steps; abort [op_id]: abort the one in flight",
    )
    o.add_argument("--why", default="", help="with abort: a reason, recorded in operation_aborted")
    add_fleet_option(o)
    o.add_argument("--json", action="store_true", help="print JSON")
    add_nats_options(o)
    o.set_defaults(handler=run_op)


def _add_stream_leaders(p) -> None:
    p.add_argument(
        "--stream-leaders",
        default=os.environ.get("HARU_STREAM_LEADERS", ""),
        metavar="[DOMAIN=]SERVER[,...]",
        help="keep the event, route and views streams' leaders on these NATS servers (nats.conf's server_name, "
        "most preferred first; DOMAIN=SERVER: beside that domain while it is its fleet's first standby), so that "
        "losing an active's region costs no leader election (docs/deploy.md, 'Where the streams' leaders are'; "
        "env HARU_STREAM_LEADERS; default: wherever JetStream elects them)",
    )


async def run_service(args: argparse.Namespace) -> ExitStatus:
    from haru.host.metrics import metrics_address
    from haru.log.leaders import LeaderKeeper, parse_servers
    from haru.promoter import default_identity, run_promoter

    configure_logging(args.log_format, args.log_level)
    identity = args.id or default_identity()
    # the environment, read once here and passed down: the promoter itself reads none
    step_delay_ms = _step_delay_ms(os.environ.get(STEP_DELAY_ENV, ""))
    sky = os.environ.get("HARU_SKY") or "sky"
    metrics = metrics_address(args.metrics_port, args.metrics_host, os.environ)
    placement = parse_servers(args.stream_leaders or "")
    try:
        async with EventLog.connect(_servers(args), writer=identity, creds=args.nats_creds) as log:
            await log.ensure()

            async def keep_leaders(standbys: Callable[[], list[str]]) -> None:
                await LeaderKeeper(log.nc, lambda: placement.wanted(standbys())).run()

            service = asyncio.create_task(
                run_promoter(
                    log,
                    fleets=args.fleet,
                    identity=identity,
                    metrics=metrics,
                    step_delay_ms=step_delay_ms,
                    sky=sky,
                    beside_standbys=keep_leaders if placement.beside or placement.fixed else None,
                )
            )
            # SIGTERM/SIGINT stop it cleanly: the step in flight is resumed by the next promoter.
            with contextlib.suppress(asyncio.CancelledError):
                await run_until_signal(service)
    except LogUnavailable as exc:
        return fail(str(exc), ExitStatus.UNAVAILABLE)
    except asyncio.CancelledError:
        return ExitStatus.INTERRUPTED
    return ExitStatus.OK


# Tests and demos only: a pause after each step starts, so that a promoter can be killed in the middle of any step.
STEP_DELAY_ENV = "HARU_PROMOTER_STEP_DELAY_MS"


def _step_delay_ms(raw: str) -> int:
    """`HARU_PROMOTER_STEP_DELAY_MS`, read once by `haru promoter` and passed down; empty = no pause."""
    try:
        delay = int(raw or 0)
    except ValueError:
        delay = -1
    if delay < 0:
        from haru.core.errors import ConfigError

        raise ConfigError(
            f"{STEP_DELAY_ENV}={raw!r} is not a whole number of milliseconds >= 0; unset it or set e.g. 300"
        )
    return delay


def _servers(args: argparse.Namespace) -> list[str]:
    servers = nats_servers(args.nats_url or "")
    if not servers:
        from haru.core.errors import ConfigError

        raise ConfigError("--nats-url is empty; pass the NATS URL (e.g. nats://127.0.0.1:4222) or set HARU_NATS_URL")
    return servers


def _by() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name is not worth failing for
        user = "unknown"
    return f"cli:{user}@{socket.gethostname()}"


async def run_request(args: argparse.Namespace) -> ExitStatus:
    from haru.log.requests import request_operation

    kind = args.kind
    try:
        async with EventLog.connect(_servers(args), writer=_by(), creds=args.nats_creds) as log:
            now = datetime.now(UTC)
            result = await request_operation(log, args.fleet, kind, args.domain, by=_by(), now=now)
            return await answer_request(log, args, result, _STATUS[result.status])
    except LogUnavailable as exc:
        return fail(str(exc), ExitStatus.UNAVAILABLE)


async def answer_request(
    log: EventLog, args: argparse.Namespace, result: RequestResult, status: ExitStatus
) -> ExitStatus:
    """Say what became of an operation request (`haru promote`, `haru route weight`), and follow it with --wait.

    Accepted or joined: the op id on stdout, the message on stderr; a no-op: the message; refused or
    conflicting: the message as an error (a conflict names the operation in flight on stdout).
    """
    if args.json:
        emit_json({"status": result.status, "op_id": result.op_id, "message": result.message})
    elif result.op_id and result.status in ("accepted", "joined"):
        print(result.op_id)
        print(f"{result.status}: {result.message}", file=sys.stderr)
    elif result.status == "noop":
        print(result.message)
    else:
        if result.status == "conflict" and result.op_id:
            print(result.op_id)
        return fail(result.message, status)
    if not args.wait or result.status not in ("accepted", "joined"):
        return status
    return await wait_for(
        log, args.fleet, result.op_id, json_out=args.json, timeout=args.timeout, from_seq=result.seq or 1
    )


async def wait_for(
    log: EventLog, fleet: str, op_id: str, *, json_out: bool, timeout: float, from_seq: int = 1
) -> ExitStatus:
    """Follow the fleet's op subject from `from_seq` (the request's own sequence when it is known: the
    operations before it are not read) and print the operation's steps until it ends."""
    outcome: asyncio.Future[ExitStatus] = asyncio.get_running_loop().create_future()

    def on_record(rec: Record) -> None:
        ev = rec.event
        if ev is None or getattr(ev, "op_id", None) != op_id or outcome.done():
            return
        if json_out:
            emit_json({"seq": rec.seq, "type": tag_of(ev), **payload(ev)})
        elif (line := progress_line(op_id, ev)) is not None:
            print(line)
        sys.stdout.flush()
        if isinstance(ev, OperationCompleted):
            outcome.set_result(ExitStatus.OK)
        elif isinstance(ev, OperationAborted):
            outcome.set_result(ExitStatus.ERROR)

    from haru.cli.common import LinkReporter

    url = ", ".join(log.server_urls()) or "NATS"
    forget = log.on_link_change(LinkReporter(url, f"operation {op_id}'s progress"))
    follower = asyncio.create_task(
        log.follow(on_record, subject_filter=subjects.op(fleet), from_seq=from_seq, name="promote-wait")
    )
    try:
        waiting: set[asyncio.Future[Any]] = {outcome, follower}
        done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if outcome.done():
            return outcome.result()
        if follower in done:
            follower.result()
        return fail(
            f"operation {op_id} did not finish within {timeout:.0f}s; it goes on: haru promote --wait again",
            ExitStatus.ERROR,
        )
    finally:
        forget()  # before the connection closes: a clean exit is not the control plane going away
        await cancel_and_wait(follower)


async def run_op(args: argparse.Namespace) -> ExitStatus:
    """List operations, print one operation's steps, or abort the one in flight."""
    words = list(args.words)
    if words and words[0] == "abort":
        if len(words) > 2:
            return fail(f"haru op abort takes at most one operation id, got {' '.join(words[1:])}", ExitStatus.USAGE)
        return await run_abort(args, words[1] if len(words) == 2 else "")
    if len(words) > 1:
        return fail(
            f"haru op takes at most one operation id, got {' '.join(words)} (to abort: haru op abort <op_id>)",
            ExitStatus.USAGE,
        )
    args.op_id = words[0] if words else None
    try:
        async with EventLog.connect(_servers(args), writer=_by(), creds=args.nats_creds) as log:
            records = await log.history(subjects.op(args.fleet))
    except LogUnavailable as exc:
        return fail(str(exc), ExitStatus.UNAVAILABLE)
    ops = {op.op_id: op for op in fold_operations(records)}
    if args.op_id:
        op = ops.get(args.op_id)
        if op is None:
            from haru.promoter.errors import OperationNotFound

            return fail(str(OperationNotFound(args.fleet, args.op_id)), ExitStatus.NOT_FOUND)
        if args.json:
            emit_json(as_doc(op))
            return ExitStatus.OK
        print(f"{op.op_id}  {op.kind} of {op.target} ({op.reason}, by {op.by})  {op.state}")
        if op.tried:
            print(f"  tried first: {', '.join(op.tried)} (each failed before the flip; the operation moved on)")
        for st in op.steps:
            if op.tried and st.domain:
                print(f"  [{st.domain}]", end="")
            if st.state == "started":
                print(f"  {st.step:<18} started (attempt {st.attempt})")
            elif st.state == "completed":
                print(f"  {st.step:<18} ok      {st.took_ms or 0:>6} ms  {st.detail}")
            elif st.state == "skipped":
                print(f"  {st.step:<18} skipped {st.took_ms or 0:>6} ms  {st.detail}")
            else:
                print(f"  {st.step:<18} FAILED  {st.took_ms or 0:>6} ms  {st.error_code}: {st.error}")
        if op.state == "aborted":
            print(f"  aborted at {op.error or '(no step)'} (routing did not move)")
        return ExitStatus.OK
    if args.json:
        emit_json([{k: v for k, v in as_doc(op).items() if k != "steps"} for op in ops.values()])
        return ExitStatus.OK
    if not ops:
        print(f"no operations in fleet {args.fleet}")
    for op in ops.values():
        tail = f"  {op.error}" if op.error else ""
        print(
            f"{op.op_id}  {op.requested_at.isoformat()[:23]}  "
            f"{op.kind:<9} {op.target:<12} {op.reason:<18} {op.state}{tail}"
        )
    return ExitStatus.OK


async def run_abort(args: argparse.Namespace, op_id: str) -> ExitStatus:
    from haru.log.requests import abort_operation

    try:
        async with EventLog.connect(_servers(args), writer=_by(), creds=args.nats_creds) as log:
            result = await abort_operation(log, args.fleet, op_id, by=_by(), now=datetime.now(UTC), why=args.why)
    except LogUnavailable as exc:
        return fail(str(exc), ExitStatus.UNAVAILABLE)
    if args.json:
        emit_json({"status": result.status, "op_id": result.op_id, "message": result.message})
        return _STATUS[result.status]
    if result.status in ("accepted", "noop"):
        print(result.message)
        return ExitStatus.OK
    return fail(result.message, _STATUS[result.status])
