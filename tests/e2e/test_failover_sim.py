"""Failover end to end: real agents (subprocesses) on the simulator, a real nats-server, the promoter.

The faults are the simulator's own (`haru sim kill-runtime | detach-gpu | attach-gpu | fail-probe |
oom-on-wake`), so what the promoter sees is what the agent really observed.
"""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime

import pytest

from haru.core import subjects
from haru.core.events import OperationAborted, PromotionRequested, StepFailed, StepStarted
from haru.core.layout import load_layout
from haru.core.residency import Resident, Sleeping
from haru.log.apply import apply
from tests.support import haru
from tests.support.agent_harness import AgentProcess, agent_env, kill_agents, sim_fault, write_config, write_layout
from tests.support.promoter import op_events, promoters, route_moves, view_of, wait_until, wait_view

pytestmark = pytest.mark.timeout(120)
FLEET = "f"
POLICY = {
    # No test here silences an agent; a 2.5 s bound was crossed by a loaded 2-core machine's scheduling
    # alone (a 2.7 s gap), turning a GPU-detach failover into a heartbeat one.
    "heartbeat_timeout_ms": 6000,
    "degraded_grace_ms": 300,
    "restart_backoff_ms": 1500,
    "restart_backoff_max_ms": 3000,
    "command_timeout_ms": 10000,
    "training_grace_ms": 500,
}


STEP_DELAY_MS = 300


def now():
    return datetime.now(UTC)


def asleep_and_training(view, domain: str) -> bool:
    dv = view.domains[domain]
    return all(isinstance(m.residency, Sleeping) for m in dv.models.values()) and all(
        t.running for t in dv.training.values()
    )


def serving(view, domain: str) -> bool:
    return view.active == domain and all(
        isinstance(m.residency, Resident) for m in view.domains[domain].models.values()
    )


def steady(view, active: str) -> bool:
    standby = "b" if active == "a" else "a"
    return (
        view.operation is None
        and serving(view, active)
        and asleep_and_training(view, standby)
        and view.domains[standby].eligible
    )


@contextlib.asynccontextmanager
async def sim_agents(tmp_path, nats_server, event_log):
    """Two sim domains, declared, each with its agent (a real subprocess)."""
    layout_path = write_layout(
        tmp_path / "layout.json",
        tmp_path,
        models={"m1": {}, "m2": {"vram": "2GiB"}},
        training={"vram": "8GiB"},
        policy=POLICY,
        fleet=FLEET,
    )
    await apply(event_log, load_layout(layout_path), now())
    procs = []
    try:
        for d in ("a", "b"):
            cfg = write_config(
                tmp_path / f"agent-{d}.json", nats_server.url, tmp_path, domain=d, layout=layout_path, fleet=FLEET
            )
            procs.append(AgentProcess(cfg, tmp_path / f"agent-{d}.log", agent_env()))
        yield procs
    finally:
        kill_agents(procs)


@pytest.fixture
async def sim_fleet(tmp_path, nats_server, event_log):
    """Two sim domains with agents, declared, and a promoter; the first route settled (a active)."""
    async with sim_agents(tmp_path, nats_server, event_log):
        # A short delay before each step leaves room to inject a fault between two steps.
        async with promoters(nats_server.url, step_delay_ms=STEP_DELAY_MS):
            await wait_view(event_log, lambda v: steady(v, "a"), timeout=40, fleet=FLEET, what="first route, a active")
            yield event_log, tmp_path


def sim(tmp_path, *args: str) -> None:
    haru("sim", *args, "--sim-root", str(tmp_path / "sim"), check=True)


async def test_killing_the_active_runtime_promotes_the_standby_and_the_old_active_rejoins(sim_fleet):
    log, tmp = sim_fleet
    sim(tmp, "kill-runtime", "a", "m1")
    view = await wait_view(log, lambda v: steady(v, "b"), timeout=60, fleet=FLEET, what="b active, a standby again")
    assert [m.active for m in await route_moves(log, FLEET)] == ["a", "b"]
    promo = view.last_operation if view.last_operation.kind == "promotion" else None
    ops = await op_events(log, FLEET)
    reasons = [e.reason for e in ops if type(e).__name__ == "PromotionRequested"]
    # a fresh fleet: b never woke, so the promoter estimates its wake; whether a's measured cold reload
    # is slower than that (the faster path, at once) or not (degraded, after the 300 ms grace) is the
    # loaded machine's timing: both are the failover this test is about
    assert reasons[0] == "initial" and reasons[1:] in (["degraded"], ["faster_path"]), reasons
    assert promo is None or promo.state == "completed"


async def test_detaching_the_active_gpu_promotes_and_attach_makes_it_the_standby(sim_fleet):
    log, tmp = sim_fleet
    sim(tmp, "detach-gpu", "a")
    view = await wait_view(
        log,
        lambda v: v.active == "b" and v.operation is None and not v.domains["a"].eligible,
        timeout=40,
        fleet=FLEET,
        what="b active, a ineligible",
    )
    assert serving(view, "b")
    reasons = [e.reason for e in await op_events(log, FLEET) if type(e).__name__ == "PromotionRequested"]
    assert reasons[-1] == "gpu_detached"
    sim(tmp, "attach-gpu", "a")
    await wait_view(log, lambda v: steady(v, "b"), timeout=60, fleet=FLEET, what="a standby after attach-gpu")
    assert [m.active for m in await route_moves(log, FLEET)] == ["a", "b"]


async def _inject_when_started(log, step: str, fault: str) -> None:
    """Inject `fault` into b's m1 runtime as soon as `step` has started (before it runs)."""

    async def started():
        events = await op_events(log, FLEET)
        failover = [e.op_id for e in events if isinstance(e, PromotionRequested) and e.reason != "initial"]
        return bool(failover) and any(
            isinstance(e, StepStarted) and e.step == step and e.op_id == failover[0] for e in events
        )

    await wait_until(started, timeout=30, every=0.02, what=f"{step} started")
    await sim_fault(await _endpoint(log), fault)


async def _endpoint(log):
    for rec in reversed(await log.history(subjects.model(FLEET, "b", "m1"))):
        if getattr(rec.event, "endpoint", ""):
            return rec.event.endpoint
    raise AssertionError("no endpoint recorded for b/m1")


@pytest.mark.parametrize("fault, step", [("fail_probe", "probe"), ("oom_on_wake", "wake")])
async def test_a_standby_that_fails_before_the_flip_aborts_and_the_pointer_stays(sim_fleet, fault, step):
    log, tmp = sim_fleet
    sim(tmp, "kill-runtime", "a", "m1")
    await _inject_when_started(log, step, fault)

    async def aborted():
        return next((e for e in await op_events(log, FLEET) if isinstance(e, OperationAborted)), None)

    end = await wait_until(aborted, timeout=40, what="the aborted promotion")
    assert end.step == step, end
    failed = [e for e in await op_events(log, FLEET, end.op_id) if isinstance(e, StepFailed)]
    assert [f.step for f in failed] == [step]
    print("why:", failed[0].error_code, failed[0].error)
    assert failed[0].error
    assert [m.active for m in await route_moves(log, FLEET)] == ["a"]
    assert (await view_of(log, FLEET)).active == "a"


async def test_five_promoter_processes_racing_a_failure_move_the_route_once(tmp_path, nats_server, event_log):
    from tests.support.promoter import PromoterProcess

    async with sim_agents(tmp_path, nats_server, event_log):
        procs = [
            PromoterProcess(nats_server.url, f"promoter:race-{i}", log_path=tmp_path / f"promoter-{i}.log")
            for i in range(5)
        ]
        try:
            for p in procs:
                p.start()
            await wait_view(event_log, lambda v: steady(v, "a"), timeout=40, fleet=FLEET, what="first route, a active")
            sim(tmp_path, "kill-runtime", "a", "m1")
            await wait_view(event_log, lambda v: steady(v, "b"), timeout=60, fleet=FLEET, what="b active, a standby")
        finally:
            for p in procs:
                p.kill()
    assert [m.active for m in await route_moves(event_log, FLEET)] == ["a", "b"]
    ops = await op_events(event_log, FLEET)
    promotions = [e for e in ops if isinstance(e, PromotionRequested)]
    assert [p.reason for p in promotions] in (["initial", "degraded"], ["initial", "faster_path"])
    for op in promotions:
        started = [(e.step, e.attempt) for e in ops if isinstance(e, StepStarted) and e.op_id == op.op_id]
        assert len(started) == len(set(started)) == 6, started
    drivers = {e.by for e in ops if isinstance(e, StepStarted)}
    assert drivers <= {f"promoter:race-{i}" for i in range(5)}
