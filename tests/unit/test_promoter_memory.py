"""The promoter's decisions and steps on the in-memory log and bus (haru/log/memory.py): the saga's logic
without a nats-server. The same fake agent (promoter_fake) answers on the bus instead of nats.micro.
What only a server shows (a NATS restart, a store that stops answering, a SIGKILLed process) stays in
tests/integration/test_promoter_saga.py, test_promoter_store_faults.py and test_promoter_crash.py."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime, timezone

import pytest

from haru.core.apply import apply
from haru.core.events import OperationAborted, PromotionRequested, StepCompleted, StepFailed, StepStarted
from haru.log.memory import MemoryLog
from haru.promoter.service import Promoter
from haru.host.tasks import cancel_and_wait
from tests.support.promoter_fake import FakeAgent, layout
from tests.support.promoter import assert_one_failover_each_step_once, routed_to_a, serving, op_events, route_moves, view_of, wait_until, wait_view

pytestmark = pytest.mark.timeout(60)
MODELS = ["m1", "m2"]


def now() -> datetime:
    return datetime.now(timezone.utc)


@pytest.fixture
async def fleet():
    log = MemoryLog(writer="test")
    await apply(log, layout(), now())
    async with FakeAgent(None, "default", "a", MODELS, log=log.connect("agent:default/a@fake")) as a, \
            FakeAgent(None, "default", "b", MODELS, log=log.connect("agent:default/b@fake")) as b:
        yield log, a, b


@contextlib.asynccontextmanager
async def promoters(log: MemoryLog, n: int = 1):
    """n promoter replicas on the one in-memory log, each its own client with its own identity."""
    replicas, tasks = [], []
    try:
        for i in range(n):
            p = Promoter(log.connect(f"promoter:test-{i}"), identity=f"promoter:test-{i}", tick_s=0.05)
            ready = asyncio.Event()
            replicas.append(p)
            tasks.append(asyncio.create_task(p.run(ready)))
            await asyncio.wait_for(ready.wait(), 10)
        yield replicas
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise AssertionError("a promoter replica died") from t.exception()
    finally:
        await cancel_and_wait(*tasks)


async def test_first_route_runs_every_step_of_the_saga_in_order(fleet):
    log, a, b = fleet
    async with promoters(log):
        view = await routed_to_a(log)
    assert serving(view, "a")
    assert [m.active for m in await route_moves(log)] == ["a"]
    ops = await op_events(log)
    first = next(e for e in ops if isinstance(e, PromotionRequested))
    assert (first.target, first.reason) == ("a", "initial")
    steps = [e.step for e in ops if isinstance(e, StepCompleted) and e.op_id == first.op_id]
    assert steps == ["stop_training", "verify_gpu", "wake", "probe", "flip", "settle_old_active"]
    assert [v for v, _ in b.calls] == ["sleep", "start_training"]
    # every outcome names the step_started it answers, and the replica that ran it
    started = {e.step: e for e in ops if isinstance(e, StepStarted) and e.op_id == first.op_id}
    assert all(e.by == "promoter:test-0" for e in started.values())


async def test_an_active_that_falls_silent_is_failed_over(fleet):
    log, a, b = fleet
    async with promoters(log):
        await routed_to_a(log)
        await a.unserve()  # the agent is gone: no heartbeats on the bus, nothing answers its verbs
        view = await wait_view(log, lambda v: v.active == "b" and v.operation is None and not v.domains["a"].eligible,
                               what="failover to b, a ineligible")
    assert serving(view, "b")
    promo = view.last_operation
    assert (promo.kind, promo.reason, promo.state) == ("promotion", "domain_unreachable", "completed")
    settle = [s for s in promo.steps if s.step == "settle_old_active"][-1]
    # a is unreachable, the very reason for the failover: settling it is skipped, with why, not failed
    assert settle.state == "skipped" and "a is unreachable (the reason for this operation)" in settle.detail
    assert [m.active for m in await route_moves(log)] == ["a", "b"]


@pytest.mark.parametrize("fault, step, code", [("fail_probe", "probe", "probe_failed"), ("oom_on_wake", "wake", "out_of_memory")])
async def test_a_failure_before_the_flip_aborts_and_routing_never_moves(fleet, fault, step, code):
    log, a, b = fleet
    async with promoters(log):
        await routed_to_a(log)
        setattr(b, fault, True)
        await a.unserve()

        async def aborted():
            return next((e for e in await op_events(log) if isinstance(e, OperationAborted)), None)

        abort = await wait_until(aborted, what="the abort")
        view = await view_of(log)
    failed = [e for e in await op_events(log, op_id=abort.op_id) if isinstance(e, StepFailed)]
    assert [(f.step, f.error_code) for f in failed] == [(step, code)]
    assert abort.step == step
    assert view.active == "a"
    assert [m.active for m in await route_moves(log)] == ["a"]


async def test_three_replicas_racing_one_failure_run_each_step_once(fleet):
    log, a, b = fleet
    async with promoters(log, 3):
        await routed_to_a(log)
        await a.unserve()
        await wait_view(log, lambda v: v.active == "b" and v.operation is None and not v.domains["a"].eligible, what="failover")
    await assert_one_failover_each_step_once(log, b)


async def test_after_a_lost_link_the_follower_replays_afresh_and_the_promoter_acts_again(fleet):
    """The log and the bus go away for longer than the heartbeat timeout (nothing can be appended,
    nothing heard) and come back: the promoter's follower replays from its position, the route has
    not moved, and a real failure afterwards is still failed over. (That a NATS restart is not taken
    for dead domains is shown against a real server: test_promoter_saga.py.)"""
    log, a, b = fleet
    async with promoters(log) as (promoter,):
        await routed_to_a(log)
        before = promoter.follower.restarts
        log.drop_link()
        await asyncio.sleep(1.5)  # longer than heartbeat_timeout_ms (800)
        log.restore_link()
        await wait_until(lambda: _async(promoter.follower.restarts > before), what="a fresh replay after the link came back")
        await asyncio.sleep(1.0)
        view = await view_of(log)
        assert view.active == "a" and view.domains["a"].eligible
        # and it still acts: the active's agent goes away for real
        await a.unserve()
        await wait_view(log, lambda v: v.active == "b" and v.operation is None, what="failover after the link came back")
    assert [m.active for m in await route_moves(log)] == ["a", "b"]


async def _async(value):
    return value
