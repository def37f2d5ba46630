"""The replay's hole arithmetic (haru/log/holes.py), against a model of a damaged stream: a dense stream
of sequences 1..N, each on one of a few subjects, some of them unreadable. The model plays what
nats-server does with such a stream (what it delivers, the pending count it keeps, the state it
reports) and the properties say the arithmetic names exactly the damage a replay can miss, without a
damaged server. tests/integration/test_damaged_log.py keeps the real damaged store."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from haru.log import holes


@dataclass(frozen=True)
class Stream:
    subjects: tuple[str, ...]  # subject of sequence i + 1
    damaged: frozenset[int]  # sequences the store cannot serve

    @property
    def end(self) -> int:
        return len(self.subjects)

    def state(self) -> holes.StreamState:
        readable = [q for q in range(1, self.end + 1) if q not in self.damaged]
        return holes.StreamState(
            first_seq=readable[0] if readable else self.end + 1, last_seq=self.end, messages=len(readable)
        )

    def matching(self, subject: str | None, from_seq: int) -> list[int]:
        return [q for q in range(max(from_seq, 1), self.end + 1) if subject is None or self.subjects[q - 1] == subject]


@st.composite
def streams(draw: st.DrawFn) -> Stream:
    subjects = tuple(draw(st.lists(st.sampled_from("abc"), min_size=0, max_size=60)))
    damaged = draw(st.frozensets(st.integers(1, max(1, len(subjects))), max_size=8)) if subjects else frozenset()
    return Stream(subjects, frozenset(q for q in damaged if q <= len(subjects)))


def deliver(stream: Stream, subject: str | None, from_seq: int) -> tuple[list[tuple[int, int]], int, int]:
    """What a replay sees: the gaps an unfiltered one records (as its callback does), the last
    sequence handled, and the pending count of the last delivery (damaged messages stay counted)."""
    last_handled, gaps, pending = from_seq - 1, [], 0
    wanted = stream.matching(subject, from_seq)
    for i, seq in enumerate(wanted):
        if seq in stream.damaged:
            continue
        if subject is None:
            hole = holes.gap(last_handled, seq)
            if hole is not None:
                gaps.append(hole)
        last_handled = seq
        pending = len(wanted) - i - 1
    if last_handled == from_seq - 1:
        pending = len(wanted)  # nothing delivered: the consumer's first count
    return gaps, last_handled, pending


@given(streams(), st.integers(1, 70))
def test_an_unfiltered_replay_names_exactly_the_damage_from_its_start(stream, from_seq):
    gaps, last_handled, _ = deliver(stream, None, from_seq)
    missing = holes.missing_unfiltered(gaps, last_handled, from_seq, stream.end)
    assert missing == sorted(q for q in stream.damaged if q >= from_seq)


@given(streams(), st.sampled_from("abc"), st.integers(1, 70))
def test_a_filtered_replay_scans_whenever_damage_could_hide_in_its_range(stream, subject, from_seq):
    _, _, pending = deliver(stream, subject, from_seq)
    damage_in_range = any(q >= from_seq for q in stream.damaged)
    scan = holes.needs_scan(stream.state(), from_seq, pending, strict=True)
    assert scan or not damage_in_range  # strict: no damage in range goes unscanned
    if not stream.damaged:
        assert not scan  # an intact stream is never scanned


@given(streams(), st.sampled_from("abc"), st.integers(1, 70))
def test_a_lenient_filtered_replay_scans_only_for_damage_on_its_own_subject(stream, subject, from_seq):
    _, _, pending = deliver(stream, subject, from_seq)
    own = [q for q in stream.damaged if q >= from_seq and stream.subjects[q - 1] == subject]
    scan = holes.needs_scan(stream.state(), from_seq, pending, strict=False)
    if scan:
        assert own  # no false alarm
    readable = [q for q in stream.matching(subject, from_seq) if q not in stream.damaged]
    if any(q > max(readable, default=0) for q in own):
        assert scan  # damage after the last readable message stays counted as pending: always found


def test_damage_before_the_last_readable_message_is_found_only_when_strict():
    stream = Stream(("a", "a", "a"), frozenset({1}))
    _, _, pending = deliver(stream, "a", 1)
    assert pending == 0  # the server's count says nothing of what it skipped
    assert not holes.needs_scan(stream.state(), 1, pending, strict=False)
    assert holes.needs_scan(stream.state(), 1, pending, strict=True)


@given(streams(), st.integers(1, 70))
def test_the_state_counts_every_unreadable_sequence_from_the_start(stream, from_seq):
    counted = holes.holes_in_state(stream.state(), from_seq)
    assert counted >= sum(1 for q in stream.damaged if q >= from_seq)
    if not stream.damaged:
        assert counted == 0


@given(st.integers(0, 1000), st.integers(1, 1000))
def test_a_gap_is_the_sequences_between_the_last_handled_and_the_next(last_handled, seq):
    hole = holes.gap(last_handled, seq)
    if seq <= last_handled + 1:
        assert hole is None
    else:
        assert hole == (last_handled + 1, seq - 1)


def test_a_replay_that_stops_short_is_missing_its_tail():
    assert holes.missing_unfiltered([(3, 4)], last_handled=7, from_seq=1, end=10) == [3, 4, 8, 9, 10]


@pytest.mark.parametrize(
    "reply, pending, cseq",
    [
        ("$JS.ACK.HARU_EVENTS.c1.1.42.7.1700000000000000000.3", 3, 7),
        ("$JS.ACK.dom.acc.HARU_EVENTS.c1.1.42.7.1700000000000000000.0.tok", 0, 7),
    ],
)
def test_pending_and_consumer_sequence_read_both_reply_subject_forms(reply, pending, cseq):
    tokens = reply.split(".")
    assert holes.pending(tokens) == pending and holes.consumer_seq(tokens) == cseq
    assert holes.consumer_seq([]) == 0


def test_the_message_names_the_sequences_the_filter_and_the_fix():
    text = holes.damage_message("haru.evt.default.a.>", 5, [7, 8, 9], 0, 12, unfiltered=False)
    assert "cannot serve sequences 7-9" in text and "may belong to haru.evt.default.a.>" in text
    assert "from seq 5" in text and "1..12" in text and "restore the store" in text
    counted = holes.damage_message("haru.evt.>", 1, [], 2, 12, unfiltered=True)
    assert "counted 2 message(s)" in counted
