"""Promoters as real processes, SIGKILLed in the middle of each step.

`HARU_PROMOTER_STEP_DELAY_MS` makes every step last long enough to kill the promoter while it is
running it. After a restart (same --id) the operation completes or aborts cleanly, and the routing
pointer never points at a domain whose models were not probed in the operation that moved it.
"""

from __future__ import annotations

import asyncio

import pytest

from haru.core import subjects
from haru.core.events import OperationCompleted, PromotionRequested, RouteMoved, StepCompleted, StepStarted
from haru.core.saga import flow
from haru.log.apply import apply
from haru.log.eventlog import EventLog
from haru.log.requests import request_operation
from tests.support.clock import now
from tests.support.promoter import PromoterProcess, describe, op_events, view_of, wait_op_end
from tests.support.promoter_fake import FakeAgent, layout
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(90)
MODELS = ["m1", "m2"]
DELAY_MS = 400


async def assert_pointer_only_at_probed_domains(log: EventLog, fleet: str = "default") -> None:
    """Every route_moved points at the target of the operation that moved it, after that operation's probe."""
    records = await log.history(subjects.fleet_events(fleet))
    for rec in records:
        if not isinstance(rec.event, RouteMoved) or not rec.event.op_id:
            continue
        moved = rec.event
        before = [r.event for r in records if r.seq < rec.seq and getattr(r.event, "op_id", None) == moved.op_id]
        request = next(e for e in before if isinstance(e, PromotionRequested))
        assert request.target == moved.active
        assert any(isinstance(e, StepCompleted) and e.step == "probe" for e in before), (
            f"route moved to {moved.active} (seq {rec.seq}) without a completed probe in {moved.op_id}"
        )


@pytest.fixture
async def routed_fleet(nats_server, event_log):
    """a active (resident, routed), b standby (asleep): set up by hand, no promoter needed."""
    await apply(event_log, layout(), now())
    async with (
        FakeAgent(nats_server.url, "default", "a", MODELS) as a,
        FakeAgent(nats_server.url, "default", "b", MODELS, start="sleeping") as b,
    ):
        await event_log.append(subjects.route("default"), RouteMoved(at=now(), active="a"), expect=0)
        yield event_log, a, b


@pytest.fixture
def spawn(nats_server, tmp_path):
    procs: list[PromoterProcess] = []

    def make(identity: str) -> PromoterProcess:
        p = PromoterProcess(
            nats_server.url,
            identity,
            env={"HARU_PROMOTER_STEP_DELAY_MS": str(DELAY_MS)},
            log_path=tmp_path / f"{identity.replace(':', '_')}.log",
        )
        procs.append(p)
        return p

    try:
        yield make
    finally:
        for p in procs:
            p.kill()


async def _started(log, op_id: str, step: str):
    for e in await op_events(log, op_id=op_id):
        if isinstance(e, StepStarted) and e.step == step:
            return e
    return None


@pytest.mark.parametrize("step", flow("promotion"))
async def test_sigkill_at_each_step_then_restart_finishes_cleanly(routed_fleet, spawn, step):
    log, a, b = routed_fleet
    p = spawn("promoter:crash")
    p.start()
    accepted = await request_operation(log, "default", "promotion", "b", by="test", now=now())
    assert accepted.status == "accepted"
    await wait_until(lambda: _started(log, accepted.op_id, step), 20, what=f"step {step} started")
    p.kill()
    await assert_pointer_only_at_probed_domains(log)
    p.start()
    end = await wait_op_end(log, accepted.op_id, timeout=30)
    events = await op_events(log, op_id=accepted.op_id)
    assert isinstance(end, OperationCompleted), describe(events)
    # the killed step was re-run with the next attempt, every other step ran once
    restarted = [e for e in events if isinstance(e, StepStarted) and e.step == step]
    if step == "flip":
        # The route moved in the batch that started the flip (haru.promoter.chain): killed after it, the
        # restarted promoter reads the flip's outcome from the route, it does not move it again.
        assert [e.attempt for e in restarted] == [1], describe(events)
        flip = next(e for e in events if isinstance(e, StepCompleted) and e.step == "flip")
        assert "route moved to b" in flip.detail or "-> b" in flip.detail, describe(events)
    else:
        assert [e.attempt for e in restarted] == [1, 2], describe(events)
    await assert_pointer_only_at_probed_domains(log)
    moves = [r.event for r in await log.history(subjects.route("default"))]
    assert [m.active for m in moves] == ["a", "b"]
    view = await view_of(log)
    assert view.active == "b" and view.operation is None


async def test_another_replica_takes_over_a_dead_runners_step_after_its_lease(routed_fleet, spawn):
    log, a, b = routed_fleet
    one, two = spawn("promoter:one"), spawn("promoter:two")
    one.start()
    two.start()
    await asyncio.sleep(1.5)  # both caught up
    accepted = await request_operation(log, "default", "promotion", "b", by="test", now=now())
    started = await wait_until(lambda: _started(log, accepted.op_id, "wake"), 20, what="wake started")
    runner, other = (one, two) if started.by == "promoter:one" else (two, one)
    runner.kill()
    end = await wait_op_end(log, accepted.op_id, timeout=30)
    assert isinstance(end, OperationCompleted)
    events = await op_events(log, op_id=accepted.op_id)
    wakes = [e for e in events if isinstance(e, StepStarted) and e.step == "wake"]
    assert [(e.attempt, e.by) for e in wakes] == [(1, runner.identity), (2, other.identity)]
    await assert_pointer_only_at_probed_domains(log)
    assert (await view_of(log)).active == "b"


@pytest.fixture
async def long_leased_fleet(nats_server, event_log):
    """As routed_fleet, with the step bounds of a real fleet: a step's lease is minutes long."""
    await apply(event_log, layout(command_timeout_ms=60_000, wake_timeout_ms=120_000, probe_timeout_ms=120_000), now())
    async with (
        FakeAgent(nats_server.url, "default", "a", MODELS) as a,
        FakeAgent(nats_server.url, "default", "b", MODELS, start="sleeping") as b,
    ):
        await event_log.append(subjects.route("default"), RouteMoved(at=now(), active="a"), expect=0)
        yield event_log, a, b


@pytest.mark.parametrize("step", ["wake", "probe"])
async def test_a_replica_takes_over_a_killed_runners_step_when_it_falls_silent_not_after_the_lease(
    long_leased_fleet, spawn, step
):
    from haru.core.saga import lease_ms

    log, a, b = long_leased_fleet
    lease_s = lease_ms(step, (await view_of(log)).policy) / 1000
    assert lease_s > 120  # the bound below is well inside it: only the runner's silence can explain a takeover
    one, two = spawn("promoter:one"), spawn("promoter:two")
    one.start()
    two.start()
    await asyncio.sleep(1.5)  # both caught up and heard each other
    accepted = await request_operation(log, "default", "promotion", "b", by="test", now=now())
    started = await wait_until(lambda: _started(log, accepted.op_id, step), 20, what=f"{step} started")
    runner, other = (one, two) if started.by == "promoter:one" else (two, one)
    runner.kill()
    end = await wait_op_end(log, accepted.op_id, timeout=60)
    events = await op_events(log, op_id=accepted.op_id)
    assert isinstance(end, OperationCompleted), describe(events)
    restarted = [e for e in events if isinstance(e, StepStarted) and e.step == step]
    assert [(e.attempt, e.by) for e in restarted] == [(1, runner.identity), (2, other.identity)], describe(events)
    await assert_pointer_only_at_probed_domains(log)
    assert (await view_of(log)).active == "b"
