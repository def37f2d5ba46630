"""Holding the stream against what the views and route intents say they folded (haru.log.history)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from haru.core.errors import seq_ranges
from haru.core.views import FleetView, RouteIntent
from haru.log.history import Witness, check_witnesses, intent_witnesses, view_witnesses

T = datetime(2026, 11, 30, 22, 0, tzinfo=UTC)


def test_seq_ranges_reads_like_a_person_would_write_it():
    assert seq_ranges([9, 3, 4, 5, 11, 12]) == "3-5, 9, 11-12"
    assert seq_ranges([7]) == "7"
    assert seq_ranges(list(range(1, 100, 2)), limit=3) == "1, 3, 5 … (47 more ranges)"


def test_a_view_past_the_end_of_the_stream_says_which_events_are_missing():
    view = FleetView(fleet="default", seq=38, updated_at=T, decl_seq=5, op_seq=30, route_seq=12, route_revision=12)
    findings = check_witnesses(33, view_witnesses("fleet.default", view), {})
    assert [f.kind for f in findings] == ["truncated"]
    assert str(findings[0]) == (
        "the store ends at 33 but the views have folded up to 38 (view fleet.default (last folded)): "
        "events 34..38 are missing; the newest events were cut from the store"
    )


def test_a_cut_store_written_on_is_caught_by_the_event_at_the_witnessed_sequence():
    view = FleetView(fleet="default", seq=38, updated_at=T, route_seq=12, route_revision=12)
    stored = {38: ("haru.evt.default.b.gpu.0", T + timedelta(minutes=5)), 12: ("haru.evt.default.route", None)}
    findings = check_witnesses(40, view_witnesses("fleet.default", view), stored)
    assert [(f.kind, f.seq) for f in findings] == [("replaced", 38)]
    # The route intent names a route_moved at 12; another subject there is a replacement too.
    ri = RouteIntent(fleet="default", revision=12, view_seq=38)
    findings = check_witnesses(40, intent_witnesses(ri), {12: ("haru.evt.default.a.agent", T), 38: stored[38]})
    assert [(f.kind, f.seq) for f in findings] == [("replaced", 12)]


def test_an_intact_store_has_no_findings():
    view = FleetView(fleet="default", seq=38, updated_at=T, decl_seq=5, route_seq=12, route_revision=12, checkpoint=40)
    stored = {38: ("haru.evt.default.a.model.m", T), 5: ("haru.evt.default.decl", T), 12: ("haru.evt.default.route", T)}
    assert check_witnesses(40, view_witnesses("fleet.default", view), stored) == []
    # a witness the store cannot serve is the replay's to report (LogDamaged), not a truncation
    assert check_witnesses(40, [Witness("x", 38, "haru.evt.default.", T)], {}) == []
