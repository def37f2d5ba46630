"""What an operator reads carries its age and clears when its cause does (issue 29, first bullet).

Each state `haru status`, the console and `haru op` show as current is walked through the event
that ends its cause: a declined failover (the route moves, a promotion goes ahead, or the declined
domain is healthy again), an anomaly (the model's next legal transition), an ineligibility (the
demotion that restores it). A best-effort step that cannot apply for a known reason (the old
active's GPU is gone) is recorded as skipped, with why, not as a failure.
"""

from __future__ import annotations

from haru.core import subjects
from haru.core.events import (
    EligibilityChanged,
    FailoverDeclined,
    GpuObserved,
    ModelLoading,
    ModelLost,
    ModelResident,
    ModelWaking,
    OperationCompleted,
    PromotionRequested,
    StepCompleted,
    StepStarted,
)
from haru.core.fold import Folder, evolve
from haru.projections.status import render
from haru.promoter.drive import not_applicable
from tests.support.decider import OP, F, at, given, healthy_fleet, only, requested, routed, through

GPU_A = subjects.gpu(F, "a", 0)


def _decline(ms: int = 100):
    return (
        OP,
        FailoverDeclined(
            at=at(ms), domain="a", candidate="b", why="GPU 0 of a detached; standby b's GPU 0 is detached"
        ),
    )


def _both_gpus_gone():
    return [
        (GPU_A, GpuObserved(at=at(50), domain="a", index=0, present=False)),
        (subjects.gpu(F, "b", 0), GpuObserved(at=at(50), domain="b", index=0, present=False)),
        (subjects.model(F, "a", "m1"), ModelLost(at=at(60), domain="a", model="m1", reason="gpu_detached")),
    ]


def _status(view, ms: int) -> str:
    return render(view, at(ms))


def test_a_declined_failover_shows_its_age():
    view = given(*healthy_fleet(), *_both_gpus_gone(), _decline(100))
    assert "failover declined 30s ago: GPU 0 of a detached" in _status(view, 30_100)


def test_a_declined_failover_clears_when_the_route_moves():
    view = given(*healthy_fleet(), *_both_gpus_gone(), _decline(100), routed("b", 200, op_id="op-2"))
    assert view.declined == "" and view.declined_at is None
    assert "failover declined" not in _status(view, 300)


def test_a_declined_failover_clears_when_the_promotion_goes_ahead():
    view = given(*healthy_fleet(), *_both_gpus_gone(), _decline(100), requested(ms=200))
    assert view.declined == ""


def test_a_declined_failover_clears_when_the_failed_active_is_healthy_again():
    back = (GPU_A, GpuObserved(at=at(300), domain="a", index=0, present=True))
    view = given(*healthy_fleet(), *_both_gpus_gone(), _decline(100), back)
    assert view.declined, "the GPU is back but m1 is still lost: the active is still failed"
    # m1 reloading: the active is no longer failed (the promoter's active_health says ok), so the
    # decline is over; the model's own line says it is loading and for how long.
    reload = (subjects.model(F, "a", "m1"), ModelLoading(at=at(310), domain="a", model="m1"))
    view = given(*healthy_fleet(), *_both_gpus_gone(), _decline(100), back, reload)
    assert view.declined == "" and "failover declined" not in _status(view, 500)


def test_the_incremental_folder_clears_a_decline_as_evolve_does():
    events = [
        *healthy_fleet(),
        *_both_gpus_gone(),
        _decline(100),
        (GPU_A, GpuObserved(at=at(300), domain="a", index=0, present=True)),
        (subjects.model(F, "a", "m1"), ModelResident(at=at(400), domain="a", model="m1")),
    ]
    base = given()
    folder = Folder(base)
    for i, (subject, event) in enumerate(events, start=base.seq + 1):
        folder.add(event, seq=i, subject=subject)
    assert folder.view() == given(*events)
    assert folder.view().declined == ""


def test_an_anomaly_shows_its_age_and_clears_at_the_models_next_legal_transition():
    model = subjects.model(F, "a", "m1")
    # resident -> waking is not in the table: folded leniently, counted, open.
    view = given(*healthy_fleet(), (model, ModelWaking(at=at(1_000), domain="a", model="m1")))
    assert view.anomalies == 1 and view.anomaly_cleared_at is None
    text = _status(view, 61_000)
    assert "anomalies in the log: 1 (last, 60s ago: seq" in text
    view = given(
        *healthy_fleet(),
        (model, ModelWaking(at=at(1_000), domain="a", model="m1")),
        (model, ModelResident(at=at(2_000), domain="a", model="m1")),
    )
    assert view.anomalies == 1, "the count is history: it never goes down"
    assert view.anomaly_cleared_at == at(2_000)
    assert "(none open: the last, 60s ago, about a/m1, cleared 59s ago:" in _status(view, 61_000)


def test_an_anomaly_about_another_model_does_not_clear_it():
    view = given(
        *healthy_fleet(),
        (subjects.model(F, "a", "m1"), ModelWaking(at=at(1_000), domain="a", model="m1")),
        (subjects.model(F, "a", "m2"), ModelLoading(at=at(2_000), domain="a", model="m2")),
    )
    assert view.anomaly_cleared_at is None


def test_an_ineligibility_shows_its_age_and_clears_when_the_demotion_restores_it():
    from haru.core.events import DemotionRequested

    ineligible = (OP, EligibilityChanged(at=at(1_000), domain="b", eligible=False, why="GPU 0 of b detached"))
    view = given(*healthy_fleet(), ineligible)
    assert "ineligible for 120s: GPU 0 of b detached" in _status(view, 121_000)
    dem = (OP, DemotionRequested(at=at(2_000), op_id="op-d", target="b", reason="recovered"))
    steps = [
        (OP, StepStarted(at=at(3_000), op_id="op-d", step="sleep")),
        (OP, StepCompleted(at=at(4_000), op_id="op-d", step="sleep")),
        (OP, StepStarted(at=at(5_000), op_id="op-d", step="start_training")),
        (OP, StepCompleted(at=at(6_000), op_id="op-d", step="start_training")),
    ]
    view = given(*healthy_fleet(), ineligible, dem, *steps)
    restored = only(view)  # what the promoter appends: the clearing event
    assert isinstance(restored, EligibilityChanged) and restored.eligible
    view = evolve(view, restored, seq=view.seq + 1, subject=OP)
    assert view.domains["b"].eligible and view.domains["b"].ineligible_why == ""
    assert "ineligible" not in _status(view, 121_000)


def _failover_onto_b_with_a_gone():
    gone = (GPU_A, GpuObserved(at=at(4), domain="a", index=0, present=False))
    req = (
        OP,
        PromotionRequested(
            at=at(1), op_id="op-1", target="b", source="a", reason="gpu_detached", detail="GPU 0 of a detached"
        ),
    )
    return [
        *healthy_fleet(),
        req,
        gone,
        *through("settle_old_active"),
        (OP, StepStarted(at=at(6), op_id="op-1", step="settle_old_active")),
    ]


def test_settle_on_an_old_active_whose_gpu_is_gone_is_skipped_with_why():
    view = given(*_failover_onto_b_with_a_gone())
    assert view.operation is not None
    why = not_applicable(view, view.operation, "settle_old_active")
    assert why == (
        "skipped: GPU 0 of a is gone (the reason for this operation), so it cannot be put to sleep or given training"
    )
    # Fatal steps are never skipped: their failure is what aborts the operation.
    assert not_applicable(view, view.operation, "wake") == ""


def test_a_skipped_step_reads_as_skipped_and_the_operation_completes():
    skipped = (
        OP,
        StepCompleted(
            at=at(7),
            op_id="op-1",
            step="settle_old_active",
            skipped="skipped: GPU 0 of a is gone (the reason for this operation), so it cannot "
            "be put to sleep or given training",
        ),
    )
    view = given(*_failover_onto_b_with_a_gone(), skipped)
    steps = {s.step: s for s in view.operation.steps}
    assert steps["settle_old_active"].state == "skipped"
    shown = _status(view, 1_000)
    assert "settle_old_active skipped (skipped: GPU 0 of a is gone" in shown and "failed" not in shown
    # What follows a skipped best-effort step is what follows a completed one.
    event = only(view)
    assert isinstance(event, EligibilityChanged) and not event.eligible and "GPU 0 of a detached" in event.why
    view = evolve(view, event, seq=view.seq + 1, subject=OP)
    assert isinstance(only(view), OperationCompleted)


def test_an_unreachable_old_active_is_skipped_too():
    view = given(*_failover_onto_b_with_a_gone())
    from haru.core.events import DomainUnreachable

    view = evolve(
        view,
        DomainUnreachable(at=at(8), domain="a", silent_ms=5000),
        seq=view.seq + 1,
        subject=subjects.liveness(F, "a"),
    )
    assert "a is unreachable" in not_applicable(view, view.operation, "settle_old_active")


# ------------------------------------------------------------------ haru apply --dry-run: what it takes away


def test_the_dry_run_names_every_running_model_a_change_stops_or_leaves_unadmitted():
    from haru.core.apply import running_at_risk
    from haru.core.events import AdmissionDecided, ModelRetired

    view = given(*healthy_fleet())  # a serves m1, m2 (resident); b keeps them asleep
    events = [
        AdmissionDecided(
            at=at(1), domain="a", name="m2", gpu_index=0, admitted=False, vram_bytes=8 << 30, short_by_bytes=3 << 30
        ),
        ModelRetired(at=at(1), domain="b", model="m1"),
    ]
    lines = running_at_risk(events, view, "a")
    assert lines == [
        "a/m2 (serving) is unloaded and left unadmitted on the ACTIVE domain a: no longer admitted, short by 3.0 GiB "
        "on GPU 0 (first fit in declaration order: what is declared before it now takes the room); requests get 409 "
        "model_not_admitted",
        "b/m1 (sleeping) stops: retired from the layout",
    ]
    assert running_at_risk(events, None, "a") == [], "without the running state nothing is claimed"


def test_a_model_the_planner_no_longer_admits_is_stopped_with_the_shortfall_as_its_reason():
    from haru.agents.config import HostSlots
    from haru.core.specs import Domain, DomainSpec, Policy

    slots = HostSlots(
        fleet=F,
        domain=Domain(spec=DomainSpec(name="a")),
        policy=Policy(),
        admitted_models=[],
        admitted_training=[],
        not_admitted={"m2": 3 << 30},
    )
    assert slots.retire_why("m2") == "no longer admitted: short by 3.0 GiB (the layout still declares it)"
    assert slots.retire_why("gone") == "the layout no longer has this model"


def test_a_restarted_agent_stops_a_no_longer_admitted_runtime_with_the_shortfall_as_its_reason():
    """The restart path (a runtime a previous agent left, found by its identity file) gives the same
    reason as the live path: declared but not admitted is not 'the layout no longer has this model'."""
    import os

    from haru.agents.config import HostSlots
    from haru.agents.runtime_files import runtime_on_start, start_time
    from haru.core.specs import Domain, DomainSpec, Policy

    slots = HostSlots(
        fleet=F,
        domain=Domain(spec=DomainSpec(name="a")),
        policy=Policy(),
        admitted_models=[],
        admitted_training=[],
        not_admitted={"m2": 3 << 30},
    )
    alive = {"pid": os.getpid(), "start": int(start_time(os.getpid())), "port": 9000, "runtime": "vllm", "argv": []}
    verdict = runtime_on_start(alive, None, None, slots.retire_why("m2"))
    assert (verdict.action, verdict.why) == (
        "stop",
        "no longer admitted: short by 3.0 GiB (the layout still declares it)",
    )
    assert runtime_on_start(alive, None, None, slots.retire_why("gone")).why == "the layout no longer has this model"
