"""The agent's backlog (agents/backlog.py): order kept, refs resolved, loops coalesced into legal runs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from haru.agents.backlog import Backlog
from haru.core import events as ev
from haru.core.residency import TRANSITIONS, event_key, state_name, to_state

T0 = datetime(2026, 1, 1, tzinfo=UTC)
S = "haru.evt.f.a.model.m1"


def lost(i: int) -> ev.Event:
    return ev.ModelLost(at=T0 + timedelta(seconds=i), domain="a", model="m1", reason="process_exited")


def loading(i: int) -> ev.Event:
    return ev.ModelLoading(at=T0 + timedelta(seconds=i), domain="a", model="m1", attempt=i)


def resident(i: int) -> ev.Event:
    return ev.ModelResident(at=T0 + timedelta(seconds=i), domain="a", model="m1")


def gpu(i: int) -> ev.Event:
    return ev.GpuObserved(at=T0 + timedelta(seconds=i), domain="a", index=0, present=True)


def test_entries_leave_in_order_and_refs_resolve_to_what_was_stored():
    b = Backlog(limit=100)
    r1 = b.add(S, lost(1), 5)
    r2 = b.add(S, loading(2), r1)
    assert r1 < 0 and r2 < 0 and b.resolve(r1) is None and b.resolve(7) == 7
    head = b.head()
    assert head is not None and head.ref == r1
    b.done(r1, 6)
    assert b.resolve(r1) == 6 and b.resolve(b.head().expect) == 6  # the next one continues from it


def test_a_crash_loop_coalesces_to_one_legal_loop_from_the_stored_state():
    b = Backlog(limit=7)
    refs, t = [], 0
    for _ in range(3):
        for make in (lost, loading, resident):
            t += 1
            refs.append(b.add(S, make(t), refs[-1] if refs else 5))
    assert b.coalesced == 3  # coalesced once, when full
    b.coalesce()
    tags = [ev.tag_of(p.event) for p in b.entries]
    assert tags == ["model_lost", "model_loading", "model_resident"] and b.coalesced == 6
    # legal from the stored state (resident), step by step, by the table
    state = "resident"
    for p in b.entries:
        state = TRANSITIONS[(state, event_key(p.event))]
        assert state == state_name(to_state(p.event))
    # the latest observation of each state is the one kept after the first (pinned) entry
    assert [p.event.at for p in b.entries][1:] == [T0 + timedelta(seconds=8), T0 + timedelta(seconds=9)]
    # a dropped loss resolves to the kept loss once that is stored
    b.done(b.head().ref, 11)
    assert b.resolve(refs[3]) == 11 and b.resolve(refs[6]) == 11


def test_gpu_snapshots_keep_only_the_latest_waiting_one():
    b = Backlog(limit=3)
    g = "haru.evt.f.a.gpu.0"
    b.add(S, lost(0), 1)  # the head (maybe being appended) is never dropped
    for i in range(1, 5):
        b.add(g, gpu(i), 0)
    assert [p.event.at for p in b.entries if p.subject == g] == [T0 + timedelta(seconds=4)]


def test_a_full_backlog_that_nothing_coalesces_says_so():
    b = Backlog(limit=3)
    for i in range(3):
        b.add(f"haru.evt.f.a.model.m{i}", lost(i), 0)
    assert b.full and len(b) == 3 and b.coalesced == 0


def test_an_append_that_went_out_unacknowledged_is_never_dropped():
    # two appends attempted at once while the link broke (a GPU snapshot, then a loss): both may be stored,
    # or sent from the client's reconnect buffer later; neither is coalesced away, head or not
    b = Backlog(limit=5)
    g = "haru.evt.f.a.gpu.0"
    b.add(g, gpu(0), 3, sent=True)
    first = b.add(S, lost(1), 5, sent=True)
    refs = [first]
    for i in range(2, 10):
        make = (loading, resident, lost)[(i - 2) % 3]
        refs.append(b.add(S, make(i), refs[-1]))
    model = [p for p in b.entries if p.subject == S]
    assert model[0].ref == first and b.coalesced > 0
    assert [ev.tag_of(p.event) for p in model] == ["model_lost", "model_loading", "model_resident"]
    assert b.resolve(model[1].expect) is None  # it continues from the kept loss once that is stored
    b.done(b.head().ref, 4)
    b.done(first, 6)
    assert b.resolve(model[1].expect) == 6 and b.resolve(refs[3]) == 6  # a dropped loss resolves to the sent one


def test_a_full_backlog_takes_an_event_that_closes_a_loop():
    b = Backlog(limit=6)
    g = "haru.evt.f.a.gpu.0"
    b.add(S, lost(1), 5, sent=True)
    b.add(g, gpu(1), 3, sent=True)
    refs = [b.add(S, loading(2), -1), b.add(S, resident(3), -1), b.add(S, lost(4), -1), b.add(g, gpu(5), -2)]
    assert b.full and b.coalesced == 0  # nothing coalesces yet: the sent ones stay
    assert (
        b.absorbs(S, loading(6))
        and b.absorbs(g, gpu(7))
        and not b.absorbs(S, ev.ModelSleeping(at=T0, domain="a", model="m1"))
    )
    b.add(S, loading(6), refs[-2])
    assert len(b) < 6 and [ev.tag_of(p.event) for p in b.entries if p.subject == S] == ["model_lost", "model_loading"]
