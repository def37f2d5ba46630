"""`haru status` rendering: hearth's lines, from a folded view."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.fold import fold
from haru.core.sizes import GiB
from haru.core.specs import DomainSpec, GpuSpec, ModelSpec, Policy, TrainingSpec
from haru.projections.status import render

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
F = "default"
NOW = T0 + timedelta(seconds=20000)

HEARTH = [
    ("muse-local:latest", 20 * GiB, True, 0),
    ("deepseek-r1:32b", 22 * GiB, True, 0),
    ("gemma4:26b", 17 * GiB, False, int(14.8 * GiB)),
    ("qwen3.6:27b", 18 * GiB, False, int(15.8 * GiB)),
    ("gemma4-extract:31b", 20 * GiB, False, int(17.8 * GiB)),
]


def t(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def hearth_fleet() -> list[tuple[str, ev.Event]]:
    d = sj.decl(F)
    items: list[tuple[str, ev.Event]] = [(d, ev.FleetDeclared(at=t(0), fleet=F, policy=Policy()))]
    for dom in ("a", "b"):
        gpu = GpuSpec(index=0, memory_bytes=48 * GiB, reserve_bytes=int(3.8 * GiB), name="RTX A6000")
        items.append(
            (d, ev.DomainDeclared(at=t(0), spec=DomainSpec(name=dom, serving_url=f"http://{dom}:9000", gpus=[gpu])))
        )
        for name, vram, ok, short in HEARTH:
            items.append(
                (
                    d,
                    ev.ModelDeclared(
                        at=t(0), domain=dom, spec=ModelSpec(name=name, slot="s", gpu_index=0, vram_bytes=vram)
                    ),
                )
            )
            items.append(
                (
                    d,
                    ev.AdmissionDecided(
                        at=t(0), domain=dom, name=name, gpu_index=0, admitted=ok, vram_bytes=vram, short_by_bytes=short
                    ),
                )
            )
        items.append(
            (
                d,
                ev.TrainingDeclared(
                    at=t(0), domain=dom, spec=TrainingSpec(slot="lora", gpu_index=0, command=["t"], checkpoint_dir="/c")
                ),
            )
        )
    items += [
        (sj.route(F), ev.RouteMoved(at=t(1), active="a")),
        (sj.agent(F, "a"), ev.AgentStarted(at=t(1), domain="a", host="gpu-a")),
        (sj.liveness(F, "a"), ev.DomainReachable(at=t(1), domain="a")),
        (
            sj.model(F, "a", "muse-local:latest"),
            ev.ModelResident(at=NOW - timedelta(seconds=14203), domain="a", model="muse-local:latest"),
        ),
        (
            sj.model(F, "a", "deepseek-r1:32b"),
            ev.ModelLoading(at=NOW - timedelta(seconds=47), domain="a", model="deepseek-r1:32b"),
        ),
        (sj.model(F, "b", "muse-local:latest"), ev.ModelSleeping(at=t(5), domain="b", model="muse-local:latest")),
        (
            sj.model(F, "b", "deepseek-r1:32b"),
            ev.ModelLost(at=t(6), domain="b", model="deepseek-r1:32b", reason="gpu_detached"),
        ),
        (sj.gpu(F, "b", 0), ev.GpuObserved(at=t(6), domain="b", index=0, present=False)),
        (
            sj.training(F, "b", "lora"),
            ev.TrainingStarted(at=NOW - timedelta(seconds=300), domain="b", slot="lora", pid=4242, gpu_index=0),
        ),
    ]
    return items


def view():
    return fold((i + 1, s, e) for i, (s, e) in enumerate(hearth_fleet()))[F]


def test_hearth_lines_per_gpu_and_model():
    text = render(view(), NOW)
    lines = text.splitlines()
    assert "  GPU 0 (RTX A6000): 42.0 / 44.2 GiB held  (5 declared, 2 admitted)" in lines
    assert "    muse-local:latest            resident for 14203s" in lines
    assert "    deepseek-r1:32b              loading for 47s" in lines
    assert "    gemma4:26b                   not admitted — short by 14.8 GiB" in lines
    assert "    qwen3.6:27b                  not admitted — short by 15.8 GiB" in lines
    assert "    gemma4-extract:31b           not admitted — short by 17.8 GiB" in lines
    # The standby: asleep, lost to the provider, training running, GPU gone.
    assert "    muse-local:latest            asleep" in lines
    assert "    deepseek-r1:32b              lost: gpu detached (provider)" in lines
    assert "  training lora (GPU 0)          running for 300s (pid 4242)" in lines
    assert any("NOT PRESENT" in line for line in lines)


def test_active_domain_and_route_revision_are_marked():
    v = view()
    lines = render(v, NOW).splitlines()
    assert lines[0].startswith(f"fleet {F}  ·  route revision {v.route_revision} → a")
    a = next(line for line in lines if line.startswith("a  "))
    assert f"◀ active (route revision {v.route_revision})" in a and "agent up on gpu-a" in a and "reachable" in a
    b = next(line for line in lines if line.startswith("b  "))
    assert "(standby)" in b and "no agent yet" in b


def test_a_domains_failure_signal_shows_while_it_lasts():
    def header(items, domain: str = "a") -> str:
        lines = render(fold((i + 1, s, e) for i, (s, e) in enumerate(items))[F], NOW).splitlines()
        return next(line for line in lines if line.startswith(f"{domain}  "))

    signalled = [
        *hearth_fleet(),
        (
            sj.agent(F, "a"),
            ev.FailureSignalled(
                at=NOW - timedelta(seconds=4), domain="a", source="preemption_notice", detail="terminate in 120 s"
            ),
        ),
    ]
    assert "ABOUT TO GO (signalled 4s ago): preemption_notice: terminate in 120 s" in header(signalled)
    assert "ABOUT TO GO" not in header(signalled, "b")
    xid = [
        *hearth_fleet(),
        (
            sj.agent(F, "a"),
            ev.FailureSignalled(at=NOW, domain="a", source="xid", gpu_index=0, detail="GPU 0: critical XID 79"),
        ),
    ]
    assert "ABOUT TO GO (signalled 0s ago): xid: GPU 0: critical XID 79" in header(xid)
    # it lasts until the agent starts again (an agent that still sees the sign records it again)
    restarted = [*signalled, (sj.agent(F, "a"), ev.AgentStarted(at=NOW, domain="a", host="gpu-a"))]
    assert "ABOUT TO GO" not in header(restarted)
    assert "ABOUT TO GO" not in header(hearth_fleet())


def test_operation_in_flight_and_finished_and_anomalies():
    items = hearth_fleet() + [
        (
            sj.op(F),
            ev.PromotionRequested(
                at=NOW - timedelta(seconds=3), op_id="op-1", target="b", source="a", reason="gpu_detached"
            ),
        ),
        (sj.op(F), ev.StepStarted(at=NOW, op_id="op-1", step="stop_training")),
        (sj.model(F, "a", "ghost"), ev.ModelLoading(at=NOW, domain="a", model="ghost")),
    ]
    v = fold((i + 1, s, e) for i, (s, e) in enumerate(items))[F]
    text = render(v, NOW)
    assert "operation in flight: promotion of b over a (op-1, gpu_detached), running for 3s" in text
    assert "steps: stop_training started" in text
    assert "anomalies in the log: 1" in text and "ghost" in text
    items.append((sj.op(F), ev.OperationAborted(at=NOW, op_id="op-1", step="wake", error="CUDA OOM")))
    v = fold((i + 1, s, e) for i, (s, e) in enumerate(items))[F]
    text = render(v, NOW)
    assert "operation in flight" not in text
    assert "last operation: promotion of b over a (op-1, gpu_detached): aborted 0s ago — wake: CUDA OOM" in text


def test_an_empty_fleet_says_what_to_do():
    from haru.core.views import FleetView

    text = render(FleetView(fleet="x"), NOW)
    assert "not routed yet" in text and "haru apply" in text


def test_route_intent_in_words():
    from haru.core.intents import intent
    from haru.projections.status import render_intent

    text = render_intent(intent(view()), NOW)
    lines = text.splitlines()
    assert lines[0].startswith("fleet default  ·  route revision 26 → a")
    assert lines[1].startswith("active   a  http://a:9000") and lines[1].endswith("eligible")
    assert lines[2].startswith("standby  b") and "not eligible: GPU 0 not present" in lines[2]
    assert "  muse-local:latest            ready" in lines
    assert "  deepseek-r1:32b              warming for 47s" in lines
    assert "  gemma4:26b                   not admitted — short by 14.8 GiB" in lines
