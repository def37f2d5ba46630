"""The promoter decides on its own acknowledged appends before its follower delivers them (FleetState.acked).

Given a folded view, when the promoter's append is acknowledged, then the view it decides on has the
append, the subject's tip (the next append's expected sequence) is the acknowledged sequence, a record
the follower delivers meanwhile (ours or one before it) neither drops the append nor moves the tip back,
and once the follower has folded it the view is the fold's alone, equal to the same events folded in order.
"""

from __future__ import annotations

from haru.core.events import StepCompleted, StepStarted
from haru.core.fold import Folder
from haru.promoter.fleets import FleetState
from tests.support.decider import OP, at, facts, given, healthy_fleet, op_appends, requested, through, unreachable

RUNNING = facts(silent_ms={"a": None, "b": 100}, running=frozenset({("op-1", "probe", 1)}))


def probed_fleet() -> tuple[FleetState, int]:
    """a failed over to b: the promotion's probe started; returns the state and the last sequence folded."""
    events = [*healthy_fleet(), unreachable("a"), requested(), *through("probe")]
    events.append((OP, StepStarted(at=at(4), op_id="op-1", step="probe")))
    view = given(*events)
    st = FleetState(folder=Folder(view))
    st.last[OP] = view.seq
    return st, view.seq


def test_an_acknowledged_step_outcome_is_decided_on_before_the_follower_delivers_it():
    st, seq = probed_fleet()
    assert op_appends(st.view, RUNNING) == []  # the probe runs: nothing to decide
    done = StepCompleted(at=at(5), op_id="op-1", step="probe", by="promoter:test", cause=seq)
    st.acked(seq + 3, OP, done)  # two records of other subjects before it, not delivered yet

    assert st.last[OP] == seq + 3
    op = st.view.operation
    assert op is not None and op.steps[-1].step == "probe" and op.steps[-1].state == "completed"
    nxt = [a.event for a in op_appends(st.view, RUNNING)]
    assert len(nxt) == 1 and isinstance(nxt[0], StepStarted) and nxt[0].step == "flip"


def test_the_follower_catching_up_keeps_the_acknowledged_tip_and_then_takes_over():
    st, seq = probed_fleet()
    done = StepCompleted(at=at(5), op_id="op-1", step="probe", by="promoter:test", cause=seq)
    st.acked(seq + 2, OP, done)

    # The follower delivers a record before ours on another subject: ours stays on the view, the tip stays ours.
    other, heard = unreachable("b", 4)
    st.folder.add(heard, seq=seq + 1, subject=other)
    st.folded(other, seq + 1)
    assert st.last[OP] == seq + 2
    assert st.view.operation is not None and st.view.operation.steps[-1].state == "completed"
    assert st.view.domains["b"].reachable is False

    # Then ours: the overlay is dropped and the view is the fold's, equal to folding everything in order.
    st.folder.add(done, seq=seq + 2, subject=OP)
    st.folded(OP, seq + 2)
    assert st.view is st.folder.view()
    assert st.ahead == []
    assert st.last[OP] == seq + 2


def test_a_record_of_ours_folded_late_never_moves_the_tip_back():
    st, seq = probed_fleet()
    first = StepCompleted(at=at(5), op_id="op-1", step="probe", by="promoter:test", cause=seq)
    second = StepStarted(at=at(6), op_id="op-1", step="flip", by="promoter:test", cause=seq + 1)
    st.acked(seq + 1, OP, first)
    st.acked(seq + 2, OP, second)  # appended expecting seq + 1, which the follower has not delivered yet

    st.folder.add(first, seq=seq + 1, subject=OP)
    st.folded(OP, seq + 1)
    assert st.last[OP] == seq + 2  # the next append expects our second, not the first the follower just gave
    op = st.view.operation
    assert op is not None and op.steps[-1].step == "flip" and op.steps[-1].state == "started"
