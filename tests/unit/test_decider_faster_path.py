"""The faster path wins: a cold reload on the active (its warm-up measured in the log) against the standby's
wake, measured in the log, or estimated from its declared sizes before it ever woke."""

from __future__ import annotations

from msgspec.structs import replace

from haru.core import subjects
from haru.core.events import ModelLoading, ModelLost, ModelResident, ModelSleeping, ModelWaking, PromotionRequested
from haru.core.standby import standby_serves_in
from haru.promoter.health import active_health, faster_path
from tests.support.decider import POLICY, F, at, facts, given, only, reachable, routed


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
    first_load = given(
        *measured_fleet(load_ms=40_000, wake_ms=900),
        ev("a", "m1", ModelLoading(at=at(6), domain="a", model="m1", attempt=1)),
    )
    assert faster_path(first_load) is None


def test_a_standby_that_is_not_faster_waits_out_the_grace_as_before():
    # a reloads in 800 ms after its restart backoff (1000 ms): 1800 ms, against b's 1900 ms wake
    assert POLICY.restart_backoff_ms == 1_000
    view = given(*measured_fleet(load_ms=800, wake_ms=1_900), crash())
    assert faster_path(view) is None
    assert active_health(view, at(6)).health == "degraded" and only(view, facts(ms=6)) is None
    late = 5 + POLICY.degraded_grace_ms
    assert only(view, facts(ms=late)).reason == "degraded"


def fresh_fleet(load_ms: int, standby: str = "sleeping"):
    """a loaded cold (load_ms measured) and active; b loaded and then slept, or stayed resident (a runtime
    with no sleep mode, llama-server), but never woke: no wake of it was ever measured."""
    out = [reachable("a"), reachable("b")]
    for m in ("m1", "m2"):
        out += [
            ev("a", m, ModelLoading(at=at(0), domain="a", model=m)),
            ev("a", m, ModelResident(at=at(0), domain="a", model=m, warmup_ms=load_ms)),
            ev("b", m, ModelLoading(at=at(0), domain="b", model=m)),
            ev("b", m, ModelResident(at=at(0), domain="b", model=m, warmup_ms=load_ms)),
        ]
        if standby == "sleeping":
            out.append(ev("b", m, ModelSleeping(at=at(0), domain="b", model=m)))
    return [*out, routed("a")]


def test_a_standby_never_woken_is_estimated_and_the_decision_says_so():
    # a fresh fleet: b never woke, so nothing is measured; its wake is estimated (declared VRAM, 1 byte
    # here, at 8 GiB/s, plus the 500 ms probe), and a 40 s cold reload loses to it at once
    view = given(*fresh_fleet(load_ms=40_000), crash())
    assert view.domains["b"].models["m1"].wake_ms == 0
    event = only(view, facts(ms=6))
    assert isinstance(event, PromotionRequested) and event.reason == "faster_path"
    assert "40000 ms (measured warm-up)" in event.detail and "500 ms (ESTIMATED" in event.detail
    assert (event.target, event.source) == ("b", "a")


def test_the_estimate_grows_with_the_declared_size_and_loses_to_a_quicker_reload():
    slow_wake = replace(POLICY, wake_estimate_bytes_per_s=1)  # 1 byte declared: 1000 ms, plus the probe
    view = given(*fresh_fleet(load_ms=200), crash(), policy=slow_wake)  # + the 1000 ms restart backoff
    assert standby_serves_in(view, view.domains["b"], ["m1", "m2"]) == (1_500, False)
    assert faster_path(view) is None and active_health(view, at(6)).health == "degraded"
    assert only(view, facts(ms=5 + POLICY.degraded_grace_ms)).reason == "degraded"
    quicker = given(*fresh_fleet(load_ms=1_000), crash(), policy=slow_wake)
    assert "1500 ms (ESTIMATED" in only(quicker, facts(ms=6)).detail


def test_a_resident_standby_never_woken_needs_its_probe_alone():
    # llama-server has no sleep mode: the standby stays resident, and only the probe stands before it serves
    slow_wake = replace(POLICY, wake_estimate_bytes_per_s=1)
    view = given(*fresh_fleet(load_ms=1_000, standby="resident"), crash(), policy=slow_wake)
    assert standby_serves_in(view, view.domains["b"], ["m1", "m2"]) == (500, False)
    assert only(view, facts(ms=6)).reason == "faster_path"


def test_a_measured_wake_is_used_as_measured():
    view = given(*measured_fleet(load_ms=40_000, wake_ms=900), crash())
    assert standby_serves_in(view, view.domains["b"], ["m1", "m2"]) == (900, True)
    assert "900 ms (measured wake and probe)" in only(view, facts(ms=6)).detail


def test_a_warm_up_never_measured_leaves_the_grace_in_charge():
    never_loaded = given(*fresh_fleet(load_ms=0), crash())
    assert faster_path(never_loaded) is None and active_health(never_loaded, at(6)).health == "degraded"


def test_losses_a_wake_would_not_fix_are_not_a_faster_path():
    # gpu_detached fails the active at once anyway (its own reason); a standby that cannot be promoted never wins
    detached = given(*measured_fleet(load_ms=40_000, wake_ms=900), crash(reason="gpu_detached"))
    assert active_health(detached, at(6)).reason == "gpu_detached"
    standby_lost = ev("b", "m1", ModelLost(at=at(4), domain="b", model="m1", reason="evicted"))
    unfit = given(*measured_fleet(load_ms=40_000, wake_ms=900), standby_lost, crash())
    assert faster_path(unfit) is None


def test_the_restart_backoff_counts_while_the_model_is_lost_and_not_once_it_reloads():
    # a's 800 ms warm-up alone beats b's 900 ms wake, but the agent waits restart_backoff_ms (1000 ms) before
    # it even starts the runtime again: 1800 ms while lost, so the standby is the faster path
    lost = given(*measured_fleet(load_ms=800, wake_ms=900), crash())
    health = faster_path(lost)
    assert health is not None and "800 ms (measured warm-up) after the 1000 ms restart backoff" in health.why
    # once it loads again (attempt 2) the backoff is behind it: its warm-up alone, and a is the quicker
    reloading = given(
        *measured_fleet(load_ms=800, wake_ms=900),
        crash(),
        ev("a", "m1", ModelLoading(at=at(6), domain="a", model="m1", attempt=2)),
    )
    assert faster_path(reloading) is None
    no_backoff = given(*measured_fleet(load_ms=800, wake_ms=900), crash(), policy=replace(POLICY, restart_backoff_ms=0))
    assert faster_path(no_backoff) is None
