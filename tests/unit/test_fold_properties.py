"""Property: folding all events at once equals folding them one at a time, or in any batching,
including through the JSON round trip a view takes when the projector stores it and resumes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from haru.core.fold import empty, evolve, fold
from haru.core.views import view_decoder, view_encoder
from tests.support.fold_histories import histories


@settings(max_examples=150, deadline=None)
@given(history=histories(), data=st.data())
def test_any_batching_through_stored_views_equals_folding_at_once(history, data):
    at_once = fold(history)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(history)), max_size=6)))
    views: dict = {}
    start = 0
    for cut in [*cuts, len(history)]:
        views = fold(history[start:cut], views)
        # What the projector does between batches: store each view as JSON, read it back.
        views = {f: view_decoder.decode(view_encoder.encode(v)) for f, v in views.items()}
        start = max(start, cut)
    assert views == at_once


@settings(max_examples=100, deadline=None)
@given(history=histories(), data=st.data())
def test_one_at_a_time_and_overlapping_replays_equal_folding_at_once(history, data):
    at_once = fold(history)
    one_by_one: dict = {}
    for seq, subject, event in history:
        fleet = subject.split(".")[2]
        one_by_one[fleet] = evolve(one_by_one.get(fleet) or empty(fleet), event, seq=seq, subject=subject)
    assert one_by_one == at_once
    # A restart replays from an earlier point than a view's checkpoint: nothing is folded twice.
    back = data.draw(st.integers(0, len(history)))
    assert fold(history[back:], at_once) == at_once
    # Legal histories leave nothing to count.
    assert all(v.anomalies == 0 for v in at_once.values())
    assert all(v.seq == max(s for s, subj, _ in history if subj.split(".")[2] == f) for f, v in at_once.items())
