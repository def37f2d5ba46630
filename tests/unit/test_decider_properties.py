"""Properties of the saga under any outcome of any step, runner crashes included (hypothesis).

A small pure simulation drives `decide` the way the service does: appends are folded with the real
fleet fold; a started step's runner then completes it, fails it, or dies (before or, for the flip,
after `route_moved`), as hypothesis chooses; the clock jumps past a dead runner's lease.

Invariants: the operation always ends; the pointer moves at most once, only to the target, and
only after this operation's probe completed; an aborted promotion leaves the pointer where it was.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from haru.core.events import (
    PromotionRequested,
    RouteMoved,
    StepCompleted,
    StepFailed,
    StepStarted,
)
from haru.core.fold import evolve
from haru.core.saga import lease_ms
from haru.promoter.decider import decide
from haru.promoter.decisions import Facts
from tests.support.decider import OP, POLICY, ROUTE, at, healthy_fleet
from tests.support.decider import given as given_view

OUTCOMES = st.sampled_from(["complete", "complete", "complete", "fail", "crash", "crash_after_flip"])


@settings(max_examples=200, deadline=None)
@given(outcomes=st.lists(OUTCOMES, min_size=1, max_size=40))
def test_any_outcomes_and_crashes_keep_the_pointer_probed_and_end_the_operation(outcomes):
    view = given_view(*healthy_fleet())
    start_active, start_revision = view.active, view.route_revision
    seq = view.seq
    view = evolve(
        view,
        PromotionRequested(at=at(1), op_id="op-1", target="b", source="a", route_revision=start_revision),
        seq=seq + 1,
        subject=OP,
    )
    seq += 1
    now_ms = 10
    moves: list[tuple[str, bool]] = []
    pending = list(outcomes)
    ended = None

    def fold(event, subject):
        nonlocal view, seq
        seq += 1
        view = evolve(view, event, seq=seq, subject=subject)

    for _ in range(200):
        facts = Facts(
            now=at(now_ms),
            me="promoter:me",
            new_op_id="op-x",
            silent_ms={"a": 10, "b": 10},
            listening_ms=60_000,
            step_by="promoter:other",
        )
        appends = [a for a in decide(view, facts) if a.subject in (OP, ROUTE)]
        if view.operation is None:
            ended = view.last_operation
            break
        assert len(appends) <= 1
        if not appends:
            now_ms += lease_ms("settle_old_active", POLICY) + 1  # a dead runner's lease runs out
            continue
        event = appends[0].event
        fold(event, appends[0].subject)
        now_ms += 1
        if not isinstance(event, StepStarted):
            continue
        outcome = pending.pop(0) if pending else "complete"
        step = event.step
        if outcome == "crash":
            continue
        if step == "flip" and outcome in ("complete", "crash_after_flip"):
            op = view.operation
            probed = any(s.step == "probe" and s.state == "completed" for s in op.steps)
            moves.append((op.target, probed))
            fold(RouteMoved(at=at(now_ms), active=op.target, previous=view.active, op_id=op.op_id), ROUTE)
            if outcome == "crash_after_flip":
                continue
        elif outcome == "crash_after_flip":
            continue
        if outcome == "fail":
            fold(StepFailed(at=at(now_ms), op_id="op-1", step=step, error_code="x", error="injected"), OP)
        else:
            fold(StepCompleted(at=at(now_ms), op_id="op-1", step=step), OP)
    assert ended is not None, "the operation never ended"
    assert len(moves) <= 1
    for target, probed in moves:
        assert target == "b" and probed
    if ended.state == "aborted":
        assert view.active == start_active and view.route_revision == start_revision and not moves
    else:
        assert view.active == "b" and len(moves) == 1
