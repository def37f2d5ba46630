"""The rolling change and the operator's abort, in the decider: given events, when decide/judge, then appends."""

from __future__ import annotations

from haru.core.events import (
    OPERATION_REQUESTS,
    EligibilityChanged,
    OperationAborted,
    OperationCompleted,
    PromotionRequested,
    RollingRequested,
    RouteMoved,
    StepCompleted,
    StepFailed,
    StepStarted,
)
from haru.core.requests import judge_abort, judge_request
from haru.core.saga import ABORT, KINDS, STEPS, TRANSITIONS, flow
from haru.promoter.drive import command_for
from tests.support.decider import OP, ROUTE, F, at, declarations, facts, given, healthy_fleet, only

ROLL_FLOW = [
    "stop_training",
    "apply_standby",
    "verify_gpu",
    "wake",
    "probe",
    "canary",
    "flip",
    "apply_old_active",
    "settle_old_active",
]


def rolling(op_id="op-r", decl_seq=7, ms=1):
    return (
        OP,
        RollingRequested(
            at=at(ms),
            op_id=op_id,
            target="b",
            source="a",
            reason="layout_changed",
            detail="changed on the active domain: a/m2",
            decl_seq=decl_seq,
        ),
    )


def done(step: str, op_id="op-r", ms=2):
    return [
        (OP, StepStarted(at=at(ms), op_id=op_id, step=step)),
        (OP, StepCompleted(at=at(ms), op_id=op_id, step=step)),
    ]


def test_every_kind_has_a_request_event_and_both_outcomes_of_every_step():
    assert (
        set(KINDS)
        == set(OPERATION_REQUESTS)
        == {"promotion", "demotion", "rolling", "weighting", "provision", "teardown", "replace"}
    )
    for kind, spec in KINDS.items():
        assert OPERATION_REQUESTS[kind] is spec.request
        for step in flow(kind):
            assert step in STEPS
            assert (kind, step, "completed") in TRANSITIONS and (kind, step, "failed") in TRANSITIONS


def test_a_rolling_change_applies_to_the_standby_first_and_to_the_old_active_after_the_flip():
    assert flow("rolling") == ROLL_FLOW
    for step in ROLL_FLOW[: ROLL_FLOW.index("flip") + 1]:
        assert TRANSITIONS[("rolling", step, "failed")] == ABORT
    view = given(*healthy_fleet(), rolling())
    first = only(view)
    assert isinstance(first, StepStarted) and first.step == "stop_training"  # no training beside a reload
    view = given(*healthy_fleet(), rolling(), *done("stop_training"))
    second = only(view)
    assert isinstance(second, StepStarted) and second.step == "apply_standby"
    domain, commands = command_for(view, view.operation, "apply_standby")
    assert domain == "b" and [(verb, cmd.decl_seq) for verb, cmd, _ in commands] == [("apply_layout", 7)]
    before_apply_old = [e for s in ROLL_FLOW[: ROLL_FLOW.index("flip") + 1] for e in done(s)]
    view = given(
        *healthy_fleet(), rolling(), *before_apply_old, (ROUTE, RouteMoved(at=at(3), active="b", op_id="op-r"))
    )
    nxt = only(view)
    assert isinstance(nxt, StepStarted) and nxt.step == "apply_old_active"
    domain, commands = command_for(view, view.operation, "apply_old_active")
    assert domain == "a" and commands[0][0] == "apply_layout"


def test_a_failed_apply_on_the_standby_aborts_before_anything_moves():
    view = given(
        *healthy_fleet(),
        rolling(),
        (OP, StepStarted(at=at(2), op_id="op-r", step="apply_standby")),
        (
            OP,
            StepFailed(
                at=at(3),
                op_id="op-r",
                step="apply_standby",
                error_code="model_not_ready",
                error="apply_layout: m2 failed",
            ),
        ),
    )
    out = only(view)
    assert isinstance(out, OperationAborted) and out.step == "apply_standby" and "m2 failed" in out.error


def test_an_old_active_that_could_not_apply_is_settled_then_recorded_not_eligible():
    steps = [e for s in ROLL_FLOW[: ROLL_FLOW.index("flip") + 1] for e in done(s)]
    failed = [
        (OP, StepStarted(at=at(4), op_id="op-r", step="apply_old_active")),
        (
            OP,
            StepFailed(
                at=at(4),
                op_id="op-r",
                step="apply_old_active",
                error_code="model_not_ready",
                error="apply_layout: m2 failed",
            ),
        ),
    ]
    view = given(*healthy_fleet(), rolling(), *steps, (ROUTE, RouteMoved(at=at(3), active="b", op_id="op-r")), *failed)
    nxt = only(view)
    assert isinstance(nxt, StepStarted) and nxt.step == "settle_old_active"
    view = given(
        *healthy_fleet(),
        rolling(),
        *steps,
        (ROUTE, RouteMoved(at=at(3), active="b", op_id="op-r")),
        *failed,
        *done("settle_old_active", ms=5),
    )
    out = only(view)
    assert isinstance(out, EligibilityChanged) and out.domain == "a" and not out.eligible
    assert "could not apply the layout change" in out.why


def test_one_operation_in_flight_per_fleet():
    view = given(*healthy_fleet(), rolling())
    promote = judge_request(view, "promotion", "b", op_id="op-x", by="cli:x", now=at(5))
    assert promote.status == "conflict" and promote.op_id == "op-r" and "haru op abort" in promote.message
    again = judge_request(view, "rolling", "b", op_id="op-x", by="cli:x", now=at(5))
    assert again.status == "joined" and again.op_id == "op-r"


def test_a_rolling_change_is_requested_through_the_standby_only():
    view = given(*healthy_fleet())
    assert judge_request(view, "rolling", "a", op_id="op-x", by="cli:x", now=at(5)).status == "refused"
    ok = judge_request(view, "rolling", "b", op_id="op-x", by="cli:x", now=at(5))
    assert ok.status == "accepted" and isinstance(ok.event, RollingRequested)
    assert ok.event.source == "a" and ok.event.decl_seq == view.decl_seq > 0
    assert judge_request(given(), "rolling", "b", op_id="op-x", by="cli:x", now=at(5)).status == "refused"  # no route


def test_abort_before_the_flip_is_an_operation_aborted_naming_who_and_the_step():
    view = given(
        *healthy_fleet(),
        rolling(),
        *done("stop_training"),
        (OP, StepStarted(at=at(3), op_id="op-r", step="apply_standby")),
    )
    verdict = judge_abort(view, "", by="cli:alice", now=at(4), why="wrong context length")
    assert verdict.status == "accepted" and isinstance(verdict.event, OperationAborted)
    assert verdict.event.op_id == "op-r" and verdict.event.step == "apply_standby"
    assert verdict.event.error == "aborted by cli:alice: wrong context length"
    folded = given(*healthy_fleet(), rolling(), *done("stop_training"), (OP, verdict.event))
    assert folded.operation is None and folded.last_operation.state == "aborted"
    assert judge_abort(folded, "op-r", by="cli:alice", now=at(5)).status == "noop"


async def test_an_abort_of_an_operation_that_ended_before_the_last_one_says_how_it_ended():
    from haru.core.events import DemotionRequested
    from haru.log.memory import MemoryLog
    from haru.log.requests import abort_operation

    log = MemoryLog()
    aborted = OperationAborted(at=at(3), op_id="op-r", step="apply_standby", error="aborted by cli:alice")
    # the abort left b awake and without its training: the promoter demotes it again at once, so op-r is no longer the
    # last operation to end
    demoted = DemotionRequested(at=at(4), op_id="op-d", target="b", reason="standby_awake")
    ended = OperationCompleted(at=at(5), op_id="op-d")
    history = [*declarations(), *healthy_fleet(), rolling(), *done("stop_training"), (OP, aborted), (OP, demoted)]
    for subject, event in [*history, *done("sleep", op_id="op-d"), *done("start_training", op_id="op-d"), (OP, ended)]:
        await log.append(subject, event, expect=await log.last_seq_of(subject))
    again = await abort_operation(log, F, "op-r", by="cli:alice", now=at(5))
    assert (again.status, again.message) == ("noop", "op-r already aborted")
    never = await abort_operation(log, F, "op-x", by="cli:alice", now=at(5))
    assert never.status == "not_found" and "not in flight" in never.message


def test_abort_is_refused_once_the_flip_has_started():
    steps = [e for s in ROLL_FLOW[:5] for e in done(s)]
    view = given(*healthy_fleet(), rolling(), *steps, (OP, StepStarted(at=at(3), op_id="op-r", step="flip")))
    verdict = judge_abort(view, "op-r", by="cli:alice", now=at(4))
    assert verdict.status == "refused" and verdict.event is None and "flip" in verdict.message
    promotion = given(
        *healthy_fleet(),
        (OP, PromotionRequested(at=at(1), op_id="op-p", target="b", source="a")),
        *done("stop_training", op_id="op-p"),
        *done("verify_gpu", op_id="op-p"),
        *done("wake", op_id="op-p"),
        *done("probe", op_id="op-p"),
        *done("flip", op_id="op-p"),
    )
    assert judge_abort(promotion, "", by="cli:alice", now=at(4)).status == "refused"
    assert judge_abort(given(*healthy_fleet()), "", by="cli:alice", now=at(4)).status == "not_found"


def test_a_demotion_is_abortable_until_it_ends():
    from haru.core.events import DemotionRequested

    view = given(
        *healthy_fleet(),
        (OP, DemotionRequested(at=at(1), op_id="op-d", target="b")),
        *done("sleep", op_id="op-d"),
        (OP, StepStarted(at=at(3), op_id="op-d", step="start_training")),
    )
    assert judge_abort(view, "op-d", by="cli:alice", now=at(4)).status == "accepted"


def test_a_completed_rolling_change_ends_with_operation_completed():
    steps = [e for s in ROLL_FLOW for e in done(s)]
    view = given(*healthy_fleet(), rolling(), *steps, (ROUTE, RouteMoved(at=at(3), active="b", op_id="op-r")))
    assert isinstance(only(view, facts(ms=20)), OperationCompleted)


def test_a_failed_active_abandons_a_rolling_change_before_its_flip_so_failover_can_go_on():
    from tests.support.decider import unreachable

    running = [*done("stop_training"), (OP, StepStarted(at=at(3), op_id="op-r", step="apply_standby"))]
    view = given(*healthy_fleet(), rolling(), *running, unreachable("a", ms=4))
    out = only(view, facts(ms=5, silent_ms={"a": 5000, "b": 100}))
    assert isinstance(out, OperationAborted) and out.step == "apply_standby" and "failover" in out.error
    after = given(*healthy_fleet(), rolling(), *running, unreachable("a", ms=4), (OP, out))
    nxt = only(after, facts(ms=6, silent_ms={"a": 5000, "b": 100}))
    assert isinstance(nxt, PromotionRequested) and nxt.target == "b" and nxt.reason == "domain_unreachable"
    # past the flip it goes on: the route already moved to b
    flipped = [e for s in ROLL_FLOW[: ROLL_FLOW.index("flip") + 1] for e in done(s)]
    view = given(
        *healthy_fleet(),
        rolling(),
        *flipped,
        (ROUTE, RouteMoved(at=at(3), active="b", op_id="op-r")),
        unreachable("a", ms=4),
    )
    nxt = only(view, facts(ms=5, silent_ms={"a": 5000, "b": 100}))
    assert isinstance(nxt, StepStarted) and nxt.step == "apply_old_active"
