"""The chain (haru.promoter.chain): what the promoter decides at once after an append, on the view with it
applied, goes into the same atomic batch; a cause inside the batch is written relative; a flip's route
move joins its start only when the flip may be made; a verify_gpu answered with stop_training's reply is
recorded from it."""

from __future__ import annotations

import msgspec
import pytest

from haru.core.commands import ErrorInfo, Reply
from haru.core.events import (
    OperationAborted,
    PromotionRequested,
    RouteMoved,
    StepCompleted,
    StepFailed,
    StepStarted,
)
from haru.core.record import with_absolute_cause
from haru.promoter.chain import TENTATIVE, Chain, extend
from haru.promoter.decider import decide
from tests.support.decider import OP, ROUTE, at, facts, given, healthy_fleet, requested, through, unreachable

pytestmark = pytest.mark.timeout(10)


def chained(view, first, *, last, verdict: Reply | None = None, own_probes=frozenset()) -> Chain:
    """What the service's `_chained` does: the first appends, then the decider's next decisions."""
    chain = Chain(view, last, me="promoter:test")
    for subject, event, expect in first:
        chain.add(subject, event, "test", expect=expect)
    return extend(chain, facts(ms=20), own_probes=own_probes, verdict=verdict, new_op_id=lambda: "op-next")


def resolved(chain: Chain, first_seq: int) -> list:
    """The chain's events as the log gives them back, stored from `first_seq` on."""
    return [with_absolute_cause(link.event, first_seq + i) for i, link in enumerate(chain.links)]


def test_a_steps_outcome_takes_the_next_steps_start_with_it_citing_it_by_position():
    view = given(
        *healthy_fleet(),
        requested(),
        *through("verify_gpu"),
        (OP, StepStarted(at=at(4), op_id="op-1", step="verify_gpu")),
    )
    started_seq = view.seq
    done = StepCompleted(at=at(5), op_id="op-1", step="verify_gpu", cause=started_seq)
    chain = chained(view, [(OP, done, started_seq)], last={OP: started_seq})
    events = [link.event for link in chain.links]
    assert [type(e).__name__ for e in events] == ["StepCompleted", "StepStarted"]
    assert events[1].step == "wake" and events[1].cause == -1  # the outcome just before it, by position
    assert chain.expect == {OP: started_seq}  # one check, on the subject as it was before the batch
    assert chain.to_run() == [1]  # the wake runs once the batch is stored
    stored = resolved(chain, first_seq=started_seq + 1)
    assert stored[1].cause == started_seq + 1


def test_a_verdict_answered_with_stop_training_records_verify_gpu_in_the_same_batch():
    view = given(*healthy_fleet(), requested(), (OP, StepStarted(at=at(2), op_id="op-1", step="stop_training")))
    started_seq = view.seq
    done = StepCompleted(at=at(3), op_id="op-1", step="stop_training", cause=started_seq)
    ok = Reply(ok=True, detail="VRAM verified: enough free to wake, no trainer on the GPUs", took_ms=7)
    chain = chained(view, [(OP, done, started_seq)], last={OP: started_seq}, verdict=ok)
    events = [link.event for link in chain.links]
    assert [(type(e).__name__, e.step) for e in events] == [
        ("StepCompleted", "stop_training"),
        ("StepStarted", "verify_gpu"),
        ("StepCompleted", "verify_gpu"),
        ("StepStarted", "wake"),
    ]
    assert events[2].cause == -1 and events[2].took_ms == 7 and "read as training stopped" in events[2].detail
    assert chain.to_run() == [3]  # verify_gpu is done: only the wake runs

    bad = Reply(ok=False, error=ErrorInfo(code="gpu_busy", message="a trainer still holds 6 GiB"))
    chain = chained(view, [(OP, done, started_seq)], last={OP: started_seq}, verdict=bad)
    events = [link.event for link in chain.links]
    assert isinstance(events[2], StepFailed) and events[2].error_code == "gpu_busy"
    assert isinstance(events[3], OperationAborted)  # decided on at once, as after its acknowledgement
    assert chain.to_run() == []


def test_the_flips_route_move_joins_its_start_only_after_this_promoters_probe():
    rev = given(*healthy_fleet()).route_revision
    view = given(
        *healthy_fleet(),
        requested(revision=rev),
        *through("probe"),
        (OP, StepStarted(at=at(4), op_id="op-1", step="probe")),
    )
    started_seq = view.seq
    probed = StepCompleted(at=at(5), op_id="op-1", step="probe", cause=started_seq)
    last = {OP: started_seq, ROUTE: rev}
    chain = chained(view, [(OP, probed, started_seq)], last=last)
    events = [link.event for link in chain.links]
    assert [type(e).__name__ for e in events] == ["StepCompleted", "StepStarted", "RouteMoved"]
    moved = events[2]
    assert isinstance(moved, RouteMoved) and moved.active == "b" and moved.cause == -2  # the probe it relied on
    assert chain.expect[ROUTE] == rev and chain.closed  # nothing after: the flip's outcome names the revision
    assert chain.to_run() == [1]  # the flip runner completes the step from the stored move

    # A probe completion already stored is this promoter's only if it appended it (own_probes).
    view2 = given(*healthy_fleet(), requested(revision=rev), *through("flip"))
    chain = Chain(view2, {OP: view2.seq, ROUTE: rev}, me="promoter:test")
    chain.add(OP, StepStarted(at=at(6), op_id="op-1", step="flip"), "test")
    op = chain.last_started()[0]
    assert not chain.move_route(op, at(6), own_probes=set())
    probe_seq = next(s.seq for s in op.steps if s.step == "probe" and s.state == "completed")
    assert chain.move_route(op, at(6), own_probes={probe_seq})


def test_a_liveness_verdict_is_stored_before_anything_is_decided_on_it():
    view = given(*healthy_fleet())
    f = facts(ms=5000, silent_ms={"a": 5000, "b": 100})
    first = decide(view, f)
    assert [type(a.event).__name__ for a in first] == ["DomainUnreachable"]
    chain = Chain(view, {}, me="promoter:test")
    chain.add(first[0].subject, first[0].event, first[0].why)
    extend(chain, f, own_probes=set(), verdict=None, new_op_id=lambda: "op-9")
    assert [type(link.event).__name__ for link in chain.links] == ["DomainUnreachable"]  # the promotion waits
    # a round later, on the view with the verdict stored, the promotion and its first step go together
    stored = given(*healthy_fleet(), unreachable("a"))
    chain = Chain(stored, {}, me="promoter:test")
    more = decide(stored, msgspec.structs.replace(f, new_op_id="op-9"))
    for a in more:
        chain.add(a.subject, a.event, a.why)
    extend(chain, f, own_probes=set(), verdict=None, new_op_id=lambda: "op-10")
    events = [link.event for link in chain.links]
    assert [type(e).__name__ for e in events] == ["PromotionRequested", "StepStarted"]
    assert isinstance(events[0], PromotionRequested) and events[1].cause == -1  # the request


def test_tentative_sequences_are_never_written():
    view = given(
        *healthy_fleet(),
        unreachable("a"),
        requested(),
        *through("wake"),
        (OP, StepStarted(at=at(4), op_id="op-1", step="wake")),
    )
    done = StepCompleted(at=at(5), op_id="op-1", step="wake", cause=view.seq)
    chain = chained(view, [(OP, done, view.seq)], last={OP: view.seq})
    for link in chain.links:
        assert abs(link.event.cause) < TENTATIVE
        assert str(TENTATIVE) not in msgspec.json.encode(link.event).decode()
