"""The hole arithmetic of a replay: which sequences a replay of the event stream is missing. Pure.

The event stream denies deletes and purges and has no limits, so its sequences are dense from 1: a
sequence the stream once stored and cannot serve now is damage (a flipped byte in a block file, a
truncated store), never a deleted message. A replay learns of holes three ways, and this module turns
what it saw into the sequences to name (haru/log/js_replay.py calls it; tests/unit/test_holes.py
checks it with hypothesis against a model of a damaged stream):

- **Unfiltered** (`haru.evt.>`), every delivered sequence must follow the one before: a jump is a
  hole (`gap`), and a replay that stops before the stream's last sequence is missing its tail
  (`missing_unfiltered`).
- **Filtered**, the sequences in between belong to other subjects, so only counts tell: messages the
  consumer counted as pending but never delivered (`pending` of the last delivery), or (strict) the
  ones the stream's state says it lacks (`holes_in_state`). Either asks for an unfiltered scan of the
  range (`needs_scan`), which names the sequences.
- `damage_message` words what was found for the operator, with the fix.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from haru.core.errors import seq_ranges

__all__ = [
    "StreamState",
    "consumer_seq",
    "damage_message",
    "gap",
    "holes_in_state",
    "missing_unfiltered",
    "needs_scan",
    "pending",
]


class StreamState(msgspec.Struct, frozen=True):
    """What the stream said of itself when a replay started: first and last sequence, messages held."""

    first_seq: int
    last_seq: int
    messages: int


def gap(last_handled: int, seq: int) -> tuple[int, int] | None:
    """The sequences (first, last inclusive) an unfiltered delivery of `seq` skipped after
    `last_handled`, or None when `seq` follows it (or is a redelivery)."""
    if seq <= last_handled + 1:
        return None
    return last_handled + 1, seq - 1


def missing_unfiltered(gaps: Iterable[tuple[int, int]], last_handled: int, from_seq: int, end: int) -> list[int]:
    """The sequences an unfiltered replay from `from_seq` of a stream ending at `end` did not
    deliver: its gaps, and its tail when it stopped before `end`. Sorted, without repeats."""
    missing: set[int] = set()
    for a, b in gaps:
        missing.update(range(max(a, from_seq, 1), b + 1))  # past `end` too: appended while it replayed
    missing.update(range(max(last_handled + 1, from_seq, 1), end + 1))
    return sorted(missing)


def holes_in_state(state: StreamState, from_seq: int) -> int:
    """How many sequences the stream's state says it lacks that a replay from `from_seq` could
    miss: the ones between its first and last it does not hold, and the ones before its first
    (a stream whose head is gone) from `from_seq` on."""
    end = state.last_seq
    first = state.first_seq if state.messages else end + 1
    inside = max(0, end - first + 1 - state.messages)
    before = max(0, min(first, end + 1) - max(from_seq, 1))
    return inside + before


def needs_scan(state: StreamState, from_seq: int, undelivered: int, strict: bool) -> bool:
    """Whether a filtered replay must scan its range unfiltered to name holes: the range is not
    empty, and the consumer counted messages it never delivered or (`strict`) the state lacks some."""
    span = max(0, state.last_seq - max(from_seq, 1) + 1)
    return span > 0 and (undelivered > 0 or (strict and holes_in_state(state, from_seq) > 0))


def pending(tokens: Sequence[str]) -> int:
    """The pending count of a JetStream delivery, from its reply subject's tokens:
    v1 `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>` (9 tokens) or
    v2 `$JS.ACK.<domain>.<account>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>.<token>`."""
    return int(tokens[8] if len(tokens) == 9 else tokens[10])


def consumer_seq(tokens: Sequence[str]) -> int:
    """The consumer sequence of a delivery, from its reply subject's tokens (0 for none)."""
    if not tokens:
        return 0
    return int(tokens[6] if len(tokens) == 9 else tokens[8])


def damage_message(
    subject_filter: str, from_seq: int, missing: Sequence[int], undelivered: int, end: int, unfiltered: bool
) -> str:
    """What a replay that found damage tells the operator: what cannot be served, where, and the fix."""
    where = f"{subject_filter} from seq {from_seq}" if from_seq > 1 else subject_filter
    if missing:
        what = f"cannot serve sequence{'s' if len(missing) > 1 else ''} {seq_ranges(list(missing))}"
        if not unfiltered:
            what += (
                f" (their subjects cannot be read: they may belong to {subject_filter})"
                if len(missing) > 1
                else f" (its subject cannot be read: it may belong to {subject_filter})"
            )
    else:
        what = f"counted {undelivered} message(s) matching {subject_filter} that it could not deliver"
    return (
        f"the event store {what}, while replaying {where} (the stream holds 1..{end}); every other event "
        f"was read. Its files are damaged: restore the store from a backup or a cluster peer "
        f"(docs/operations.md, 'Damaged or truncated log')"
    )
