"""Route intents as a pure function of the view: given events, then the intent."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.fold import fold
from haru.core.intents import at, changed, intent
from haru.core.residency import Answer
from haru.core.sizes import GiB
from haru.core.specs import DomainSpec, GpuSpec, ModelSpec, Policy
from haru.core.views import intent_decoder, view_encoder

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
F = "default"
Q = "qwen3.6:27b"
L = "llama-8b"
BIG = "gemma4:26b"


def t(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def base(serve_b: str = "agent") -> list[tuple[str, ev.Event]]:
    out: list[tuple[str, ev.Event]] = [(sj.decl(F), ev.FleetDeclared(at=t(0), fleet=F, policy=Policy()))]
    for d in ("a", "b"):
        spec = DomainSpec(
            name=d,
            serving_url=f"http://10.0.0.{1 if d == 'a' else 2}:9000" if d == "a" or serve_b == "agent" else "",
            serve="direct" if d == "b" else "agent",
            gpus=[GpuSpec(index=0, memory_bytes=48 * GiB, reserve_bytes=2 * GiB)],
        )
        out.append((sj.decl(F), ev.DomainDeclared(at=t(0), spec=spec)))
        for name, vram, port in ((Q, 20 * GiB, 8001), (L, 10 * GiB, 8002), (BIG, 30 * GiB, 8003)):
            out.append(
                (
                    sj.decl(F),
                    ev.ModelDeclared(
                        at=t(0),
                        domain=d,
                        spec=ModelSpec(name=name, slot=f"s{port}", gpu_index=0, vram_bytes=vram, port=port),
                    ),
                )
            )
        out += [
            (
                sj.decl(F),
                ev.AdmissionDecided(at=t(0), domain=d, name=Q, gpu_index=0, admitted=True, vram_bytes=20 * GiB),
            ),
            (
                sj.decl(F),
                ev.AdmissionDecided(at=t(0), domain=d, name=L, gpu_index=0, admitted=True, vram_bytes=10 * GiB),
            ),
            (
                sj.decl(F),
                ev.AdmissionDecided(
                    at=t(0),
                    domain=d,
                    name=BIG,
                    gpu_index=0,
                    admitted=False,
                    vram_bytes=30 * GiB,
                    short_by_bytes=14 * GiB,
                ),
            ),
        ]
    return out


def view_of(items):
    return fold((i + 1, s, e) for i, (s, e) in enumerate(items))[F]


def test_never_routed_fleet_has_no_active_and_no_answers():
    ri = intent(view_of(base()))
    assert ri.revision == 0 and ri.active is None and ri.standby is None and ri.answers == {}


def test_answers_for_every_model_on_the_active_domain():
    items = base()
    items += [
        (sj.route(F), ev.RouteMoved(at=t(1), active="a")),
        (sj.model(F, "a", Q), ev.ModelLoading(at=t(2), domain="a", model=Q)),
        (sj.model(F, "a", Q), ev.ModelResident(at=t(50), domain="a", model=Q, warmup_ms=800)),
        (sj.model(F, "a", L), ev.ModelLoading(at=t(60), domain="a", model=L)),
    ]
    view = view_of(items)
    ri = intent(view)
    assert ri.revision == len(base()) + 1 and ri.view_seq == len(items)
    assert ri.active.domain == "a" and ri.standby.domain == "b"
    assert ri.answers[Q] == Answer(answer="ready", since=t(50))
    assert ri.answers[L].answer == "warming" and ri.answers[L].for_ms == 0 and ri.answers[L].since == t(60)
    assert ri.answers[BIG] == Answer(answer="not_admitted", since=t(0), short_by_bytes=14 * GiB)
    assert list(ri.answers) == [Q, L, BIG]
    # for_ms is computed by whoever reads, at their clock.
    assert intent(view, t(107)).answers[L].for_ms == 47_000
    assert at(ri, t(107)).answers[L].for_ms == 47_000
    assert at(ri, t(107)).answers[Q] == ri.answers[Q]


def test_changed_ignores_view_seq_and_time_but_not_what_routers_act_on():
    items = base() + [(sj.route(F), ev.RouteMoved(at=t(1), active="a"))]
    items.append((sj.model(F, "a", L), ev.ModelLoading(at=t(2), domain="a", model=L)))
    first = intent(view_of(items))
    items.append((sj.gpu(F, "b", 0), ev.GpuObserved(at=t(3), domain="b", index=0, present=True, memory_used_bytes=GiB)))
    second = intent(view_of(items))
    assert second.view_seq > first.view_seq and not changed(first, second)
    items.append((sj.model(F, "a", L), ev.ModelResident(at=t(4), domain="a", model=L)))
    assert changed(second, intent(view_of(items)))
    assert changed(None, first)


def test_degraded_and_eligibility():
    items = base() + [(sj.route(F), ev.RouteMoved(at=t(1), active="a"))]
    items += [
        (sj.model(F, "a", Q), ev.ModelResident(at=t(2), domain="a", model=Q)),
        (sj.model(F, "a", L), ev.ModelResident(at=t(2), domain="a", model=L)),
        (sj.model(F, "a", L), ev.ModelLost(at=t(30), domain="a", model=L, reason="evicted")),
        (sj.model(F, "a", BIG), ev.ModelStopped(at=t(31), domain="a", model=BIG)),  # not admitted: not a loss
    ]
    ri = intent(view_of(items))
    assert ri.active.degraded and ri.active.degraded_since == t(30)
    assert not ri.active.eligible and "llama-8b lost: evicted" in ri.active.why
    assert ri.standby.eligible and not ri.standby.degraded and ri.standby.why == ""
    assert ri.answers[L] == Answer(answer="lost", since=t(30), reason="evicted")
    # gpu_detached is failure, not degradation.
    items.append((sj.model(F, "a", Q), ev.ModelLost(at=t(40), domain="a", model=Q, reason="gpu_detached")))
    items.append((sj.model(F, "a", L), ev.ModelResident(at=t(41), domain="a", model=L)))
    ri = intent(view_of(items))
    assert not ri.active.degraded and ri.active.degraded_since is None
    assert not ri.active.eligible and "gpu detached" in ri.active.why
    # The standby: unreachable, ineligible, GPU gone, each says why.
    items.append((sj.liveness(F, "b"), ev.DomainUnreachable(at=t(50), domain="b")))
    assert intent(view_of(items)).standby.why.startswith("domain unreachable")
    assert intent(view_of(items)).standby.reachable is False
    items.append((sj.liveness(F, "b"), ev.DomainReachable(at=t(51), domain="b")))
    items.append((sj.gpu(F, "b", 0), ev.GpuObserved(at=t(52), domain="b", index=0, present=False)))
    assert "GPU 0 not present" in intent(view_of(items)).standby.why
    items.append((sj.op(F), ev.EligibilityChanged(at=t(53), domain="b", eligible=False, why="agent gone")))
    assert intent(view_of(items)).standby.why == "agent gone"


def test_serve_direct_carries_model_urls_and_operation():
    items = base(serve_b="direct") + [(sj.route(F), ev.RouteMoved(at=t(1), active="b"))]
    items.append((sj.agent(F, "b"), ev.AgentStarted(at=t(1), domain="b", serving_url="http://10.0.0.2:9000")))
    items.append((sj.model(F, "b", Q), ev.ModelResident(at=t(2), domain="b", model=Q, endpoint="10.1.0.2:8001")))
    items.append((sj.op(F), ev.PromotionRequested(at=t(3), op_id="op-7", target="a", source="b")))
    ri = intent(view_of(items))
    assert ri.active.serve == "direct" and ri.active.serving_url == "http://10.0.0.2:9000"
    assert ri.active.model_urls == {Q: "http://10.1.0.2:8001", L: "http://10.0.0.2:8002"}  # BIG is not admitted
    assert ri.standby.model_urls == {}
    assert ri.operation == "op-7"


def test_intent_round_trips_and_is_deterministic():
    items = base() + [(sj.route(F), ev.RouteMoved(at=t(1), active="a"))]
    view = view_of(items)
    body = view_encoder.encode(intent(view))
    assert intent_decoder.decode(body) == intent(view)
    assert view_encoder.encode(intent(view_of(items))) == body
