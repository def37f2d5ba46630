"""The promotion decider: given events (folded by the real fleet fold), when decide, then appends."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from haru.core import subjects
from haru.core.events import (
    AdmissionDecided,
    DemotionRequested,
    EligibilityChanged,
    FailoverDeclined,
    GpuObserved,
    ModelLoading,
    ModelLost,
    OperationAborted,
    OperationCompleted,
    PromotionRequested,
    StepCompleted,
    StepFailed,
    StepStarted,
)
from haru.core.fold import evolve
from haru.core.requests import judge_request
from haru.core.saga import ABORT, COMPLETE, LEASE_MARGIN_MS, STEPS, TRANSITIONS, flow, lease_ms
from haru.core.specs import Policy
from haru.promoter.decider import decide
from haru.promoter.decisions import Facts
from haru.promoter.failover import retry_ms
from haru.promoter.health import active_health
from tests.support.decider import (
    OP,
    POLICY,
    T0,
    F,
    at,
    facts,
    given,
    healthy_fleet,
    only,
    op_appends,
    reachable,
    requested,
    resident,
    routed,
    through,
    unreachable,
)

# --------------------------------------------------------------------------------------- tables


def test_the_promotion_is_the_six_steps_in_design_order():
    assert flow("promotion") == ["stop_training", "verify_gpu", "wake", "probe", "flip", "settle_old_active"]
    assert flow("demotion") == ["sleep", "start_training"]


def test_every_step_has_both_outcomes_in_the_table():
    for kind in ("promotion", "demotion"):
        for step in flow(kind):
            assert (kind, step, "completed") in TRANSITIONS
            assert (kind, step, "failed") in TRANSITIONS
            assert step in STEPS


def test_a_failure_before_the_flip_aborts_and_settle_is_best_effort():
    before_flip = flow("promotion")[: flow("promotion").index("flip") + 1]
    for step in before_flip:
        assert TRANSITIONS[("promotion", step, "failed")] == ABORT
    assert TRANSITIONS[("promotion", "settle_old_active", "failed")] == COMPLETE
    assert not STEPS["settle_old_active"].fatal


def test_lease_is_the_steps_policy_bound_plus_margin():
    assert lease_ms("wake", POLICY) == POLICY.wake_timeout_ms + LEASE_MARGIN_MS
    assert lease_ms("stop_training", POLICY) == POLICY.training_grace_ms + POLICY.command_timeout_ms + LEASE_MARGIN_MS


# --------------------------------------------------------------------------------- driving


def _route_revision(view):
    return view.route_revision


def test_a_requested_promotion_starts_with_stop_training():
    view = given(*healthy_fleet(), requested())
    event = only(view)
    assert isinstance(event, StepStarted) and (event.step, event.attempt, event.op_id) == ("stop_training", 1, "op-1")


@pytest.mark.parametrize("done", flow("promotion")[:-1])
def test_each_completed_step_starts_the_next(done):
    steps = flow("promotion")
    history = []
    for s in steps[: steps.index(done) + 1]:
        history += [
            (OP, StepStarted(at=at(2), op_id="op-1", step=s)),
            (OP, StepCompleted(at=at(3), op_id="op-1", step=s)),
        ]
    base = given(*healthy_fleet())
    view = given(*healthy_fleet(), requested(revision=base.route_revision), *history)
    event = only(view)
    assert isinstance(event, StepStarted)
    assert event.step == steps[steps.index(done) + 1]


@pytest.mark.parametrize("failed", ["stop_training", "verify_gpu", "wake", "probe"])
def test_a_failed_step_before_the_flip_aborts_with_the_step_and_error(failed):
    steps = flow("promotion")
    history = []
    for s in steps[: steps.index(failed)]:
        history += [
            (OP, StepStarted(at=at(2), op_id="op-1", step=s)),
            (OP, StepCompleted(at=at(3), op_id="op-1", step=s)),
        ]
    history += [
        (OP, StepStarted(at=at(4), op_id="op-1", step=failed)),
        (OP, StepFailed(at=at(5), op_id="op-1", step=failed, error_code="out_of_memory", error="wake: CUDA OOM")),
    ]
    view = given(*healthy_fleet(), requested(), *history)
    event = only(view)
    assert isinstance(event, OperationAborted)
    assert (event.step, event.error) == (failed, "wake: CUDA OOM")


def test_the_flip_is_refused_when_the_target_became_unreachable_after_its_probe():
    base = given(*healthy_fleet())
    view = given(*healthy_fleet(), requested(revision=base.route_revision), *through("flip"), unreachable("b", 4))
    event = only(view, facts(silent_ms={"a": 100, "b": 5000}))
    assert isinstance(event, OperationAborted) and event.step == "flip"
    assert "unreachable" in event.error


def test_a_flip_whose_runner_died_after_route_moved_is_completed_from_the_route():
    base = given(*healthy_fleet())
    view = given(
        *healthy_fleet(),
        requested(revision=base.route_revision),
        *through("flip"),
        (OP, StepStarted(at=at(5), op_id="op-1", step="flip")),
        routed("b", 6, op_id="op-1"),
    )
    event = only(view)
    assert isinstance(event, StepCompleted) and event.step == "flip"


def test_a_flip_whose_route_moved_elsewhere_fails():
    base = given(*healthy_fleet())
    view = given(
        *healthy_fleet(),
        requested(revision=base.route_revision),
        *through("flip"),
        (OP, StepStarted(at=at(5), op_id="op-1", step="flip")),
        routed("a", 6, op_id="op-other"),
    )
    event = only(view)
    assert isinstance(event, StepFailed) and event.error_code == "route_moved_elsewhere"


def _started_wake(by_ms=5):
    base = given(*healthy_fleet())
    return given(
        *healthy_fleet(),
        requested(revision=base.route_revision),
        *through("wake"),
        (OP, StepStarted(at=at(by_ms), op_id="op-1", step="wake")),
    )


def test_a_step_this_promoter_runs_is_left_alone():
    view = _started_wake()
    assert only(view, facts(running=frozenset({("op-1", "wake", 1)}), step_by="promoter:test")) is None


def test_a_step_another_promoter_runs_is_left_alone_within_its_lease():
    view = _started_wake()
    assert only(view, facts(ms=5 + lease_ms("wake", POLICY) - 1, step_by="promoter:other")) is None


def test_a_step_whose_lease_ran_out_is_restarted_with_the_next_attempt():
    view = _started_wake()
    event = only(view, facts(ms=5 + lease_ms("wake", POLICY), step_by="promoter:other"))
    assert isinstance(event, StepStarted) and (event.step, event.attempt) == ("wake", 2)


def test_my_own_step_from_before_a_restart_is_restarted_at_once():
    view = _started_wake()
    event = only(view, facts(ms=6, step_by="promoter:test"))
    assert isinstance(event, StepStarted) and (event.step, event.attempt) == ("wake", 2)


def test_after_settle_the_operation_completes():
    view = given(
        *healthy_fleet(),
        requested(),
        *through("settle_old_active"),
        (OP, StepStarted(at=at(6), op_id="op-1", step="settle_old_active")),
        (OP, StepCompleted(at=at(7), op_id="op-1", step="settle_old_active")),
    )
    assert isinstance(only(view), OperationCompleted)


def test_a_failed_settle_makes_the_old_active_ineligible_then_completes():
    view = given(
        *healthy_fleet(),
        requested(),
        *through("settle_old_active"),
        (OP, StepStarted(at=at(6), op_id="op-1", step="settle_old_active")),
        (
            OP,
            StepFailed(at=at(7), op_id="op-1", step="settle_old_active", error_code="agent_gone", error="sleep: gone"),
        ),
    )
    event = only(view)
    assert isinstance(event, EligibilityChanged) and (event.domain, event.eligible) == ("a", False)
    view = evolve(view, event, seq=view.seq + 1, subject=OP)
    assert isinstance(only(view), OperationCompleted)


def test_an_old_active_whose_gpu_is_gone_is_ineligible_even_when_settle_answered():
    gone = (subjects.gpu(F, "a", 0), GpuObserved(at=at(4), domain="a", index=0, present=False))
    view = given(
        *healthy_fleet(),
        requested(),
        gone,
        *through("settle_old_active"),
        (OP, StepStarted(at=at(6), op_id="op-1", step="settle_old_active")),
        (OP, StepCompleted(at=at(7), op_id="op-1", step="settle_old_active")),
    )
    event = only(view)
    assert isinstance(event, EligibilityChanged) and not event.eligible and "GPU 0" in event.why


def test_a_demotion_sleeps_then_starts_training_then_restores_eligibility():
    ineligible = (OP, EligibilityChanged(at=at(1), domain="b", eligible=False, why="GPU 0 of b detached"))
    dem = (OP, DemotionRequested(at=at(2), op_id="op-d", target="b", reason="recovered"))
    view = given(*healthy_fleet(), ineligible, dem)
    assert only(view).step == "sleep"
    view = given(
        *healthy_fleet(),
        ineligible,
        dem,
        (OP, StepStarted(at=at(3), op_id="op-d", step="sleep")),
        (OP, StepCompleted(at=at(4), op_id="op-d", step="sleep")),
    )
    assert only(view).step == "start_training"
    view = given(
        *healthy_fleet(),
        ineligible,
        dem,
        (OP, StepStarted(at=at(3), op_id="op-d", step="sleep")),
        (OP, StepCompleted(at=at(4), op_id="op-d", step="sleep")),
        (OP, StepStarted(at=at(5), op_id="op-d", step="start_training")),
        (OP, StepCompleted(at=at(6), op_id="op-d", step="start_training")),
    )
    event = only(view)
    assert isinstance(event, EligibilityChanged) and event.eligible and event.domain == "b"


# ------------------------------------------------------------------------------ auto-failover


def test_an_unreachable_active_is_failed_over_at_once():
    view = given(*healthy_fleet(), unreachable("a", 5))
    event = only(view, facts(silent_ms={"a": 3000, "b": 100}))
    assert isinstance(event, PromotionRequested)
    assert (event.target, event.source, event.reason, event.op_id) == ("b", "a", "domain_unreachable", "op-new")
    assert event.route_revision == view.route_revision


def test_a_served_model_lost_to_gpu_detached_fails_the_active_at_once():
    lost = (subjects.model(F, "a", "m1"), ModelLost(at=at(5), domain="a", model="m1", reason="gpu_detached"))
    event = only(given(*healthy_fleet(), lost), facts(ms=6))
    assert isinstance(event, PromotionRequested) and event.reason == "gpu_detached"


def test_other_losses_degrade_and_fail_after_the_grace():
    lost = (subjects.model(F, "a", "m1"), ModelLost(at=at(5), domain="a", model="m1", reason="process_exited"))
    view = given(*healthy_fleet(), lost)
    assert active_health(view, at(6)).health == "degraded"
    assert only(view, facts(ms=6)) is None
    late = 5 + POLICY.degraded_grace_ms
    assert active_health(view, at(late)).health == "failed"
    event = only(view, facts(ms=late))
    assert isinstance(event, PromotionRequested) and event.reason == "degraded"


def test_a_model_back_resident_clears_the_degradation():
    lost = (subjects.model(F, "a", "m1"), ModelLost(at=at(5), domain="a", model="m1", reason="evicted"))
    loading = (subjects.model(F, "a", "m1"), ModelLoading(at=at(6), domain="a", model="m1"))
    view = given(*healthy_fleet(), lost, loading, resident("a", "m1", 7))
    assert active_health(view, at(10 + POLICY.degraded_grace_ms)).health == "ok"


def test_no_failover_without_auto_failover():
    view = given(*healthy_fleet(), unreachable("a", 5), policy=Policy(auto_failover=False, heartbeat_timeout_ms=1000))
    assert only(view, facts(silent_ms={"a": 3000, "b": 100})) is None


@pytest.mark.parametrize(
    "standby_events, needle",
    [
        ([unreachable("b", 4)], "unreachable"),
        ([(OP, EligibilityChanged(at=at(4), domain="b", eligible=False, why="GPU 0 of b detached"))], "not eligible"),
        ([(subjects.model(F, "b", "m2"), ModelLost(at=at(4), domain="b", model="m2", reason="evicted"))], "lost"),
    ],
)
def test_never_promote_onto_an_unfit_standby_say_why_once(standby_events, needle):
    view = given(*healthy_fleet(), *standby_events, unreachable("a", 5))
    f = facts(silent_ms={"a": 3000, "b": 3000 if needle == "unreachable" else 100})
    event = only(view, f)
    assert isinstance(event, FailoverDeclined)
    assert needle in event.why and event.domain == "a" and event.candidate == "b"
    # once per distinct reason: with the decline folded, nothing more
    view = evolve(view, event, seq=view.seq + 1, subject=OP)
    assert only(view, f) is None


def test_a_standby_missing_an_admitted_model_is_not_promoted():
    refused = (
        subjects.decl(F),
        AdmissionDecided(at=T0, domain="b", name="m2", gpu_index=0, admitted=False, vram_bytes=1, short_by_bytes=5),
    )
    view = given(refused, *healthy_fleet(), unreachable("a", 5))
    event = only(view, facts(silent_ms={"a": 3000, "b": 100}))
    assert isinstance(event, FailoverDeclined) and "m2" in event.why


def test_an_aborted_auto_promotion_is_not_retried_before_the_retry_bound():
    aborted = [
        requested(op_id="op-x", revision=0, ms=5),
        (OP, OperationAborted(at=at(6), op_id="op-x", step="probe", error="500")),
    ]
    view = given(*healthy_fleet(), unreachable("a", 5), *aborted)
    f = facts(ms=7, silent_ms={"a": 3000, "b": 100})
    assert isinstance(only(view, f), FailoverDeclined)
    later = facts(ms=6 + retry_ms(POLICY), silent_ms={"a": 3000, "b": 100})
    assert isinstance(only(view, later), PromotionRequested)


# ----------------------------------------------------------------------------------- first route


def test_the_first_route_promotes_the_first_declared_domain_once_both_are_heard():
    events = [
        reachable("a"),
        reachable("b"),
        resident("a", "m1"),
        resident("a", "m2"),
        resident("b", "m1"),
        resident("b", "m2"),
    ]
    event = only(given(*events))
    assert isinstance(event, PromotionRequested)
    assert (event.target, event.reason, event.route_revision) == ("a", "initial", 0)
    assert only(given(*events[1:])) is None  # a not heard yet


def test_no_first_route_while_the_first_domain_is_loading():
    events = [
        reachable("a"),
        reachable("b"),
        (subjects.model(F, "a", "m1"), ModelLoading(at=at(0), domain="a", model="m1")),
        resident("a", "m2"),
    ]
    assert only(given(*events)) is None


# ----------------------------------------------------------------------------------- housekeeping


def test_an_awake_standby_is_demoted():
    events = [*healthy_fleet()[:-1], resident("b", "m1", 1), routed("a")]
    event = only(given(*events))
    assert isinstance(event, DemotionRequested) and (event.target, event.reason) == ("b", "standby_awake")


def test_a_recovered_ineligible_domain_is_demoted():
    events = [*healthy_fleet(), (OP, EligibilityChanged(at=at(1), domain="b", eligible=False, why="agent gone"))]
    event = only(given(*events))
    assert isinstance(event, DemotionRequested) and event.reason == "recovered"


def test_an_ineligible_domain_with_its_gpu_still_gone_is_not_demoted():
    events = [
        *healthy_fleet(),
        (OP, EligibilityChanged(at=at(1), domain="b", eligible=False, why="GPU gone")),
        (subjects.gpu(F, "b", 0), GpuObserved(at=at(2), domain="b", index=0, present=False)),
    ]
    assert only(given(*events)) is None


def test_a_healthy_fleet_needs_nothing():
    assert op_appends(given(*healthy_fleet())) == []


# ---------------------------------------------------------------------------------------- liveness


def test_silence_past_the_timeout_is_unreachable_and_a_heartbeat_reachable():
    view = given(*healthy_fleet())
    out = decide(view, facts(silent_ms={"a": 1500, "b": 100}))
    live = [a for a in out if "liveness" in a.subject]
    assert [(a.subject, type(a.event).__name__) for a in live] == [(subjects.liveness(F, "a"), "DomainUnreachable")]
    view = given(*healthy_fleet(), unreachable("a"))
    live = [a for a in decide(view, facts(silent_ms={"a": 10, "b": 100})) if "liveness" in a.subject]
    assert [type(a.event).__name__ for a in live] == ["DomainReachable"]


def test_no_silence_verdict_before_listening_for_one_timeout():
    view = given(*healthy_fleet())
    out = decide(view, facts(silent_ms={"a": None, "b": None}, listening_ms=500))
    assert [a for a in out if "liveness" in a.subject] == []
    out = decide(view, facts(silent_ms={"a": None, "b": 100}, listening_ms=1500))
    assert [type(a.event).__name__ for a in out if "liveness" in a.subject] == ["DomainUnreachable"]


# ----------------------------------------------------------------------------------- requests


def _judge(view, kind, target):
    return judge_request(view, kind, target, op_id="op-r", by="cli:test", now=at(9))


def test_request_statuses():
    view = given(*healthy_fleet())
    assert _judge(view, "promotion", "a").status == "noop"
    accepted = _judge(view, "promotion", "b")
    assert accepted.status == "accepted" and accepted.event.target == "b" and accepted.event.source == "a"
    assert accepted.event.route_revision == view.route_revision
    assert _judge(view, "demotion", "a").status == "refused"
    assert _judge(view, "demotion", "b").status == "accepted"
    assert _judge(view, "promotion", "zz").status == "not_found"
    assert _judge(given(declare=False), "promotion", "a").status == "not_found"
    busy = given(*healthy_fleet(), requested(op_id="op-busy"))
    joined = _judge(busy, "promotion", "b")
    assert (joined.status, joined.op_id) == ("joined", "op-busy")
    conflict = _judge(busy, "demotion", "b")
    assert (conflict.status, conflict.op_id) == ("conflict", "op-busy")
    assert _judge(busy, "promotion", "a").status == "conflict"


def test_promoting_an_ineligible_domain_by_hand_restores_its_eligibility_when_done():
    events = [
        *healthy_fleet(),
        (OP, EligibilityChanged(at=at(1), domain="b", eligible=False, why="agent gone")),
        requested(),
        *through("settle_old_active"),
        (OP, StepStarted(at=at(6), op_id="op-1", step="settle_old_active")),
        (OP, StepCompleted(at=at(7), op_id="op-1", step="settle_old_active")),
    ]
    event = only(given(*events))
    assert isinstance(event, EligibilityChanged) and (event.domain, event.eligible) == ("b", True)


def test_the_docs_carry_the_steps_and_transitions_tables():
    from pathlib import Path

    from haru.core.saga import tables_markdown

    doc = (Path(__file__).resolve().parents[2] / "docs" / "promoter.md").read_text()
    assert tables_markdown() in doc, "regenerate the tables in docs/promoter.md from haru.core.saga.tables_markdown()"


def test_the_first_route_waits_for_the_other_domain_to_finish_loading_within_the_grace():
    loading_b = (subjects.model(F, "b", "m1"), ModelLoading(at=at(0), domain="b", model="m1"))
    events = [reachable("a"), reachable("b"), resident("a", "m1"), resident("a", "m2"), loading_b, resident("b", "m2")]
    assert only(given(*events), facts(ms=10)) is None
    late = only(given(*events), facts(ms=POLICY.degraded_grace_ms + 1))
    assert isinstance(late, PromotionRequested) and late.target == "a"


def test_a_silent_second_domain_does_not_keep_the_fleet_from_its_first_route():
    events = [reachable("a"), unreachable("b"), resident("a", "m1"), resident("a", "m2")]
    event = only(given(*events), facts(silent_ms={"a": 10, "b": 5000}))
    assert isinstance(event, PromotionRequested) and event.target == "a"


def test_a_new_incident_with_the_same_unfit_standby_is_declined_again():
    first = given(*healthy_fleet(), unreachable("b", 4), unreachable("a", 5))
    f = facts(silent_ms={"a": 3000, "b": 3000})
    declined = only(first, f)
    assert isinstance(declined, FailoverDeclined)
    # a came back, then failed again later: a new incident, said again
    later = given(
        *healthy_fleet(),
        unreachable("b", 4),
        unreachable("a", 5),
        (OP, declined),
        reachable("a", 6),
        unreachable("a", 900),
    )
    again = only(later, facts(ms=1000, silent_ms={"a": 3000, "b": 3000}))
    assert isinstance(again, FailoverDeclined) and again.why != declined.why


def test_the_saga_tables_and_the_request_verdicts_are_pure():
    """What the gateway and the CLI read of the sagas loads no I/O library (the promoter's own deciders are
    held to the same by the import contracts: `lint-imports`)."""
    import subprocess
    import sys

    code = (
        "import sys, haru.core.saga, haru.core.standby, haru.core.requests, haru.core.weighing; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'nats', 'asyncio', 'aiohttp', 'structlog'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_settle_commands_carry_the_route_revision_after_the_flip():
    from haru.promoter.drive import command_for

    base = given(*healthy_fleet())
    view = given(
        *healthy_fleet(),
        requested(revision=base.route_revision),
        *through("settle_old_active"),
        routed("b", 6, op_id="op-1"),
    )
    domain, commands = command_for(view, view.operation, "settle_old_active")
    assert domain == "a" and [v for v, _, _ in commands] == ["sleep", "start_training"]
    assert all(c.route_revision == view.route_revision > base.route_revision for _, c, _ in commands)
    domain, commands = command_for(base, view.operation, "wake")
    assert domain == "b" and commands[0][1].route_revision == base.route_revision


def test_a_runner_is_gone_when_silent_past_the_timeout_or_never_heard_while_we_listened_that_long():
    from haru.promoter.drive import runner_gone

    base = dict(now=datetime(2026, 1, 1, tzinfo=UTC), me="promoter:two", step_by="promoter:one", runner_timeout_ms=3500)
    assert not runner_gone(Facts(**base, runner_silent_ms=1000, listening_ms=10_000))
    assert runner_gone(Facts(**base, runner_silent_ms=3500, listening_ms=10_000))
    assert not runner_gone(Facts(**base, runner_silent_ms=None, listening_ms=1000))  # too early to say
    assert runner_gone(Facts(**base, runner_silent_ms=None, listening_ms=3500))
    # our own step is never judged by silence (it has its own rule), nor anyone's when the timeout is off
    assert not runner_gone(Facts(**{**base, "step_by": "promoter:two"}, runner_silent_ms=None, listening_ms=99_999))
    assert not runner_gone(Facts(**{**base, "runner_timeout_ms": 0}, runner_silent_ms=99_999, listening_ms=99_999))
