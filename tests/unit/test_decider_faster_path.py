"""The faster path wins: a cold reload on the active against the standby's wake, both measured in the log."""

from __future__ import annotations

from haru.core import subjects
from haru.core.events import ModelLoading, ModelLost, ModelResident, ModelSleeping, ModelWaking, PromotionRequested
from haru.promoter.decider import active_health, faster_path
from tests.unit.test_decider import F, POLICY, at, facts, given, only, reachable, routed


def ev(domain: str, model: str, event):
    return (subjects.model(F, domain, model), event)


def measured_fleet(load_ms: int, wake_ms: int):
    """a loaded cold (load_ms measured) and active; b woke once (wake_ms measured) and sleeps again."""
    out = [reachable("a"), reachable("b")]
    for m in ("m1", "m2"):
        out += [
            ev("a", m, ModelLoading(at=at(0), domain="a", model=m)),
            ev("a", m, ModelResident(at=at(0), domain="a", model=m, warmup_ms=load_ms)),
            ev("b", m, ModelLoading(at=at(0), domain="b", model=m)),
            ev("b", m, ModelResident(at=at(0), domain="b", model=m, warmup_ms=load_ms)),
            ev("b", m, ModelSleeping(at=at(0), domain="b", model=m)),
            ev("b", m, ModelWaking(at=at(0), domain="b", model=m)),
            ev("b", m, ModelResident(at=at(0), domain="b", model=m, warmup_ms=wake_ms)),
            ev("b", m, ModelSleeping(at=at(0), domain="b", model=m)),
        ]
    return [*out, routed("a")]


def crash(model: str = "m1", ms: int = 5, reason: str = "process_exited"):
    return ev("a", model, ModelLost(at=at(ms), domain="a", model=model, reason=reason))


def test_the_fold_keeps_the_measured_wake_and_warm_up():
    view = given(*measured_fleet(load_ms=40_000, wake_ms=900))
    assert view.domains["a"].models["m1"].load_ms == 40_000 and view.domains["a"].models["m1"].wake_ms == 0
    assert view.domains["b"].models["m1"].wake_ms == 900 and view.domains["b"].models["m1"].load_ms == 40_000


def test_a_cold_reload_slower_than_the_standbys_wake_fails_over_at_once_with_both_figures():
    for reason in ("process_exited", "evicted", "unhealthy"):
        view = given(*measured_fleet(load_ms=40_000, wake_ms=900), crash(reason=reason))
        event = only(view, facts(ms=6))
        assert isinstance(event, PromotionRequested) and event.reason == "faster_path", reason
        assert "40000 ms" in event.detail and "900 ms" in event.detail and (event.target, event.source) == ("b", "a")


def test_a_restart_under_way_is_still_a_cold_reload():
    restarting = ev("a", "m1", ModelLoading(at=at(6), domain="a", model="m1", attempt=2))
    view = given(*measured_fleet(load_ms=40_000, wake_ms=900), crash(), restarting)
    assert active_health(view, at(7)).reason == "faster_path"
    first_load = given(*measured_fleet(load_ms=40_000, wake_ms=900),
                       ev("a", "m1", ModelLoading(at=at(6), domain="a", model="m1", attempt=1)))
    assert faster_path(first_load) is None


def test_a_standby_that_is_not_faster_waits_out_the_grace_as_before():
    view = given(*measured_fleet(load_ms=800, wake_ms=900), crash())
    assert faster_path(view) is None
    assert active_health(view, at(6)).health == "degraded" and only(view, facts(ms=6)) is None
    late = 5 + POLICY.degraded_grace_ms
    assert only(view, facts(ms=late)).reason == "degraded"


def test_figures_never_measured_leave_the_grace_in_charge():
    no_wake = given(*measured_fleet(load_ms=40_000, wake_ms=0), crash())
    assert faster_path(no_wake) is None and active_health(no_wake, at(6)).health == "degraded"


def test_losses_a_wake_would_not_fix_are_not_a_faster_path():
    # gpu_detached fails the active at once anyway (its own reason); a standby that cannot be promoted never wins
    detached = given(*measured_fleet(load_ms=40_000, wake_ms=900), crash(reason="gpu_detached"))
    assert active_health(detached, at(6)).reason == "gpu_detached"
    standby_lost = ev("b", "m1", ModelLost(at=at(4), domain="b", model="m1", reason="evicted"))
    unfit = given(*measured_fleet(load_ms=40_000, wake_ms=900), standby_lost, crash())
    assert faster_path(unfit) is None
