"""The fleet fold: given events, then the view. Pure, no I/O."""

from __future__ import annotations

import msgspec

from haru.core import events as ev
from haru.core import residency
from haru.core import subjects as sj
from haru.core.fold import HANDLED, empty, evolve, fold
from haru.core.sizes import GiB
from haru.core.specs import DomainSpec, GpuSpec, Policy
from haru.core.views import FleetView, view_decoder, view_encoder
from tests.support.fold import F, at, declarations


def run(items: list[tuple[str, ev.Event]], start: int = 1) -> FleetView:
    views = fold((start + i, subject, event) for i, (subject, event) in enumerate(items))
    return views[F]


def test_every_event_type_is_handled():
    assert HANDLED == set(ev.AnyEvent.__args__)


def test_declarations_keep_declaration_order_and_admission():
    view = run(declarations())
    assert list(view.domains) == ["a", "b"]
    a = view.domains["a"]
    assert list(a.models) == ["qwen3.6:27b", "llama-8b"]
    assert a.models["qwen3.6:27b"].admitted is True
    llama = a.models["llama-8b"]
    assert llama.admitted is False and llama.short_by_bytes == 4 * GiB
    assert llama.residency == residency.NotAdmitted(short_by_bytes=4 * GiB, since=at(0), seq=llama.residency.seq)
    assert a.training["lora"].admitted is True
    assert a.gpus[0].memory_bytes == 48 * GiB and a.gpus[0].present is None
    n = len(declarations())
    assert view.seq == n and view.decl_seq == n and view.op_seq == 0
    assert view.anomalies == 0


def test_redeclaring_a_domain_keeps_models_and_observations():
    items = declarations()
    items.append(
        (
            sj.gpu(F, "a", 0),
            ev.GpuObserved(
                at=at(1), domain="a", index=0, present=True, memory_total_bytes=48 * GiB, memory_used_bytes=GiB
            ),
        )
    )
    items.append(
        (
            sj.decl(F),
            ev.DomainChanged(
                at=at(2), spec=DomainSpec(name="a", region="eu", gpus=[GpuSpec(index=0, memory_bytes=40 * GiB)])
            ),
        )
    )
    a = run(items).domains["a"]
    assert a.region == "eu" and a.serving_url == ""
    assert list(a.models) == ["qwen3.6:27b", "llama-8b"]
    assert a.gpus[0].memory_bytes == 40 * GiB and a.gpus[0].present is True


def test_gpu_training_agent_liveness_eligibility():
    items = declarations()
    items += [
        (sj.gpu(F, "b", 0), ev.GpuObserved(at=at(1), domain="b", index=0, present=False, name="A6000")),
        (
            sj.gpu(F, "b", 1),
            ev.GpuObserved(
                at=at(1), domain="b", index=1, present=True, memory_total_bytes=GiB, processes=[ev.GpuProcess(pid=7)]
            ),
        ),
        (sj.training(F, "b", "lora"), ev.TrainingStarted(at=at(2), domain="b", slot="lora", pid=42, gpu_index=0)),
        (sj.agent(F, "b"), ev.AgentStarted(at=at(3), domain="b", host="gpu-b", pid=9, serving_url="http://b:9000")),
        (sj.liveness(F, "b"), ev.DomainUnreachable(at=at(4), domain="b", silent_ms=6000)),
        (sj.op(F), ev.EligibilityChanged(at=at(5), domain="b", eligible=False, why="GPU 0 detached")),
    ]
    b = run(items).domains["b"]
    assert [g.index for g in b.gpus] == [0, 1]
    assert b.gpus[0].present is False and b.gpus[0].observed_at == at(1)
    assert b.gpus[1].processes == [7] and b.gpus[1].memory_bytes == 0
    assert b.training["lora"].running and b.training["lora"].pid == 42
    assert b.agent.running and b.agent.host == "gpu-b" and b.agent.since == at(3)
    assert b.reachable is False and b.reachability_since == at(4)
    assert not b.eligible and b.ineligible_why == "GPU 0 detached"
    items += [
        (
            sj.training(F, "b", "lora"),
            ev.TrainingStopped(at=at(6), domain="b", slot="lora", how="killed", exit_code=-9),
        ),
        (sj.agent(F, "b"), ev.AgentStopping(at=at(7), domain="b", reason="sigterm")),
        (sj.liveness(F, "b"), ev.DomainReachable(at=at(8), domain="b")),
        (sj.op(F), ev.EligibilityChanged(at=at(9), domain="b", eligible=True)),
    ]
    b = run(items).domains["b"]
    t = b.training["lora"]
    assert not t.running and t.last_stop == "killed" and t.last_exit_code == -9 and t.since == at(6)
    assert not b.agent.running and b.agent.host == "gpu-b"
    assert b.reachable is True and b.eligible and b.ineligible_why == ""


def test_operation_steps_then_route_then_completion():
    items = declarations()
    n = len(items)
    items += [
        (sj.route(F), ev.RouteMoved(at=at(1), active="a")),
        (
            sj.op(F),
            ev.PromotionRequested(
                at=at(2), op_id="op1", target="b", source="a", reason="gpu_detached", route_revision=n + 1
            ),
        ),
        (sj.op(F), ev.StepStarted(at=at(3), op_id="op1", step="stop_training")),
        (sj.op(F), ev.StepCompleted(at=at(4), op_id="op1", step="stop_training", took_ms=900)),
        (sj.op(F), ev.StepStarted(at=at(5), op_id="op1", step="wake")),
        (sj.op(F), ev.StepFailed(at=at(6), op_id="op1", step="wake", error_code="oom", error="CUDA OOM")),
        (sj.op(F), ev.StepStarted(at=at(7), op_id="op1", step="wake", attempt=2)),
    ]
    view = run(items)
    assert view.active == "a" and view.route_revision == n + 1 and view.route_seq == n + 1
    op = view.operation
    assert op is not None and op.kind == "promotion" and op.target == "b" and op.seq == n + 2
    assert [(s.step, s.state, s.attempt) for s in op.steps] == [
        ("stop_training", "completed", 1),
        ("wake", "failed", 1),
        ("wake", "started", 2),
    ]
    assert op.steps[1].error_code == "oom"
    items += [
        (sj.op(F), ev.StepCompleted(at=at(8), op_id="op1", step="wake")),
        (sj.route(F), ev.RouteMoved(at=at(9), active="b", previous="a", op_id="op1")),
        (sj.op(F), ev.OperationCompleted(at=at(10), op_id="op1")),
    ]
    view = run(items)
    assert view.active == "b" and view.route_revision == len(items) - 1 and view.route_moved_at == at(9)
    assert view.operation is None
    assert view.last_operation.state == "completed" and view.last_operation.finished_at == at(10)
    assert view.op_seq == len(items)
    items += [
        (sj.op(F), ev.DemotionRequested(at=at(11), op_id="op2", target="a")),
        (sj.op(F), ev.OperationAborted(at=at(12), op_id="op2", step="sleep", error="agent gone")),
        (sj.op(F), ev.FailoverDeclined(at=at(13), domain="b", candidate="a", why="standby a unreachable")),
    ]
    view = run(items)
    assert view.operation is None and view.last_operation.op_id == "op2"
    assert view.last_operation.state == "aborted" and view.last_operation.error == "sleep: agent gone"
    assert view.declined == "standby a unreachable"


def test_events_about_undeclared_things_are_counted_not_folded():
    items = declarations()
    items += [
        (sj.model(F, "a", "ghost"), ev.ModelLoading(at=at(1), domain="a", model="ghost")),
        (sj.agent(F, "zz"), ev.AgentStarted(at=at(1), domain="zz")),
        (sj.training(F, "a", "nope"), ev.TrainingStarted(at=at(1), domain="a", slot="nope", pid=1, gpu_index=0)),
        (sj.op(F), ev.StepStarted(at=at(1), op_id="nope", step="wake")),
        (sj.decl(F), ev.ModelRetired(at=at(2), domain="a", model="llama-8b")),
        (sj.model(F, "a", "llama-8b"), ev.ModelStopped(at=at(3), domain="a", model="llama-8b")),
    ]
    view = run(items)
    assert "ghost" not in view.domains["a"].models
    assert "zz" not in view.domains
    assert list(view.domains["a"].models) == ["qwen3.6:27b"]  # retired, not resurrected by a late event
    assert view.anomalies == 5
    assert "llama-8b" in view.last_anomaly and f"seq {len(items)}" in view.last_anomaly
    assert view.seq == len(items)


def test_retiring_a_domain_and_slots():
    items = declarations()
    items += [
        (sj.decl(F), ev.TrainingRetired(at=at(1), domain="a", slot="lora")),
        (sj.decl(F), ev.DomainRetired(at=at(2), domain="b")),
    ]
    view = run(items)
    assert list(view.domains) == ["a"] and view.domains["a"].training == {}


def test_fold_skips_what_a_view_already_folded_and_separates_fleets():
    items = declarations()
    first = fold((i + 1, s, e) for i, (s, e) in enumerate(items))
    again = fold(((i + 1, s, e) for i, (s, e) in enumerate(items)), first)
    assert again == first
    other = fold(
        [(100, sj.decl("other"), ev.FleetDeclared(at=at(0), fleet="other", policy=Policy(auto_failover=False)))], first
    )
    assert set(other) == {F, "other"} and other[F] == first[F]
    assert other["other"].policy.auto_failover is False and other["other"].seq == 100
    assert fold([(5, "not.a.subject", ev.RouteMoved(at=at(0), active="a"))]) == {}


def test_residency_moves_and_illegal_transitions_are_lenient():
    items = declarations()
    m = "qwen3.6:27b"
    subject = sj.model(F, "a", m)
    items += [
        (subject, ev.ModelLoading(at=at(1), domain="a", model=m, pid=5)),
        (subject, ev.ModelResident(at=at(48), domain="a", model=m, warmup_ms=900)),
    ]
    view = run(items)
    state = view.domains["a"].models[m].residency
    assert isinstance(state, residency.Resident) and state.since == at(48) and state.seq == len(items)
    assert view.anomalies == 0
    items.append((subject, ev.ModelWaking(at=at(50), domain="a", model=m)))  # waking while resident
    view = run(items)
    state = view.domains["a"].models[m].residency
    assert state == residency.to_state(items[-1][1], seq=len(items))
    assert not residency.is_legal("resident", "model_waking")
    assert view.anomalies == 1 and "model_waking" in view.last_anomaly and f"seq {len(items)}" in view.last_anomaly


def test_evolve_stamps_seq_and_time_on_every_event():
    view = evolve(empty(F), ev.DomainReachable(at=at(3), domain="x"), seq=7, subject=sj.liveness(F, "x"))
    assert view.seq == 7 and view.updated_at == at(3) and view.decl_seq == 0


def test_view_survives_its_json_round_trip():
    view = run(declarations())
    assert view_decoder.decode(view_encoder.encode(view)) == view
    assert msgspec.json.decode(view_encoder.encode(view))["fleet"] == F


def test_an_invalid_body_is_counted_and_moves_the_checkpoint():
    from haru.core.fold import Folder, add_one

    views = fold((i + 1, s, e) for i, (s, e) in enumerate(declarations()))
    n = len(declarations())
    folders = {F: Folder(views[F])}
    folder = add_one(
        folders, None, seq=n + 1, subject=sj.model(F, "a", "x"), error="not a valid Haru event: Expected `object`"
    )
    assert folder is folders[F]
    out = folder.view()
    assert out.seq == n + 1 and out.anomalies == 1
    assert "skipped" in out.last_anomaly and "Expected `object`" in out.last_anomaly
    assert out.domains == fold((i + 1, s, e) for i, (s, e) in enumerate(declarations()))[F].domains
