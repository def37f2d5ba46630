"""Seeing it coming: a domain whose agent recorded a sign that it is about to go is moved off while it
still serves, the signal as the promotion's reason and cause."""

from __future__ import annotations

from haru.core import subjects
from haru.core.causes import decided_cause
from haru.core.events import AgentStarted, EligibilityChanged, FailoverDeclined, FailureSignalled, PromotionRequested
from haru.core.specs import Policy
from haru.promoter.health import standby_unfit
from tests.support.decider import POLICY, F, at, facts, given, healthy_fleet, only


def signal(
    domain: str = "a", source: str = "preemption_notice", detail: str = "spot instance-action: terminate", ms: int = 5
):
    return (subjects.agent(F, domain), FailureSignalled(at=at(ms), domain=domain, source=source, detail=detail))


def test_a_signalled_active_is_moved_off_at_once_with_the_signal_as_reason_and_cause():
    for source in ("preemption_notice", "gpu_xid", "gpu_ecc"):
        view = given(*healthy_fleet(), signal(source=source))
        event = only(view, facts(ms=6))
        assert isinstance(event, PromotionRequested), source
        assert (event.target, event.source, event.reason) == ("b", "a", source)
        assert "about to go" in event.detail
        assert decided_cause(view, event, {}) == view.domains["a"].signalled_seq > 0


def test_the_fold_keeps_the_signal_until_the_agent_starts_again():
    view = given(*healthy_fleet(), signal())
    assert view.domains["a"].signalled == "preemption_notice: spot instance-action: terminate"
    restarted = given(*healthy_fleet(), signal(), (subjects.agent(F, "a"), AgentStarted(at=at(9), domain="a")))
    assert restarted.domains["a"].signalled == "" and restarted.domains["a"].signalled_seq == 0


def test_a_signalled_standby_is_never_promoted_onto():
    view = given(*healthy_fleet(), signal("b"), signal("a", ms=6))
    assert "about to go" in standby_unfit(view, "b", view.domains["a"])
    event = only(view, facts(ms=7))
    assert isinstance(event, FailoverDeclined) and "about to go" in event.why


def test_no_move_without_auto_failover():
    view = given(*healthy_fleet(), signal(), policy=Policy(**{**_fields(POLICY), "auto_failover": False}))
    assert only(view, facts(ms=6)) is None


def _fields(policy: Policy) -> dict:
    import msgspec

    return msgspec.structs.asdict(policy)


def test_the_old_active_stays_out_of_the_standby_role_while_signalled():
    from haru.core.events import OperationCompleted, RouteMoved, StepCompleted, StepStarted
    from tests.support.decider import OP, ROUTE

    steps = []
    for i, step in enumerate(("stop_training", "verify_gpu", "wake", "probe", "flip", "settle_old_active")):
        steps += [
            (OP, StepStarted(at=at(10 + i), op_id="op-1", step=step)),
            (OP, StepCompleted(at=at(10 + i), op_id="op-1", step=step)),
        ]
        if step == "flip":
            steps.append((ROUTE, RouteMoved(at=at(10 + i), active="b", op_id="op-1")))
    view = given(
        *healthy_fleet(),
        signal(),
        (OP, PromotionRequested(at=at(6), op_id="op-1", target="b", source="a", reason="preemption_notice")),
        *steps,
    )
    event = only(view, facts(ms=30))
    assert isinstance(event, EligibilityChanged) and (event.domain, event.eligible) == ("a", False)
    assert "about to go" in event.why
    # and is not taken back as a "recovered" standby while the notice stands (it was, a moment after)
    later = given(
        *healthy_fleet(),
        signal(),
        (OP, PromotionRequested(at=at(6), op_id="op-1", target="b", source="a", reason="preemption_notice")),
        *steps,
        (OP, event),
        (OP, OperationCompleted(at=at(31), op_id="op-1")),
    )
    assert later.domains["a"].eligible is False and later.operation is None
    assert only(later, facts(ms=32)) is None
