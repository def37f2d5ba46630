"""Weights requests and canary rollback, pure: given events (folded by the real fold), when the
operator asks for weights or the decider decides with the gateways' reports, then this verdict/append."""

from __future__ import annotations

from datetime import timedelta

from haru.core import subjects
from haru.core.events import (
    DemotionRequested,
    ModelLost,
    ModelResident,
    StepCompleted,
    StepStarted,
    WeightingRequested,
    WeightsSet,
)
from haru.core.fold import evolve
from haru.core.saga import TRANSITIONS, flow
from haru.core.weighing import judge_weights
from haru.core.weights import CanaryReport, Count, Tally
from haru.promoter.canary import rollback, tally, weigh_refusal
from haru.promoter.decider import decide
from haru.promoter.decisions import Facts
from haru.promoter.drive import not_applicable
from tests.support.decider import T0, F, at, given, healthy_fleet, reachable, resident, routed, sleeping, unreachable

W = subjects.weights(F)
OP = subjects.op(F)


def canary_fleet(*more, weights=None, model=""):
    """a active, b awake with a share (b 10 unless `weights` says otherwise)."""
    split = weights if weights is not None else {"a": 90, "b": 10}
    return given(
        reachable("a"),
        reachable("b"),
        resident("a", "m1"),
        resident("a", "m2"),
        resident("b", "m1"),
        resident("b", "m2"),
        routed("a"),
        (W, WeightsSet(at=at(10), model=model, weights=split, op_id="op-w")),
        *more,
    )


def facts(ms: int = 100, **kw) -> Facts:
    return Facts(now=at(ms), new_op_id="op-new", listening_ms=10_000, silent_ms={"a": 0, "b": 0}, **kw)


def tallies(b=(100, 0), a=(900, 0), model="m1") -> dict:
    return {
        "b": {model: Tally(requests=b[0], errors=b[1], gateways=["gw1"], last_error="HTTP 500" if b[1] else "")},
        "a": {model: Tally(requests=a[0], errors=a[1], gateways=["gw1"])},
    }


# ------------------------------------------------------------------------------------------- rollback


def test_a_canary_within_policy_holds():
    assert rollback(canary_fleet(), tallies(b=(100, 5)), at(100)) is None  # 5.0% is not over 5%


def test_a_canary_over_the_error_rate_is_rolled_back_with_its_evidence():
    got = rollback(canary_fleet(), tallies(b=(100, 30)), at(100))
    assert got is not None and got.subject == W
    e = got.event
    assert isinstance(e, WeightsSet) and e.weights == {} and e.reason == "canary_rolled_back" and e.domain == "b"
    assert (e.requests, e.errors) == (100, 30)
    assert "error rate 30.0% (30 of 100" in e.detail and "gw1" in e.detail and "the active a: 0.0% of 900" in e.detail
    assert "last error: HTTP 500" in e.detail


def test_too_few_requests_are_no_evidence():
    assert rollback(canary_fleet(), tallies(b=(10, 10)), at(100)) is None


def test_a_canary_whose_probe_fails_is_rolled_back_at_once():
    lost = (subjects.model(F, "b", "m1"), ModelLost(at=at(20), domain="b", model="m1", reason="process_exited"))
    got = rollback(canary_fleet(lost), {}, at(100))
    assert got is not None and isinstance(got.event, WeightsSet)
    assert "probe failed: model 'm1' on b is lost" in got.event.detail


def test_an_unreachable_canary_is_rolled_back():
    got = rollback(canary_fleet(unreachable("b", 20)), {}, at(100))
    assert got is not None and "unreachable" in got.event.detail  # type: ignore[attr-defined]


def test_rolling_back_one_of_two_canaries_gives_its_share_to_the_active():
    view = given(
        reachable("a"),
        reachable("b"),
        resident("a", "m1"),
        resident("a", "m2"),
        resident("b", "m1"),
        resident("b", "m2"),
        routed("a"),
        (W, WeightsSet(at=at(10), weights={"a": 80, "b": 20})),
    )
    # a third domain is not declared in this fixture: a split of a and b is enough to show the arithmetic
    got = rollback(view, tallies(b=(100, 50)), at(100))
    assert got is not None and got.event.weights == {}  # type: ignore[attr-defined]


def test_a_model_split_rolls_back_only_that_model():
    view = canary_fleet(weights={"a": 50, "b": 50}, model="m2")
    got = rollback(view, tallies(b=(100, 40), model="m2"), at(100))
    assert got is not None and got.event.model == "m2" and got.event.weights == {}  # type: ignore[attr-defined]
    assert rollback(view, tallies(b=(100, 40), model="m1"), at(100)) is None  # m1's traffic is not split


def test_decide_appends_the_rollback():
    out = decide(canary_fleet(), facts(canary=tallies(b=(50, 50))))
    assert any(isinstance(a.event, WeightsSet) and a.event.reason == "canary_rolled_back" for a in out)


def test_an_awake_canary_is_not_demoted_but_an_awake_standby_without_a_share_is():
    assert not any(isinstance(a.event, DemotionRequested) for a in decide(canary_fleet(), facts()))
    view = canary_fleet((W, WeightsSet(at=at(20), weights={})))
    assert any(isinstance(a.event, DemotionRequested) and a.event.target == "b" for a in decide(view, facts()))


def test_tally_counts_only_reports_since_the_split():
    old = CanaryReport(fleet=F, at=at(0), counts=[Count(domain="b", model="m1", requests=10, errors=10)])
    new = CanaryReport(fleet=F, at=at(50), counts=[Count(domain="b", model="m1", requests=5, errors=1, last_error="x")])
    other = CanaryReport(fleet=F, at=at(60), counts=[Count(domain="b", model="m1", requests=5)])
    got = tally([("gw1", old), ("gw1", new), ("gw2", other)], since=at(20))
    assert got["b"]["m1"] == Tally(requests=10, errors=1, gateways=["gw1", "gw2"], last_error="x")


# ------------------------------------------------------------------------------------ the operation


def test_weighting_flow_wakes_probes_then_weighs():
    assert flow("weighting") == ["stop_training", "verify_gpu", "wake", "probe", "weigh"]
    assert TRANSITIONS[("weighting", "probe", "failed")] == "aborted"


def judge(view, given_, **kw):
    return judge_weights(view, given_, op_id="op-1", by="cli:t", now=at(100), **kw)


def test_weights_on_a_sleeping_standby_wake_it_first():
    view = given(*healthy_fleet(), routed("a"))
    j = judge(view, {"b": 10})
    assert j.status == "accepted" and isinstance(j.event, WeightingRequested)
    assert j.event.target == "b" and j.event.weights == {"a": 90, "b": 10}
    assert "b is woken and probed first" in j.message


def test_a_request_names_what_is_wrong_and_the_fix():
    view = given(*healthy_fleet(), routed("a"))
    assert judge(view, {"z": 10}).status == "invalid" and "no domain 'z'" in judge(view, {"z": 10}).message
    assert "add up to 90" in judge(view, {"a": 80, "b": 10}).message
    assert "haru promote b" in judge(view, {"b": 100}).message
    assert "not declared on the active" in judge(view, {"b": 10}, model="nope").message
    assert judge(view, {}).status == "invalid"
    assert judge(view, {}, reset=True).status == "noop"


def test_a_standby_that_cannot_be_woken_is_refused_with_why():
    view = given(
        reachable("a"),
        unreachable("b"),
        resident("a", "m1"),
        resident("a", "m2"),
        sleeping("b", "m1"),
        sleeping("b", "m2"),
        routed("a"),
    )
    j = judge(view, {"b": 10})
    assert j.status == "refused" and "unreachable" in j.message and "start it" in j.message


def test_no_weights_before_the_first_route():
    view = given(*healthy_fleet()[:-1])  # without its route_moved
    j = judge(view, {"b": 10})
    assert j.status == "invalid" and "no active domain" in j.message


def test_a_reset_targets_the_active_and_wakes_nothing():
    view = canary_fleet()
    j = judge(view, {}, reset=True)
    assert j.status == "accepted" and j.event.target == "a" and j.event.weights == {}  # type: ignore[union-attr]
    op_view = evolve(view, j.event, seq=view.seq + 1, subject=OP)  # type: ignore[arg-type]
    assert op_view.operation is not None
    assert not_applicable(op_view, op_view.operation, "wake").startswith("skipped")
    assert not_applicable(op_view, op_view.operation, "weigh") == ""


def test_after_weigh_the_decider_records_the_split_then_completes():
    view = given(*healthy_fleet(), routed("a"))
    j = judge(view, {"b": 10})
    seq = view.seq
    events = [j.event]
    for step in flow("weighting"):
        events += [StepStarted(at=at(200), op_id="op-1", step=step), StepCompleted(at=at(300), op_id="op-1", step=step)]
    for e in events:
        seq += 1
        view = evolve(view, e, seq=seq, subject=OP)  # type: ignore[arg-type]
    for m in ("m1", "m2"):
        seq += 1
        view = evolve(view, ModelResident(at=at(250), domain="b", model=m), seq=seq, subject=subjects.model(F, "b", m))
    assert weigh_refusal(view, view.operation) == ""  # type: ignore[arg-type]
    out = decide(view, facts(400))
    sets = [a for a in out if isinstance(a.event, WeightsSet)]
    assert len(sets) == 1 and sets[0].subject == W and sets[0].event.weights == {"a": 90, "b": 10}  # type: ignore[attr-defined]
    seq += 1
    view = evolve(view, sets[0].event, seq=seq, subject=W)
    assert view.weights == {"a": 90, "b": 10}
    assert [type(a.event).__name__ for a in decide(view, facts(500))] == ["OperationCompleted"]


def test_weigh_is_refused_when_the_target_is_not_resident():
    view = given(*healthy_fleet(), routed("a"))
    j = judge(view, {"b": 10})
    view = evolve(view, j.event, seq=view.seq + 1, subject=OP)  # type: ignore[arg-type]
    assert "model 'm1' on b is sleeping" in weigh_refusal(view, view.operation)  # type: ignore[arg-type]


def test_unused():
    assert timedelta and T0 and F


def test_a_rolling_change_has_a_canary_step_before_its_flip_and_a_rollback_aborts_it():
    steps = flow("rolling")
    assert steps.index("probe") + 1 == steps.index("canary") == steps.index("flip") - 1
    assert TRANSITIONS[("rolling", "canary", "failed")] == "aborted"


def test_the_promoter_counts_rollbacks_by_why():
    from types import SimpleNamespace

    from haru.promoter.metrics import PromoterMetrics

    m = PromoterMetrics()
    view = canary_fleet()
    for detail in ("canary b rolled back: probe failed: b is unreachable", "canary b rolled back: error rate 30.0%"):
        rec = SimpleNamespace(event=WeightsSet(at=at(1), reason="canary_rolled_back", domain="b", detail=detail))
        m.record(F, rec, view)  # type: ignore[arg-type]
    m.record(F, SimpleNamespace(event=WeightsSet(at=at(1), weights={"a": 90, "b": 10})), view)  # type: ignore[arg-type]
    get = m.registry.get_sample_value
    assert get("haru_promoter_canary_rollbacks_total", {"fleet": F, "domain": "b", "why": "probe"}) == 1
    assert get("haru_promoter_canary_rollbacks_total", {"fleet": F, "domain": "b", "why": "error_rate"}) == 1
