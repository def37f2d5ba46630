"""Reads of the log that do not grow with it: what `haru why`, `haru as-of`, `haru verify
--since-checkpoint`, the control API and the console read instead of a fleet's whole history.

- `model_records`: a model's own events: its residency subjects (one subject-filtered consumer over
  `haru.evt.<fleet>.*.model.<model>`) and its declarations on the decl subject.
- `why_records`: those, the events they name as their cause (direct gets by sequence, up the chain),
  and the operations and route moves they caused (the op and route subjects from the model's first
  event on).
- `checkpoint_start`: the newest checkpoint of every fleet, its chain heads checked against the store.

Each grows with the model's own life or the fleet's operations, never with the whole log's length.
"""

from __future__ import annotations

from typing import Any

from haru.core import events as ev
from haru.core import subjects
from haru.core.authority import misplaced
from haru.core.errors import LogDamaged
from haru.core.events import WeightsSet
from haru.log import history
from haru.log.record import Record, body_hash
from haru.log.seam import EventReader


async def _read(log: EventReader, subject_filter: str, damage: list[LogDamaged], **kwargs: Any) -> list[Record]:
    """A filtered read; on damage, what could be read (the damage kept to report after the answer)."""
    try:
        return await log.history(subject_filter, strict=True, **kwargs)
    except LogDamaged as exc:
        damage.append(exc)
        return exc.records or []


async def model_records(
    log: EventReader, fleet: str, model: str, domain: str, damage: list[LogDamaged]
) -> list[Record]:
    """The model's own records: its residency subjects on every domain (one subject-filtered consumer)
    and its declarations and admissions on the decl subject. Never the rest of the fleet's history:
    the cost grows with this model's life, not with the log's."""
    residency = await _read(log, subjects.model_events(fleet, model, domain or "*"), damage)
    decl = [r for r in await _read(log, subjects.decl(fleet), damage) if history.concerns_model(r, model, domain)]
    return sorted(decl + residency, key=lambda r: r.seq)


WHY_MAX_EVENTS = 10_000  # a tree bigger than this is cut (and says so)


async def why_records(
    log: EventReader, fleet: str, model: str, domain: str, damage: list[LogDamaged], skipped: list[Record] | None = None
) -> dict[int, Record]:
    """What `haru why` draws: the model's own events, every event they name as a cause (read one by
    one by sequence, up the chain), the operations and route moves those caused (the op and route
    subjects from the model's first event on), and the traffic weights that applied to the model (its
    own split or the fleet's, a canary rollback with its evidence: the weights subject from then on). Reads grow with
    the model's and the fleet's operations' history, never with the whole log."""
    mine = await model_records(log, fleet, model, domain, damage)
    if skipped is not None:
        skipped.extend(mine)
    own = [r for r in mine if r.event is not None and not misplaced(r.subject, r.event)]
    have = {r.seq: r for r in own}
    if not have:
        return have
    wanted = [r.event.cause for r in own if r.event is not None and r.event.cause and r.event.cause not in have]
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
    for rec in await _read(log, subjects.weights(fleet), damage, from_seq=first):
        e = rec.event
        if (
            isinstance(e, WeightsSet)
            and e.model in ("", model)
            and not misplaced(rec.subject, e)
            and len(have) < WHY_MAX_EVENTS
        ):
            have[rec.seq] = rec
    return have


async def fleet_checkpoint(log: EventReader, fleet: str) -> tuple[int, dict[str, tuple[int, str]], list[history.Break]]:
    """The fleet's newest checkpoint: (its `upto`, its chain heads, heads the store does not hold as
    named). (0, {}, []) when the fleet has none (or its last one is misplaced or unreadable)."""
    from haru.core import checkpoints

    rec = await log.last(subjects.checkpoint(fleet))
    e = rec.event if rec is not None else None
    if rec is None or not isinstance(e, ev.Checkpoint) or misplaced(rec.subject, e):
        return 0, {}, []
    tips = checkpoints.heads_of(e)
    bad: list[history.Break] = []
    for subject, (seq, digest) in sorted(tips.items(), key=lambda t: t[1][0]):
        got = await log.read_seq(seq)
        if got is None or got.subject != subject or body_hash(got.data) != digest:
            held = "nothing" if got is None else f"{got.subject} (body sha256 {body_hash(got.data)[:16]}…)"
            bad.append(
                history.Break(
                    seq,
                    subject,
                    f"the checkpoint names seq {seq} as this subject's head "
                    f"(sha256 {digest[:16]}…), the store holds {held} there: "
                    "history before the checkpoint was changed; run a full `haru verify`",
                )
            )
    return e.upto, tips, bad


async def checkpoint_start(
    log: EventReader,
) -> tuple[int, dict[str, tuple[int, str]], dict[str, int], list[history.Break]]:
    """Where `verify --since-checkpoint` starts: (first sequence to walk, the chain heads to start
    from, fleet -> the checkpoint's `upto`, heads that do not match the store). A fleet without a
    checkpoint is walked from sequence 1."""

    fleets = {subjects.fleet_of(s) for s in await log.subject_counts(subjects.ALL_EVENTS)} - {""}
    tips: dict[str, tuple[int, str]] = {}
    covered: dict[str, int] = {}
    bad: list[history.Break] = []
    for fleet in sorted(fleets):
        upto, heads, wrong = await fleet_checkpoint(log, fleet)
        if upto:
            covered[fleet] = upto
            tips.update(heads)
            bad += wrong
    start = min((covered.get(f, 0) for f in fleets), default=0) + 1
    return start, tips, covered, bad
