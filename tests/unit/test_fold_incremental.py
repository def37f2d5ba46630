"""Property: the incremental `Folder` (what every service folds with, and `fold` too) equals its
specification, `evolve` (and `invalid` for a bad body) applied event by event, however often its view is materialized,
and through the JSON round trip of stored views.

Histories are the legal ones of test_fold_properties with odd events spliced in: illegal residency
transitions, events about undeclared or retired models and domains, bodies that did not decode,
events of a fleet that was never declared, events on subjects they may not stand on (a route move on
an agent subject, a residency event naming another domain or model than its subject): everything
that moves `anomalies` and `last_anomaly`.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.fold import Folder, add_one, empty, evolve, fleet_of, fold, invalid
from haru.core.specs import ModelSpec
from haru.core.views import FleetView, view_decoder, view_encoder
from tests.support.fold_histories import DOMAINS, MODELS, RESIDENCY_EVENTS, histories

T1 = datetime(2026, 11, 30, tzinfo=UTC)
ERROR = "not a valid Haru event: Expected `object`"


@st.composite
def odd_histories(draw) -> list[tuple[int, str, ev.Event | None]]:
    items: list[tuple[str, ev.Event | None]] = [(s, e) for _, s, e in draw(histories())]
    fleets = sorted({s.split(".")[2] for s, _ in items}) + ["stray"]
    for _ in range(draw(st.integers(0, 12))):
        pos = draw(st.integers(0, len(items)))
        fleet = draw(st.sampled_from(fleets))
        d = draw(st.sampled_from([*DOMAINS, "zz"]))
        m = draw(st.sampled_from([*MODELS, "ghost"]))
        at = T1 + timedelta(seconds=draw(st.integers(0, 10**6)))
        kind = draw(
            st.sampled_from(
                [
                    "residency",
                    "residency",
                    "residency",
                    "invalid",
                    "retire_model",
                    "retire_domain",
                    "admission",
                    "redeclare",
                    "misplaced_route",
                    "misplaced_residency",
                ]
            )
        )
        if kind == "misplaced_route":  # a route move anywhere but the route subject
            other = draw(st.sampled_from([sj.agent(fleet, d), sj.model(fleet, d, m), sj.op(fleet), sj.decl(fleet)]))
            item = (other, ev.RouteMoved(at=at, active=d, by="agent:forger"))
        elif kind == "misplaced_residency":  # a residency event whose body names another domain or model
            tag = draw(st.sampled_from(sorted(RESIDENCY_EVENTS)))
            body_d, body_m = draw(st.sampled_from([(d + "x", m), (d, m + "x")]))
            item = (sj.model(fleet, d, m), RESIDENCY_EVENTS[tag](at, body_d, body_m, draw))
        elif kind == "residency":  # any residency event, legal in its place or not, declared or not
            tag = draw(st.sampled_from(sorted(RESIDENCY_EVENTS)))
            item = (sj.model(fleet, d, m), RESIDENCY_EVENTS[tag](at, d, m, draw))
        elif kind == "invalid":
            item = (sj.model(fleet, d, m), None)
        elif kind == "retire_model":
            item = (sj.decl(fleet), ev.ModelRetired(at=at, domain=d, model=m))
        elif kind == "retire_domain":
            item = (sj.decl(fleet), ev.DomainRetired(at=at, domain=d))
        elif kind == "admission":
            admitted = draw(st.booleans())
            item = (
                sj.decl(fleet),
                ev.AdmissionDecided(
                    at=at,
                    domain=d,
                    name=m,
                    gpu_index=0,
                    admitted=admitted,
                    vram_bytes=5,
                    short_by_bytes=0 if admitted else 7,
                ),
            )
        else:
            item = (
                sj.decl(fleet),
                ev.ModelChanged(at=at, domain=d, spec=ModelSpec(name=m, slot="x", gpu_index=0, vram_bytes=1, port=1)),
            )
        items.insert(pos, item)
    return [(i + 1, s, e) for i, (s, e) in enumerate(items)]


def views_of(folders: dict[str, Folder]) -> dict[str, FleetView]:
    return {f: folder.view() for f, folder in folders.items()}


def folded(history, error: str = ERROR) -> dict[str, FleetView]:
    """The specification: `evolve` (`invalid` for a bad body) event by event, per fleet, skipping what
    a fleet's view already folded. No Folder in it."""
    views: dict[str, FleetView] = {}
    for seq, subject, event in history:
        fleet = fleet_of(subject)
        if not fleet:
            continue
        view = views.get(fleet)
        if view is None:
            view = empty(fleet)
        elif seq <= view.seq:
            continue
        if event is None:
            views[fleet] = invalid(view, seq=seq, subject=subject, error=error)
        else:
            views[fleet] = evolve(view, event, seq=seq, subject=subject)
    return views


def round_trip(view: FleetView) -> FleetView:
    return view_decoder.decode(view_encoder.encode(view))


@settings(max_examples=200, deadline=None)
@given(history=odd_histories(), data=st.data())
def test_folders_materialized_anywhere_equal_folding_with_evolve(history, data):
    assert fold(history) == folded(history, error="")  # `fold` is the Folder's too (it has no error text)
    cuts = set(data.draw(st.lists(st.integers(0, len(history)), max_size=10)))
    stored_at = set(data.draw(st.lists(st.integers(0, len(history)), max_size=4)))
    folders: dict[str, Folder] = {}
    for i, (seq, subject, event) in enumerate(history):
        if i in cuts:  # materialize mid-stream: what a flush or a route move's intent does
            assert views_of(folders) == folded(history[:i])
        if i in stored_at:  # what a restart does: resume from each view's JSON
            folders = {f: Folder(round_trip(folder.view())) for f, folder in folders.items()}
        add_one(folders, event, seq=seq, subject=subject, error=ERROR if event is None else "")
    at_once = folded(history)
    assert views_of(folders) == at_once
    # Replaying from an earlier point (a restart behind the checkpoint) folds nothing twice.
    back = data.draw(st.integers(0, len(history)))
    for seq, subject, event in history[back:]:
        assert add_one(folders, event, seq=seq, subject=subject) is None
    assert views_of(folders) == at_once


@settings(max_examples=150, deadline=None)
@given(history=odd_histories(), data=st.data())
def test_folder_add_equals_evolve_event_by_event(history, data):
    fleet = data.draw(st.sampled_from(sorted({s.split(".")[2] for _, s, _ in history})))
    mine = [(seq, s, e) for seq, s, e in history if s.split(".")[2] == fleet and e is not None]
    start = round_trip(fold(mine[: data.draw(st.integers(0, len(mine)))]).get(fleet) or empty(fleet))
    rest = [(seq, s, e) for seq, s, e in mine if seq > start.seq]
    folder = Folder(start)
    expected = start
    for seq, subject, event in rest:
        folder.add(event, seq=seq, subject=subject)
        expected = evolve(expected, event, seq=seq, subject=subject)
        if data.draw(st.booleans()):
            assert folder.view() == expected
        assert folder.seq == seq
    assert folder.view() == expected


def test_reset_drops_what_is_staged_and_keeps_the_fleet():
    folder = Folder(empty("default"))
    folder.add(ev.ModelLoading(at=T1, domain="a", model="x"), seq=3, subject=sj.model("default", "a", "x"))
    assert folder.seq == 3 and folder.view().anomalies == 1  # not declared: counted
    checkpointed = FleetView(fleet="default", seq=2, checkpoint=9)
    folder.reset(checkpointed)
    assert folder.view() == checkpointed and folder.seq == 2
    try:
        folder.reset(empty("edge"))
    except ValueError:
        pass
    else:  # pragma: no cover
        raise AssertionError("a folder must not take another fleet's view")
