"""Fleets of three and four domains: the ranking of standbys (pure), the route intent and status that carry
it, auto-failover onto the best fit standby, the cascade within one operation, and re-protection."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from haru.core import ranking, subjects
from haru.core.events import (
    AdmissionDecided,
    DemotionRequested,
    DomainDeclared,
    DomainReachable,
    DomainUnreachable,
    EligibilityChanged,
    FleetDeclared,
    ModelDeclared,
    ModelLoading,
    ModelLost,
    ModelResident,
    ModelSleeping,
    ModelWaking,
    OperationAborted,
    PromotionRequested,
    PromotionRetargeted,
    RouteMoved,
    StepFailed,
    StepStarted,
)
from haru.core.fold import empty, evolve
from haru.core.intents import intent
from haru.core.requests import judge_request
from haru.core.residency import Resident, Sleeping
from haru.core.specs import DomainSpec, GpuSpec, ModelSpec, Policy
from haru.core.views import FleetView
from haru.projections.status import render, render_intent
from haru.promoter.decider import decide
from haru.promoter.decisions import Facts

T0 = datetime(2026, 12, 2, 1, 0, tzinfo=UTC)
F = "default"
OP = subjects.op(F)
POLICY = Policy(heartbeat_timeout_ms=1000, degraded_grace_ms=5000, command_timeout_ms=2000)


def at(ms: int) -> datetime:
    return T0 + timedelta(milliseconds=ms)


class World:
    """A fleet of `names` domains (each one GPU, models m1 and m2), folded by the real fold."""

    def __init__(self, names: str = "abc", policy: Policy = POLICY) -> None:
        self.view: FleetView = empty(F)
        self.seq = 0
        self.add(subjects.decl(F), FleetDeclared(at=T0, fleet=F, policy=policy))
        for d in names:
            self.add(
                subjects.decl(F),
                DomainDeclared(at=T0, spec=DomainSpec(name=d, gpus=[GpuSpec(index=0, memory_bytes=24 << 30)])),
            )
            for m in ("m1", "m2"):
                self.add(
                    subjects.decl(F), ModelDeclared(at=T0, domain=d, spec=ModelSpec(name=m, slot="chat", gpu_index=0))
                )
                self.add(
                    subjects.decl(F),
                    AdmissionDecided(at=T0, domain=d, name=m, gpu_index=0, admitted=True, vram_bytes=1),
                )

    def add(self, subject: str, event) -> int:
        self.seq += 1
        self.view = evolve(self.view, event, seq=self.seq, subject=subject)
        return self.seq

    def reachable(self, *domains: str, ms: int = 0) -> World:
        for d in domains:
            self.add(subjects.liveness(F, d), DomainReachable(at=at(ms), domain=d))
        return self

    def unreachable(self, *domains: str, ms: int = 0) -> World:
        for d in domains:
            self.add(subjects.liveness(F, d), DomainUnreachable(at=at(ms), domain=d, silent_ms=1500))
        return self

    def resident(self, d: str, ms: int = 0) -> World:
        for m in ("m1", "m2"):
            self.add(subjects.model(F, d, m), ModelResident(at=at(ms), domain=d, model=m))
        return self

    def asleep(self, d: str, wake_ms: int = 0, ms: int = 0) -> World:
        """Resident, then asleep; with `wake_ms`, a measured wake (waking, then resident that much later), asleep
        again."""
        for m in ("m1", "m2"):
            self.add(subjects.model(F, d, m), ModelResident(at=at(ms), domain=d, model=m))
            self.add(subjects.model(F, d, m), ModelSleeping(at=at(ms), domain=d, model=m))
            if wake_ms:
                self.add(subjects.model(F, d, m), ModelWaking(at=at(ms), domain=d, model=m))
                self.add(
                    subjects.model(F, d, m), ModelResident(at=at(ms + wake_ms), domain=d, model=m, warmup_ms=wake_ms)
                )
                self.add(subjects.model(F, d, m), ModelSleeping(at=at(ms + wake_ms), domain=d, model=m))
        return self

    def route(self, active: str, ms: int = 0) -> World:
        self.add(subjects.route(F), RouteMoved(at=at(ms), active=active, previous=self.view.active))
        return self


def healthy(names: str = "abc", policy: Policy = POLICY, wakes: dict[str, int] | None = None) -> World:
    w = World(names, policy)
    w.reachable(*names).resident(names[0])
    for d in names[1:]:
        w.asleep(d, wake_ms=(wakes or {}).get(d, 0))
    return w.route(names[0])


def facts(ms: int, op_id: str = "op-new") -> Facts:
    return Facts(now=at(ms), new_op_id=op_id)


# ----------------------------------------------------------------------------------- the ranking (pure)


def test_standbys_rank_in_the_layouts_order_when_all_are_fit_each_saying_why() -> None:
    ranked = ranking.rank(healthy("abcd").view)
    assert [(r.domain, r.rank, r.fit) for r in ranked] == [("b", 1, True), ("c", 2, True), ("d", 3, True)]
    assert "declared 2nd in the layout" in ranked[0].why and "declared 4th in the layout" in ranked[2].why
    assert ranking.first_fit(healthy("abcd").view) == "b"


def test_an_unfit_standby_ranks_after_every_fit_one_and_is_never_picked() -> None:
    w = healthy("abcd").unreachable("b")
    ranked = ranking.rank(w.view)
    assert [r.domain for r in ranked] == ["c", "d", "b"]
    assert ranked[-1].fit is False and "standby b is unreachable" in ranked[-1].why
    assert ranking.first_fit(w.view) == "c"
    assert w.view.standby() == "c"  # today's readers get the first-ranked standby


def test_the_policys_declared_order_goes_before_the_layouts() -> None:
    w = healthy("abcd", Policy(**{**_fields(POLICY), "standby_order": ["d", "b", "c"]}))
    assert [r.domain for r in ranking.rank(w.view)] == ["d", "b", "c"]
    assert "declared 1st in standby_order" in ranking.rank(w.view)[0].why


def test_domains_standby_order_does_not_name_rank_after_by_their_measured_wake() -> None:
    policy = Policy(**{**_fields(POLICY), "standby_order": ["d"]})
    w = healthy("abcd", policy, wakes={"b": 900, "c": 300})
    ranked = ranking.rank(w.view)
    assert [r.domain for r in ranked] == ["d", "c", "b"]  # d declared; then c wakes in 300 ms, b in 900 ms
    assert ranked[1].wake_ms == 300 and "last wake 300 ms" in ranked[1].why
    assert "wake never measured" in ranked[0].why


def test_the_old_active_rejoins_as_the_lowest_ranked_standby() -> None:
    w = healthy("abc").route("b")  # a lost the active role (it is declared first)
    w.asleep("a")
    ranked = ranking.rank(w.view)
    assert [r.domain for r in ranked] == ["c", "a"]
    assert ranked[1].fit and "lost the active role" in ranked[1].why


def test_protection_counts_fit_standbys() -> None:
    w = healthy("abc")
    assert ranking.protection(w.view) == "protected"
    w.unreachable("b")
    assert ranking.protection(w.view) == "protected"  # c still could take over
    w.unreachable("c")
    assert ranking.protection(w.view) == "unprotected"
    assert ranking.protection(World("abc").view) == ""  # no route yet
    assert ranking.protection(healthy("a").view) == ""  # one domain: nothing to protect with


def _fields(p: Policy) -> dict:
    return {k: getattr(p, k) for k in p.__struct_fields__}


# ------------------------------------------------------------------------- route intent and status


def test_the_route_intent_carries_the_ranking_and_the_first_ranked_as_standby() -> None:
    w = healthy("abcd").unreachable("b")
    ri = intent(w.view)
    assert ri.standby is not None and ri.standby.domain == "c"
    assert [(r.domain, r.rank, r.fit) for r in ri.standbys] == [("c", 1, True), ("d", 2, True), ("b", 3, False)]
    assert ri.protection == "protected"
    w.unreachable("c", "d")
    ri = intent(w.view)
    assert ri.protection == "unprotected" and not any(r.fit for r in ri.standbys)
    text = render_intent(ri, at(0))
    assert "UNPROTECTED" in text and "3. " in text


def test_status_ranks_every_standby_and_names_the_unprotected_state() -> None:
    w = healthy("abcd").unreachable("c")
    text = render(w.view, at(10))
    assert "b  (standby #1)" in text and "d  (standby #2)" in text and "c  (standby #3)" in text
    assert "standbys: 2 of 3 fit (protected)" in text
    assert "3. c  not fit: standby c is unreachable" in text
    w.unreachable("b", "d")
    assert "standbys: none of 3 fit: UNPROTECTED" in render(w.view, at(20))


# ------------------------------------------------------------------------------------- the promoter


def test_auto_failover_promotes_the_best_fit_standby_when_the_first_ranked_is_dead() -> None:
    w = healthy("abcd").unreachable("b").unreachable("a", ms=100)
    out = decide(w.view, facts(200))
    [req] = [a.event for a in out if isinstance(a.event, PromotionRequested)]
    assert req.target == "c" and req.source == "a" and req.cascade is True


def test_with_no_fit_standby_the_failover_is_declined_naming_the_unprotected_fleet() -> None:
    w = healthy("abc").unreachable("b", "c").unreachable("a", ms=100)
    out = decide(w.view, facts(200))
    events = [a.event for a in out]
    assert not any(isinstance(e, PromotionRequested) for e in events)
    declined = [e for e in events if e.__class__.__name__ == "FailoverDeclined"]
    assert declined and "no fit standby (fleet unprotected)" in declined[0].why


def _promotion_running(names: str, target: str, *, cascade: bool) -> World:
    w = healthy(names)
    w.add(
        OP,
        PromotionRequested(
            at=at(10), op_id="op-1", target=target, source="a", reason="domain_unreachable", cascade=cascade
        ),
    )
    return w


def _fail(w: World, step: str, error: str, attempt: int = 1, ms: int = 20) -> None:
    w.add(OP, StepStarted(at=at(ms), op_id="op-1", step=step, attempt=attempt))  # type: ignore[arg-type]
    w.add(OP, StepFailed(at=at(ms + 1), op_id="op-1", step=step, error_code="no_responders", error=error))  # type: ignore[arg-type]


def _apply(w: World, out) -> None:
    for a in out:
        w.add(a.subject, a.event)


def test_a_cascading_promotion_moves_on_to_the_next_fit_standby_in_the_same_operation() -> None:
    w = _promotion_running("abc", "b", cascade=True)
    _fail(w, "stop_training", "stop_training: no agent answers for b")
    out = decide(w.view, facts(30))
    [moved] = [a.event for a in out]
    assert isinstance(moved, PromotionRetargeted)
    assert (moved.op_id, moved.previous, moved.target, moved.step) == ("op-1", "b", "c", "stop_training")
    _apply(w, out)
    op = w.view.operation
    assert op is not None and op.op_id == "op-1" and op.target == "c" and op.steps == []
    assert [(t.target, t.step) for t in op.tried] == [("b", "stop_training")]
    [start] = [a.event for a in decide(w.view, facts(31))]
    # the new target starts from the first step; its attempt stays above the failed one's
    assert isinstance(start, StepStarted) and start.step == "stop_training" and start.attempt == 2
    assert "tried first: b (stop_training failed" in render(w.view, at(32))


def test_four_domains_cascade_through_every_fit_standby_then_abort_naming_them() -> None:
    w = _promotion_running("abcd", "b", cascade=True)
    _fail(w, "wake", "wake: out of memory")
    _apply(w, decide(w.view, facts(30)))
    assert w.view.operation is not None and w.view.operation.target == "c"
    _fail(w, "probe", "probe: timed out", ms=40)
    _apply(w, decide(w.view, facts(50)))
    assert w.view.operation is not None and w.view.operation.target == "d"
    _fail(w, "verify_gpu", "verify_gpu: trainer memory not released", ms=60)
    [end] = [a.event for a in decide(w.view, facts(70))]
    assert isinstance(end, OperationAborted)
    assert "after b, c failed too" in end.error
    _apply(w, [type("A", (), {"subject": OP, "event": end})()])
    assert w.view.active == "a"  # routing never moved
    assert w.view.last_operation is not None and [t.target for t in w.view.last_operation.tried] == ["b", "c"]


def test_a_promotion_to_a_named_target_does_not_cascade() -> None:
    w = _promotion_running("abc", "b", cascade=False)
    _fail(w, "wake", "wake: out of memory")
    [end] = [a.event for a in decide(w.view, facts(30))]
    assert isinstance(end, OperationAborted) and "after" not in end.error


def test_haru_promote_without_a_target_judges_the_best_fit_standby() -> None:
    w = healthy("abcd").unreachable("b")
    target = ranking.first_fit(w.view) or w.view.standby()
    verdict = judge_request(w.view, "promotion", target, op_id="op-9", by="test", now=at(5))
    assert verdict.status == "accepted" and isinstance(verdict.event, PromotionRequested)
    assert verdict.event.target == "c"


def test_after_a_failover_the_recovered_old_active_rejoins_asleep_and_last_without_an_operator() -> None:
    # a failed (unreachable), the route moved to b, the old active was marked ineligible; c is unreachable:
    # the fleet is unprotected until a recovers.
    w = healthy("abc").unreachable("a", ms=100).route("b", ms=200).resident("b", ms=200)
    w.add(OP, EligibilityChanged(at=at(210), domain="a", eligible=False, why="agent of a unreachable"))
    w.unreachable("c", ms=220)
    assert ranking.protection(w.view) == "unprotected"
    assert intent(w.view).protection == "unprotected"
    # a's agent comes back with its models resident (a restarted host loads them): the promoter demotes it
    w.reachable("a", ms=300).resident("a", ms=300)
    out = decide(w.view, facts(400))
    [dem] = [a.event for a in out]
    assert isinstance(dem, DemotionRequested) and dem.target == "a"
    # the demotion put it to sleep, and recorded it eligible again: it is the lowest-ranked fit standby
    w.asleep("a", ms=500)
    w.add(OP, EligibilityChanged(at=at(510), domain="a", eligible=True, why="recovered: asleep with training started"))
    ranked = ranking.rank(w.view)
    assert [(r.domain, r.fit) for r in ranked] == [("a", True), ("c", False)]  # c is unfit, so a is first fit
    assert ranking.protection(w.view) == "protected"
    w.reachable("c", ms=600)
    assert [r.domain for r in ranking.rank(w.view)] == ["c", "a"]  # once c is fit again, a ranks last


@pytest.mark.parametrize("names", ["abc", "abcd"])
def test_loading_standbys_are_not_fit_until_their_models_can_be_woken(names: str) -> None:
    w = World(names).reachable(*names).resident(names[0]).route(names[0])
    for d in names[1:]:
        w.add(subjects.model(F, d, "m1"), ModelLoading(at=at(1), domain=d, model="m1"))
    assert ranking.protection(w.view) == "unprotected"
    assert all("is loading" in r.why or "is unknown" in r.why for r in ranking.rank(w.view))


def test_first_unready_names_the_first_model_a_domain_cannot_use_and_why() -> None:
    """The one check the ranking, a weighting and the canary's probe share: undeclared, not admitted, lost
    (with its reason), or in a state outside the caller's `ready`."""
    w = World("ab").reachable("a", "b").resident("a").asleep("b")
    b = w.view.domains["b"]
    assert ranking.first_unready(b, ["m1", "m2"], (Sleeping,)) is None
    assert ranking.first_unready(b, ["m1", "m2"], (Resident,)) == ranking.Unready("m1", "state", "sleeping")
    assert ranking.first_unready(b, ["m3"], (Sleeping,)) == ranking.Unready("m3", "undeclared", "")
    w.add(subjects.model(F, "b", "m2"), ModelLost(at=at(1), domain="b", model="m2", reason="process_exited"))
    assert ranking.first_unready(w.view.domains["b"], ["m1", "m2"], (Sleeping,)) == ranking.Unready(
        "m2", "lost", "lost", "process_exited"
    )
    w.add(subjects.decl(F), AdmissionDecided(at=T0, domain="b", name="m1", gpu_index=0, admitted=False, vram_bytes=1))
    assert ranking.first_unready(w.view.domains["b"], ["m1"], (Sleeping,)).why == "not_admitted"
