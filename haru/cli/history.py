"""`haru verify`, `haru why`, `haru as-of`, `haru history`: reading the log back (hearth's CLI, over JetStream)."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone

import msgspec

from haru import events as ev
from haru import history, subjects
from haru.cli.common import (ExitStatus, add_fleet_option, add_nats_options, add_replay_timeout_option, emit_json,
                             fail, nats_servers)
from haru.authority import misplaced
from haru.errors import LogDamaged, seq_ranges
from haru.eventlog import EventLog, body_hash


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="walk every subject's hash chain and check every event stands on a subject it may; say whether history is intact",
    )
    add_nats_options(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--since-checkpoint", action="store_true",
                   help="start each fleet's chains at its newest checkpoint (its heads checked against the store) "
                        "instead of at sequence 1; without it every event is walked")
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
    return EventLog.connect(nats_servers(args.nats_url), writer=f"cli:{who}", creds=args.nats_creds,
                            replay_timeout=args.timeout)


async def _witnesses(log: EventLog) -> list[history.Witness]:
    """What the views and route intents (outside HARU_EVENTS) say they folded."""
    from haru.views import intent_decoder, view_decoder

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


async def checkpoint_start(log: EventLog) -> tuple[int, dict[str, tuple[int, str]], dict[str, int], list[history.Break]]:
    """Where `verify --since-checkpoint` starts: (first sequence to walk, the chain heads to start
    from, fleet -> the checkpoint's `upto`, heads that do not match the store). A fleet without a
    checkpoint is walked from sequence 1."""
    from haru import checkpoints

    fleets = {checkpoints.fleet_of(s) for s in await log.subject_counts(subjects.ALL_EVENTS)} - {""}
    tips: dict[str, tuple[int, str]] = {}
    covered: dict[str, int] = {}
    for fleet in sorted(fleets):
        rec = await log.last(subjects.checkpoint(fleet))
        e = rec.event if rec is not None else None
        if not isinstance(e, ev.Checkpoint) or misplaced(rec.subject, e):
            continue
        covered[fleet] = e.upto
        tips.update(checkpoints.heads_of(e))
    bad: list[history.Break] = []
    for subject, (seq, digest) in sorted(tips.items(), key=lambda t: t[1][0]):
        rec = await log.read_seq(seq)
        if rec is None or rec.subject != subject or body_hash(rec.data) != digest:
            got = "nothing" if rec is None else f"{rec.subject} (body sha256 {body_hash(rec.data)[:16]}…)"
            bad.append(history.Break(seq, subject, f"the checkpoint names seq {seq} as this subject's head "
                                     f"(sha256 {digest[:16]}…), the store holds {got} there: "
                                     "history before the checkpoint was changed; run a full `haru verify`"))
    start = min((covered.get(f, 0) for f in fleets), default=0) + 1
    return start, tips, covered, bad


async def run_verify(args: argparse.Namespace) -> ExitStatus:
    verifier = history.Verifier()
    damaged: LogDamaged | None = None
    since: dict[str, int] = {}
    async with _connect(args, "verify") as log:
        start = 1
        handler = verifier.add
        if args.since_checkpoint:
            from haru.checkpoints import fleet_of

            start, tips, since, bad = await checkpoint_start(log)
            verifier.tips.update(tips)
            verifier.breaks.extend(bad)

            def handler(rec, add=verifier.add) -> None:
                if rec.seq > since.get(fleet_of(rec.subject), 0):
                    add(rec)
        try:
            await log.replay(handler, from_seq=start)
        except LogDamaged as exc:
            damaged = exc
        stream_last = await log.last_seq()
        witnesses = await _witnesses(log)
        stored: dict[int, tuple[str, datetime | None]] = {}
        for seq in sorted({w.seq for w in witnesses if w.seq <= stream_last and (w.subject or w.at)}):
            rec = await log.read_seq(seq)
            if rec is not None:
                # A misplaced event moves a view's position but not its `updated_at` (a forgery changes
                # nothing else): its time is no witness, its subject still is.
                placed = rec.event is not None and not misplaced(rec.subject, rec.event)
                stored[seq] = (rec.subject, rec.event.at if placed else None)
    findings = history.check_witnesses(stream_last, witnesses, stored)
    missing = damaged.missing if damaged is not None else []
    if args.json:
        emit_json({"ok": verifier.ok and damaged is None and not findings and not verifier.misplaced,
                   "events": verifier.events, "subjects": verifier.subjects, "stream_last_seq": stream_last,
                   "breaks": [{"seq": b.seq, "subject": b.subject, "what": b.what} for b in verifier.breaks],
                   "misplaced": [{"seq": m.seq, "subject": m.subject, "type": m.type, "by": m.by, "why": m.why}
                                 for m in verifier.misplaced],
                   "unreadable": missing, "damage": str(damaged) if damaged is not None else None,
                   "truncation": [{"kind": f.kind, "seq": f.seq, "what": f.what} for f in findings],
                   "since_checkpoint": since if args.since_checkpoint else None})
    else:
        for b in verifier.breaks:
            print(str(b))
        for m in verifier.misplaced:
            print(str(m))
        for f in findings:
            print(str(f))
        if damaged is not None:
            print(f"verify FAILED — {verifier.events} events read on {verifier.subjects} subjects; the store cannot "
                  f"serve sequence(s) {seq_ranges(missing) or f'({damaged.uncounted} uncounted)'}"
                  + (f"; {len(verifier.breaks)} break(s)" if verifier.breaks else ""))
        elif findings:
            print(f"verify FAILED — the chains of {verifier.events} events on {verifier.subjects} subjects "
                  f"{'hold' if verifier.ok else 'have breaks'}, but the store was cut: newest events are missing")
        else:
            print(verifier.summary())
        if args.since_checkpoint:
            print("from checkpoints: " + (", ".join(f"{f} after seq {u}" for f, u in sorted(since.items()))
                                          or "none yet (every event was walked)"))
    if damaged is not None:
        return fail(str(damaged), ExitStatus.LOG_DAMAGED)
    if findings:
        return fail(
            f"{findings[0]}. Acknowledged history is gone from this store: restore it from a backup or a "
            f"cluster peer (docs/operations.md, 'Damaged or truncated log')",
            ExitStatus.LOG_TRUNCATED,
        )
    if verifier.breaks:
        return ExitStatus.VERIFY_FAILED
    return ExitStatus.MISPLACED if verifier.misplaced else ExitStatus.OK


def _report_misplaced(records, fleet: str) -> None:
    """Say on stderr which events of the fleet no fold applied (they are left out of the answer)."""
    wrong = history.misplaced_records(records)
    if wrong:
        print(f"haru: {len(wrong)} misplaced event(s) in fleet {fleet} not applied "
              "(the subject is the authority; `haru verify` fails on them):", file=sys.stderr)
        for m in wrong:
            print(f"haru:   {m}", file=sys.stderr)


async def _read(log: EventLog, subject_filter: str, damage: list[LogDamaged], **kwargs) -> list:
    """A filtered read; on damage, what could be read (the damage kept to report after the answer)."""
    try:
        return await log.history(subject_filter, strict=True, **kwargs)
    except LogDamaged as exc:
        damage.append(exc)
        return exc.records or []


async def model_records(log: EventLog, fleet: str, model: str, domain: str, damage: list[LogDamaged]) -> list:
    """The model's own records: its residency subjects on every domain (one subject-filtered consumer)
    and its declarations and admissions on the decl subject. Never the rest of the fleet's history:
    the cost grows with this model's life, not with the log's."""
    residency = await _read(log, subjects.model_events(fleet, model, args_domain(domain)), damage)
    decl = [r for r in await _read(log, subjects.decl(fleet), damage) if history.concerns_model(r, model, domain)]
    return sorted(decl + residency, key=lambda r: r.seq)


def args_domain(domain: str) -> str:
    return domain or "*"


async def _model_records(args: argparse.Namespace, who: str):
    """The model's records; on damage, what could be read and the LogDamaged to report after it."""
    subjects.check_model_id(args.model)
    damage: list[LogDamaged] = []
    async with _connect(args, who) as log:
        records = await model_records(log, args.fleet, args.model, args.domain, damage)
    return records, (damage[0] if damage else None)


WHY_MAX_EVENTS = 10_000  # a tree bigger than this is cut (and says so)


async def why_records(log: EventLog, fleet: str, model: str, domain: str, damage: list[LogDamaged],
                      skipped: list | None = None) -> dict:
    """What `haru why` draws: the model's own events, every event they name as a cause (read one by
    one by sequence, up the chain), and the operations and route moves those caused (the op and route
    subjects from the model's first event on). Reads grow with the model's and the fleet's operations'
    history, never with the whole log."""
    mine = await model_records(log, fleet, model, domain, damage)
    if skipped is not None:
        skipped.extend(mine)
    own = [r for r in mine if r.event is not None and not misplaced(r.subject, r.event)]
    have = {r.seq: r for r in own}
    if not have:
        return have
    wanted = [r.event.cause for r in own if r.event.cause and r.event.cause not in have]
    while wanted and len(have) < WHY_MAX_EVENTS:
        seq = wanted.pop()
        if seq in have:
            continue
        rec = await log.read_seq(seq)
        if rec is None or rec.event is None or misplaced(rec.subject, rec.event):
            continue  # the tree says the link is broken (history.missing_link)
        have[seq] = rec
        if rec.event.cause and rec.event.cause not in have:
            wanted.append(rec.event.cause)
    first = min(have)
    later = await _read(log, subjects.op(fleet), damage, from_seq=first)
    later += await _read(log, subjects.route(fleet), damage, from_seq=first)
    for rec in sorted(later, key=lambda r: r.seq):
        e = rec.event
        if e is not None and e.cause in have and not misplaced(rec.subject, e) and len(have) < WHY_MAX_EVENTS:
            have[rec.seq] = rec
    return have


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
        raise SystemExit(fail(f"{point!r} is neither a stream sequence nor an ISO-8601 time "
                              "(e.g. 1234 or 2026-11-29T03:00:00Z)", ExitStatus.USAGE))
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return None, t


async def run_as_of(args: argparse.Namespace) -> ExitStatus:
    seq, time = _parse_point(args.point)
    records, damaged = await _model_records(args, "as-of")
    _report_misplaced(records if seq is None else [r for r in records if r.seq <= seq], args.fleet)
    states = history.as_of(records, args.model, seq=seq, time=time, domain=args.domain)
    if not states and damaged is not None:
        return fail(str(damaged), ExitStatus.LOG_DAMAGED)
    if not states:
        return fail(f"model {args.model!r} had no history in fleet {args.fleet!r} as of {args.point}", ExitStatus.NOT_FOUND)
    point = f"seq {seq}" if seq is not None else time.isoformat()
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
            records = await log.history(args.filter, from_seq=args.from_seq, strict=True)
        except LogDamaged as exc:
            records, damaged = exc.records or [], exc
    if args.limit:
        records = records[-args.limit:]
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
