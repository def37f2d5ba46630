"""The provisioning kinds in the decider: provision, teardown and replace as steps, the auto-replace
policy (off by default, budget per hour, cool-down after a failed launch) and a failed teardown that is
asked again rather than forgotten. Given events folded by the real fold, when decide, then appends."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from haru.core import subjects
from haru.core.events import (
    AdmissionDecided,
    DomainDeclared,
    DomainReachable,
    DomainUnreachable,
    EligibilityChanged,
    FleetDeclared,
    ModelDeclared,
    ModelResident,
    ModelSleeping,
    OperationAborted,
    OperationCompleted,
    ReplaceRequested,
    RouteMoved,
    StepCompleted,
    StepFailed,
    StepStarted,
    TeardownRequested,
)
from haru.core.fold import empty, evolve
from haru.core.requests import judge_request
from haru.core.saga import ABORT, COMPLETE, TRANSITIONS, flow
from haru.core.specs import DomainSpec, GpuSpec, ModelSpec, Policy, ProvisionSpec
from haru.promoter.decider import decide
from haru.promoter.decisions import Facts
from haru.promoter.failover import retry_ms

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
F = "default"
OP = subjects.op(F)
OFF = Policy(heartbeat_timeout_ms=1000, degraded_grace_ms=5000)
ON = Policy(
    heartbeat_timeout_ms=1000,
    degraded_grace_ms=5000,
    auto_replace=True,
    max_launches_per_hour=2,
    launch_cooldown_ms=60_000,
)


def at(ms: int) -> datetime:
    return T0 + timedelta(milliseconds=ms)


def given(*events, policy: Policy = ON, provider_a: str = "skypilot"):
    """Domains a (provider_a) and b (skyserve), model m on each; b active and serving, a failed over from."""
    view = empty(F)
    base = [(subjects.decl(F), FleetDeclared(at=T0, fleet=F, policy=policy))]
    for d, provider in (("a", provider_a), ("b", "skyserve")):
        provision = ProvisionSpec(nats_url="nats://cp:4222") if provider != "static" else None
        base.append(
            (
                subjects.decl(F),
                DomainDeclared(
                    at=T0,
                    spec=DomainSpec(
                        name=d, provider=provider, gpus=[GpuSpec(index=0, memory_bytes=24 << 30)], provision=provision
                    ),
                ),
            )
        )
        base.append(
            (subjects.decl(F), ModelDeclared(at=T0, domain=d, spec=ModelSpec(name="m", slot="chat", gpu_index=0)))
        )
        base.append(
            (subjects.decl(F), AdmissionDecided(at=T0, domain=d, name="m", gpu_index=0, admitted=True, vram_bytes=1))
        )
    base += [
        (subjects.liveness(F, "a"), DomainReachable(at=T0, domain="a")),
        (subjects.liveness(F, "b"), DomainReachable(at=T0, domain="b")),
        (subjects.model(F, "b", "m"), ModelResident(at=T0, domain="b", model="m")),
        (subjects.model(F, "a", "m"), ModelSleeping(at=T0, domain="a", model="m")),
        (subjects.route(F), RouteMoved(at=T0, active="b", op_id="op-failover")),
        (OP, EligibilityChanged(at=T0, domain="a", eligible=False, why="agent of a unreachable")),
        (subjects.liveness(F, "a"), DomainUnreachable(at=T0, domain="a", silent_ms=1500)),
    ]
    for seq, (subject, event) in enumerate([*base, *events], start=1):
        view = evolve(view, event, seq=seq, subject=subject)
    return view


def facts(ms: int = 10, **kw) -> Facts:
    kw.setdefault("silent_ms", {"a": 100, "b": 100})
    return Facts(now=at(ms), listening_ms=60_000, me="promoter:test", new_op_id="op-new", **kw)


def appended(view, f: Facts | None = None):
    out = [a.event for a in decide(view, f or facts()) if "liveness" not in a.subject]
    assert len(out) <= 1
    return out[0] if out else None


def test_the_kinds_flows_are_the_documented_ones():
    assert flow("provision") == ["launch", "join", "settle"]
    assert flow("teardown") == ["down"]
    assert flow("replace") == ["down", "launch", "join", "settle"]
    for kind in ("provision", "teardown", "replace"):
        for step in flow(kind):
            assert TRANSITIONS[(kind, step, "failed")] == (COMPLETE if step == "settle" else ABORT)


def test_auto_replace_is_off_by_default():
    assert Policy().auto_replace is False
    assert appended(given(policy=OFF)) is None


def test_a_failed_cloud_domain_is_replaced_when_the_policy_asks():
    event = appended(given())
    assert isinstance(event, ReplaceRequested)
    assert (event.target, event.reason, event.op_id) == ("a", "auto_replace", "op-new")
    assert "agent of a unreachable" in event.detail


def test_a_static_domain_is_never_replaced():
    assert appended(given(provider_a="static")) is None


def test_the_hourly_launch_budget_is_honoured():
    assert appended(given(), facts(launches_last_hour=2)) is None
    assert isinstance(appended(given(), facts(launches_last_hour=1)), ReplaceRequested)
    unlimited = Policy(heartbeat_timeout_ms=1000, degraded_grace_ms=5000, auto_replace=True)
    assert isinstance(appended(given(policy=unlimited), facts(launches_last_hour=99)), ReplaceRequested)


def failed_replace(ms: int = 1000):
    return [
        (OP, ReplaceRequested(at=at(0), op_id="op-r1", target="a", reason="auto_replace")),
        (OP, StepStarted(at=at(1), op_id="op-r1", step="down")),
        (OP, StepCompleted(at=at(2), op_id="op-r1", step="down", detail="tore down haru-default-a (region r1)")),
        (OP, StepStarted(at=at(3), op_id="op-r1", step="launch")),
        (OP, StepFailed(at=at(4), op_id="op-r1", step="launch", error_code="launch_failed", error="no capacity")),
        (OP, OperationAborted(at=at(ms), op_id="op-r1", step="launch", error="no capacity")),
    ]


def test_a_failed_launch_cools_down_before_the_next_automatic_replace():
    view = given(*failed_replace(ms=1000))
    assert appended(view, facts(ms=1000 + 59_000)) is None
    again = appended(view, facts(ms=1000 + 60_000))
    assert isinstance(again, ReplaceRequested) and again.target == "a"


def test_a_failed_teardown_is_asked_again_after_the_backoff_never_forgotten():
    view = given(
        (OP, TeardownRequested(at=at(0), op_id="op-t1", target="a")),
        (OP, StepStarted(at=at(1), op_id="op-t1", step="down")),
        (OP, StepFailed(at=at(2), op_id="op-t1", step="down", error_code="teardown_failed", error="cloud API error")),
        (OP, OperationAborted(at=at(3), op_id="op-t1", step="down", error="cloud API error")),
        policy=OFF,
    )
    assert appended(view, facts(ms=3 + retry_ms(OFF) - 1)) is None
    again = appended(view, facts(ms=3 + retry_ms(OFF)))
    assert isinstance(again, TeardownRequested)
    assert (again.target, again.reason) == ("a", "teardown_failed")
    assert "cloud API error" in again.detail


def test_a_replace_runs_its_steps_in_order_and_ends_with_the_domain_eligible():
    view = given((OP, ReplaceRequested(at=at(0), op_id="op-r", target="a")))
    started = appended(view)
    assert isinstance(started, StepStarted) and started.step == "down"
    events = [(OP, ReplaceRequested(at=at(0), op_id="op-r", target="a"))]
    for i, step in enumerate(flow("replace")):
        events += [
            (OP, StepStarted(at=at(i * 10 + 1), op_id="op-r", step=step)),
            (OP, StepCompleted(at=at(i * 10 + 2), op_id="op-r", step=step)),
        ]
        nxt = appended(given(*events))
        if i + 1 < len(flow("replace")):
            assert isinstance(nxt, StepStarted) and nxt.step == flow("replace")[i + 1]
    assert isinstance(nxt, EligibilityChanged) and nxt.eligible is True and nxt.domain == "a"
    events.append((OP, nxt))
    assert isinstance(appended(given(*events)), OperationCompleted)


def test_a_domain_the_operator_tore_down_is_not_replaced_automatically():
    from haru.core.saga import TORN_DOWN

    view = given((OP, EligibilityChanged(at=at(1), domain="a", eligible=False, why=TORN_DOWN)))
    assert appended(view) is None


def test_a_teardown_leaves_the_domain_ineligible():
    events = [
        (OP, EligibilityChanged(at=at(0), domain="a", eligible=True, why="x")),
        (OP, TeardownRequested(at=at(1), op_id="op-t", target="a")),
        (OP, StepStarted(at=at(2), op_id="op-t", step="down")),
        (OP, StepCompleted(at=at(3), op_id="op-t", step="down", detail="tore down haru-default-a")),
    ]
    nxt = appended(given(*events, policy=OFF))
    assert isinstance(nxt, EligibilityChanged) and nxt.eligible is False and "torn down" in nxt.why


def test_manual_requests_refuse_static_and_active_domains_and_join_one_in_flight():
    view = given(policy=OFF, provider_a="static")
    v = judge_request(view, "provision", "a", op_id="op-x", by="me", now=at(5))
    assert v.status == "refused" and "static" in v.message
    view = given(policy=OFF)
    v = judge_request(view, "teardown", "b", op_id="op-x", by="me", now=at(5))
    assert v.status == "refused" and "active domain" in v.message
    heard = given((subjects.liveness(F, "a"), DomainReachable(at=at(1), domain="a")), policy=OFF)
    v = judge_request(heard, "provision", "a", op_id="op-x", by="me", now=at(5))
    assert v.status == "noop" and "haru replace a" in v.message  # a's agent is heard: nothing to launch
    assert judge_request(view, "provision", "a", op_id="op-x", by="me", now=at(5)).status == "accepted"
    v = judge_request(view, "replace", "a", op_id="op-x", by="me", now=at(5))
    assert v.status == "accepted" and isinstance(v.event, ReplaceRequested)
    view = given((OP, v.event), policy=OFF)
    assert judge_request(view, "replace", "a", op_id="op-y", by="me", now=at(6)).status == "joined"
    assert judge_request(view, "teardown", "a", op_id="op-y", by="me", now=at(6)).status == "conflict"
