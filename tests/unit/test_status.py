"""`haru status` rendering: hearth's lines, from a folded view."""

from __future__ import annotations

from datetime import timedelta

from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.fold import fold
from haru.projections.status import render
from tests.support.status import NOW, F, hearth_fleet


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
