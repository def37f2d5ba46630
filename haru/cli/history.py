"""`haru verify`, `haru why`, `haru as-of`, `haru history`: reading the log back (hearth's CLI, over JetStream)."""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime

import msgspec

from haru.cli.common import (
    ExitStatus,
    add_fleet_option,
    add_nats_options,
    add_replay_timeout_option,
    emit_json,
    fail,
)
from haru.cli.stored import open_log
from haru.core import events as ev
from haru.core import subjects
from haru.core.authority import misplaced
from haru.core.errors import LogDamaged, seq_ranges
from haru.log import history
from haru.log.adapter_reads import adapter_records
from haru.log.reads import checkpoint_start, model_records, why_records
from haru.log.seam import Log


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="walk every subject's hash chain and check every event stands on a subject it may; "
        "say whether history is intact (it is not once a writer recorded that the log lost acknowledged events)",
    )
    add_nats_options(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument(
        "--since-checkpoint",
        action="store_true",
        help="start each fleet's chains at its newest checkpoint (its heads checked against the store) "
        "instead of at sequence 1; without it every event is walked",
    )
    add_replay_timeout_option(p)
    p.set_defaults(handler=run_verify)

    p = sub.add_parser("why", help="a model's residency history as a causal tree, newest first")
    p.add_argument("model", help="the model id, exactly as clients send it")
    add_fleet_option(p)
    p.add_argument("--domain", default="", help="only this domain")
    add_nats_options(p)
    p.add_argument("--json", action="store_true")
    add_replay_timeout_option(p)
    p.set_defaults(handler=run_why)

    p = sub.add_parser("as-of", help="a model's state as of a stream sequence or an ISO-8601 time")
    p.add_argument("model")
    p.add_argument("point", help="a stream sequence (e.g. 1234) or an ISO-8601 time (e.g. 2026-11-29T03:00:00Z)")
    add_fleet_option(p)
    p.add_argument("--domain", default="")
    add_nats_options(p)
    p.add_argument("--json", action="store_true")
    add_replay_timeout_option(p)
    p.set_defaults(handler=run_as_of)

    p = sub.add_parser("history", help="raw history, oldest first")
    p.add_argument("filter", nargs="?", default=subjects.ALL_EVENTS, help="subject filter (default %(default)s)")
    p.add_argument("--from-seq", type=int, default=1)
    p.add_argument("--limit", type=int, default=0, help="only the last N events")
    add_nats_options(p)
    p.add_argument("--json", action="store_true")
    add_replay_timeout_option(p)
    p.set_defaults(handler=run_history)


def _connect(args: argparse.Namespace, who: str):
    """The running control plane's log, or a stopped home's read off its disk (haru.cli.stored)."""
    return open_log(args, who, replay_timeout=args.timeout)


async def _witnesses(log: Log) -> list[history.Witness]:
    """What the views and route intents (outside HARU_EVENTS) say they folded."""
    from haru.core.views import intent_decoder, view_decoder

    out: list[history.Witness] = []
    for key, data in sorted((await log.views()).items()):
        try:
            view = view_decoder.decode(data)
        except msgspec.DecodeError:
            continue  # a view of another version: the projector rebuilds it; it witnesses nothing
        out += history.view_witnesses(key, view)
        intent = await log.last_intent(view.fleet)
        if intent is not None:
            try:
                out += history.intent_witnesses(intent_decoder.decode(intent[0]))
            except msgspec.DecodeError:
                pass
    return out


async def witnessed_findings(log) -> tuple[int, list[history.Finding]]:
    """The stream's last sequence, and what the views and route intents say is missing from it.

    The witnesses are read first and the stream's end after them: on a live fleet the projector
    folds events as they are stored, so a view read after the stream's end could be ahead of it by
    the events stored in between, and a healthy store would be reported cut (exit 11). Read in this
    order, a witness past the end read after it is a real cut."""
    witnesses = await _witnesses(log)
    stream_last = await log.last_seq()
    stored: dict[int, tuple[str, datetime | None]] = {}
    for seq in sorted({w.seq for w in witnesses if w.seq <= stream_last and (w.subject or w.at)}):
        rec = await log.read_seq(seq)
        if rec is not None:
            # A misplaced event moves a view's position but not its `updated_at` (a forgery changes
            # nothing else): its time is no witness, its subject still is.
            placed = rec.event is not None and not misplaced(rec.subject, rec.event)
            stored[seq] = (rec.subject, rec.event.at if placed else None)
    return stream_last, history.check_witnesses(stream_last, witnesses, stored)


async def run_verify(args: argparse.Namespace) -> ExitStatus:
    verifier = history.Verifier()
    damaged: LogDamaged | None = None
    since: dict[str, int] = {}
    async with _connect(args, "verify") as log:
        start = 1
        handler = verifier.add
        if args.since_checkpoint:
            from haru.core.subjects import fleet_of

            start, tips, since, bad = await checkpoint_start(log)
            verifier.tips.update(tips)
            verifier.breaks.extend(bad)

            def handler(rec, add=verifier.add) -> None:
                if rec.seq > since.get(fleet_of(rec.subject), 0):
                    add(rec)

        try:
            await log.replay(handler, from_seq=start)
            if args.since_checkpoint:
                # A record that the log lost acknowledged events stays a failed verify after a checkpoint.
                for pattern in ("haru.evt.*.integrity", "haru.evt.*.*.integrity"):
                    for rec in await log.history(pattern):
                        verifier.note_regressed(rec)
                verifier.regressed.sort(key=lambda r: r.seq)
        except LogDamaged as exc:
            damaged = exc
        stream_last, findings = await witnessed_findings(log)
    missing = damaged.missing if damaged is not None else []
    if args.json:
        emit_json(
            {
                "ok": verifier.ok and damaged is None and not findings,
                "events": verifier.events,
                "subjects": verifier.subjects,
                "stream_last_seq": stream_last,
                "breaks": [{"seq": b.seq, "subject": b.subject, "what": b.what} for b in verifier.breaks],
                "misplaced": [
                    {"seq": m.seq, "subject": m.subject, "type": m.type, "by": m.by, "why": m.why}
                    for m in verifier.misplaced
                ],
                "regressed": [
                    {
                        "seq": r.seq,
                        "subject": r.subject,
                        "by": r.by,
                        "lost": [msgspec.to_builtins(lost) for lost in r.lost],
                    }
                    for r in verifier.regressed
                ],
                "unreadable": missing,
                "damage": str(damaged) if damaged is not None else None,
                "truncation": [{"kind": f.kind, "seq": f.seq, "what": f.what} for f in findings],
                "since_checkpoint": since if args.since_checkpoint else None,
            }
        )
    else:
        for b in verifier.breaks:
            print(str(b))
        for m in verifier.misplaced:
            print(str(m))
        for r in verifier.regressed:
            print(str(r))
        for f in findings:
            print(str(f))
        if damaged is not None:
            print(
                f"verify FAILED — {verifier.events} events read on {verifier.subjects} subjects; the store cannot "
                f"serve sequence(s) {seq_ranges(missing) or f'({damaged.uncounted} uncounted)'}"
                + (f"; {len(verifier.breaks)} break(s)" if verifier.breaks else "")
            )
        elif findings:
            print(
                f"verify FAILED — the chains of {verifier.events} events on {verifier.subjects} subjects "
                f"{'hold' if verifier.ok else 'have breaks'}, but the store was cut: newest events are missing"
            )
        else:
            print(verifier.summary())
        if args.since_checkpoint:
            print(
                "from checkpoints: "
                + (
                    ", ".join(f"{f} after seq {u}" for f, u in sorted(since.items()))
                    or "none yet (every event was walked)"
                )
            )
    if damaged is not None:
        return fail(str(damaged), ExitStatus.LOG_DAMAGED)
    if findings:
        return fail(
            f"{findings[0]}. Acknowledged history is gone from this store: restore it from a backup or a "
            f"cluster peer (docs/operations.md, 'Damaged or truncated log')",
            ExitStatus.LOG_TRUNCATED,
        )
    if verifier.regressed:
        first = verifier.regressed[0]
        return fail(
            f"{first}. The event store lost events it had acknowledged (a power loss with lazy fsync, a damaged or "
            f"restored store): history is not intact and stays so; restore the store from a cluster peer or a backup "
            f"taken after those sequences, or keep it knowing what is gone (docs/operations.md, 'Power loss')",
            ExitStatus.LOG_TRUNCATED,
        )
    if verifier.breaks:
        return ExitStatus.VERIFY_FAILED
    return ExitStatus.MISPLACED if verifier.misplaced else ExitStatus.OK


def _report_misplaced(records, fleet: str) -> None:
    """Say on stderr which events of the fleet no fold applied (they are left out of the answer)."""
    wrong = history.misplaced_records(records)
    if wrong:
        print(
            f"haru: {len(wrong)} misplaced event(s) in fleet {fleet} not applied "
            "(the subject is the authority; `haru verify` fails on them):",
            file=sys.stderr,
        )
        for m in wrong:
            print(f"haru:   {m}", file=sys.stderr)


async def _model_records(args: argparse.Namespace, who: str):
    """The model's records; on damage, what could be read and the LogDamaged to report after it."""
    subjects.check_model_id(args.model)
    damage: list[LogDamaged] = []
    async with _connect(args, who) as log:
        records = await model_records(log, args.fleet, args.model, args.domain, damage)
    return records, (damage[0] if damage else None)


def _damaged(exc: LogDamaged | None, status: ExitStatus) -> ExitStatus:
    """After printing what could be read: the damage, if any, decides the exit status."""
    if exc is None:
        return status
    return fail(f"the answer above may be incomplete: {exc}", ExitStatus.LOG_DAMAGED)


async def run_why(args: argparse.Namespace) -> ExitStatus:
    subjects.check_model_id(args.model)
    damage: list[LogDamaged] = []
    read: list = []
    async with _connect(args, "why") as log:
        have = await why_records(log, args.fleet, args.model, args.domain, damage, read)
        if not have:  # a LoRA adapter served at run time, `<base>:<adapter>`: its versions, probes, routing
            have = await adapter_records(log, args.fleet, args.model, args.domain, damage)
    _report_misplaced(read, args.fleet)
    damaged = damage[0] if damage else None
    if not have and damaged is not None:
        return fail(str(damaged), ExitStatus.LOG_DAMAGED)
    if not have:
        return fail(
            f"no history for model {args.model!r} in fleet {args.fleet!r}"
            + (f" on domain {args.domain!r}" if args.domain else "")
            + " (model ids are matched exactly; `haru status` lists the declared ones)",
            ExitStatus.NOT_FOUND,
        )
    from haru.log.reads import WHY_MAX_EVENTS

    if len(have) >= WHY_MAX_EVENTS:
        print(f"haru: the tree was cut at {WHY_MAX_EVENTS} events; narrow it with --domain", file=sys.stderr)
    roots = history.causal_tree(have)
    if args.json:
        emit_json(history.tree_json(roots))
    else:
        print(history.render_tree(roots))
    return _damaged(damaged, ExitStatus.OK)


def _parse_point(point: str) -> tuple[int | None, datetime | None]:
    if point.isdigit():
        return int(point), None
    try:
        t = datetime.fromisoformat(point.replace("Z", "+00:00"))
    except ValueError:
        raise SystemExit(
            fail(
                f"{point!r} is neither a stream sequence nor an ISO-8601 time (e.g. 1234 or 2026-11-29T03:00:00Z)",
                ExitStatus.USAGE,
            )
        ) from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return None, t


async def run_as_of(args: argparse.Namespace) -> ExitStatus:
    seq, time = _parse_point(args.point)
    records, damaged = await _model_records(args, "as-of")
    _report_misplaced(records if seq is None else [r for r in records if r.seq <= seq], args.fleet)
    states = history.as_of(records, args.model, seq=seq, time=time, domain=args.domain)
    if not states and damaged is not None:
        return fail(str(damaged), ExitStatus.LOG_DAMAGED)
    if not states:
        return fail(
            f"model {args.model!r} had no history in fleet {args.fleet!r} as of {args.point}", ExitStatus.NOT_FOUND
        )
    point = f"seq {seq}" if seq is not None or time is None else time.isoformat()
    if args.json:
        emit_json({d: {"state": s.state, "seq": s.seq, "payload": s.payload} for d, s in states.items()})
        return _damaged(damaged, ExitStatus.OK)
    for d, s in states.items():
        on = f" on {d}" if len(states) > 1 or args.domain else ""
        body = msgspec.json.encode(s.payload).decode()
        print(f"as of {point}: {args.model}{on} was `{s.state}` {body}")
    return _damaged(damaged, ExitStatus.OK)


def _record_json(r) -> dict:
    wrong = history.misplaced_of(r)
    return {
        "seq": r.seq,
        "time": r.time.isoformat(),
        "subject": r.subject,
        "type": ev.tag_of(r.event) if r.event is not None else None,
        "event": msgspec.to_builtins(r.event) if r.event is not None else None,
        "error": r.error or None,
        "misplaced": wrong.why if wrong is not None else None,
    }


async def run_history(args: argparse.Namespace) -> ExitStatus:
    damaged: LogDamaged | None = None
    async with _connect(args, "history") as log:
        try:
            if args.limit and args.from_seq <= 1:  # the last N: read back from the end, not from 1
                records = await log.tail(args.filter, args.limit, strict=True)
            else:
                records = await log.history(args.filter, from_seq=args.from_seq, strict=True)
        except LogDamaged as exc:
            records, damaged = exc.records or [], exc
    if args.limit:
        records = records[-args.limit :]
    if args.json:
        emit_json([_record_json(r) for r in records])
        return _damaged(damaged, ExitStatus.OK)
    for r in records:
        if r.event is None:
            print(f"{r.seq:>7}  {r.time:%Y-%m-%dT%H:%M:%S.%fZ}  {r.subject}  INVALID  {r.error}")
            continue
        body = msgspec.json.encode(ev.payload(r.event)).decode()
        wrong = history.misplaced_of(r)
        note = f"  MISPLACED by {r.event.by or '?'}, not applied: {wrong.why}" if wrong is not None else ""
        print(f"{r.seq:>7}  {r.time:%Y-%m-%dT%H:%M:%S.%fZ}  {r.subject}  {ev.tag_of(r.event)}  {body}{note}")
    return _damaged(damaged, ExitStatus.OK)
