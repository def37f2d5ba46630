"""Fleets of three and four domains, driven by the real promoter on both logs (JetStream on a real
nats-server, and in memory) with in-test agents (promoter_fake): auto-failover onto the best fit
standby when the first-ranked one is dead, the cascade from a standby that fails before the flip to
the next within the same operation, the unprotected state after a failover, and the old active
rejoining as the lowest-ranked standby with no operator."""

from __future__ import annotations

import contextlib

import pytest

from haru.core import ranking, subjects
from haru.core.events import OperationCompleted, PromotionRequested, PromotionRetargeted, StepFailed, StepStarted
from haru.core.intents import intent
from haru.core.operations import fold_operations
from haru.log.apply import apply
from tests.support.clock import now
from tests.support.promoter import (
    asleep_and_training,
    fake_agent,
    op_events,
    promoters,
    route_moves,
    serving,
    wait_view,
)
from tests.support.promoter_fake import layout

pytestmark = pytest.mark.timeout(90)
MODELS = ["m1", "m2"]


@contextlib.asynccontextmanager
async def fleet_of(world, names: str):
    await apply(world.log, layout(domains=names), now())
    async with contextlib.AsyncExitStack() as stack:
        agents = {d: await stack.enter_async_context(fake_agent(world, d, MODELS)) for d in names}
        yield world.log, agents


async def failover(log):
    """The failover promotion (the one after the first route), as `haru op` folds it."""
    ops = [
        op
        for op in fold_operations(await log.history(subjects.op("default")))
        if op.kind == "promotion" and op.reason != "initial"
    ]
    assert len(ops) == 1, ops
    return ops[0]


async def routed(log, names: str):
    """The first route (to a), every standby asleep and training."""
    return await wait_view(
        log,
        lambda v: v.active == names[0] and v.operation is None and all(asleep_and_training(v, d) for d in names[1:]),
        timeout=30,
        what=f"first route to {names[0]}, {', '.join(names[1:])} asleep and training",
    )


async def test_the_first_ranked_standby_dead_the_failover_goes_to_the_second(world):
    async with fleet_of(world, "abc") as (log, agents), promoters(world):
        view = await routed(log, "abc")
        assert [r.domain for r in ranking.rank(view)] == ["b", "c"]
        await agents["b"].unserve()  # the first-ranked standby is gone
        await wait_view(log, lambda v: v.domains["b"].reachable is False, what="b unreachable")
        await agents["a"].unserve()  # then the active
        view = await wait_view(log, lambda v: v.active == "c" and v.operation is None, timeout=30, what="failover to c")
        assert serving(view, "c")
        promo = await failover(log)
        assert (promo.target, promo.state, promo.tried) == ("c", "completed", ())
        # both others are gone: the fleet is unprotected, and says so
        assert ranking.protection(view) == "unprotected"
        ri = intent(view)
        assert ri.protection == "unprotected" and [r.fit for r in ri.standbys] == [False, False]
        # a comes back (a restarted host): it rejoins asleep and training, with no operator, and protects the fleet
        async with fake_agent(world, "a", MODELS) as a2:
            view = await wait_view(
                log,
                lambda v: v.domains["a"].eligible and asleep_and_training(v, "a") and v.operation is None,
                timeout=30,
                what="a rejoins as a standby",
            )
            assert ranking.protection(view) == "protected"
            assert [v for v, _ in a2.calls] == ["sleep", "start_training"]
            # then b comes back too: a, which lost the active role, ranks last
            async with fake_agent(world, "b", MODELS):
                view = await wait_view(
                    log,
                    lambda v: asleep_and_training(v, "b") and v.domains["b"].reachable and v.operation is None,
                    timeout=30,
                    what="b back as a standby",
                )
                assert [(r.domain, r.fit) for r in ranking.rank(view)] == [("b", True), ("a", True)]
    assert [m.active for m in await route_moves(log)] == ["a", "c"]


async def test_a_standby_failing_its_wake_hands_over_to_the_next_within_the_same_operation(world):
    async with fleet_of(world, "abc") as (log, agents), promoters(world):
        await routed(log, "abc")
        agents["b"].oom_on_wake = True  # b's wake runs out of memory: a failure before the flip
        await agents["a"].unserve()
        view = await wait_view(log, lambda v: v.active == "c" and v.operation is None, timeout=30, what="failover to c")
        assert serving(view, "c")
        promo = await failover(log)
        assert (promo.target, promo.state, promo.tried) == ("c", "completed", ("b",))
        # every attempt is in the operation's record, each step on the domain it acted on
        assert [(s.domain, s.step, s.state) for s in promo.steps][:4] == [
            ("b", "stop_training", "completed"),
            ("b", "verify_gpu", "completed"),
            ("b", "wake", "failed"),
            ("c", "stop_training", "completed"),
        ]
        ops = await op_events(log, op_id=promo.op_id)
        requests = [e for e in ops if isinstance(e, PromotionRequested)]
        assert len(requests) == 1 and requests[0].target == "b" and requests[0].cascade
        [moved] = [e for e in ops if isinstance(e, PromotionRetargeted)]
        assert (moved.previous, moved.target, moved.step) == (
            "b",
            "c",
            "wake",
        ) and "out of memory" in moved.error.lower()
        failed = [e for e in ops if isinstance(e, StepFailed)]
        assert [f.step for f in failed] == ["wake"]
        assert any(isinstance(e, OperationCompleted) for e in ops)
        # c was driven through the whole saga after the move; b's awake models are put back to sleep
        after = ops[ops.index(moved) + 1 :]
        assert [e.step for e in after if isinstance(e, StepStarted)][:4] == [
            "stop_training",
            "verify_gpu",
            "wake",
            "probe",
        ]
        agents["b"].oom_on_wake = False
    assert [m.active for m in await route_moves(log)] == ["a", "c"]


async def test_four_domains_cascade_past_two_failed_standbys_to_the_third(world):
    async with fleet_of(world, "abcd") as (log, agents), promoters(world):
        await routed(log, "abcd")
        agents["b"].oom_on_wake = True
        agents["c"].fail_probe = True
        await agents["a"].unserve()
        view = await wait_view(log, lambda v: v.active == "d" and v.operation is None, timeout=40, what="failover to d")
        promo = await failover(log)
        assert promo.tried == ("b", "c") and promo.target == "d"
        assert promo.state == "completed" and serving(view, "d")
        assert [s.domain for s in promo.steps if s.state == "failed"] == ["b", "c"]
        ops = await op_events(log, op_id=promo.op_id)
        assert [(e.previous, e.target) for e in ops if isinstance(e, PromotionRetargeted)] == [("b", "c"), ("c", "d")]
    assert [m.active for m in await route_moves(log)] == ["a", "d"]


async def test_haru_promote_without_a_target_takes_the_best_fit_standby_and_cascades(world):
    import asyncio

    from haru.log.requests import request_operation
    from tests.support import haru

    async with fleet_of(world, "abcd") as (log, agents), promoters(world):
        await routed(log, "abcd")
        await agents["b"].unserve()  # the first-ranked standby is gone: c is the best fit one
        await wait_view(log, lambda v: v.domains["b"].reachable is False, what="b unreachable")
        agents["c"].fail_probe = True  # and c fails its probe: the promotion moves on to d
        if world.url is not None:  # the CLI, as an operator types it, on the server
            done = await asyncio.to_thread(haru, "promote", "--wait", nats_url=world.url, timeout=60)
            assert done.returncode == 0, done.stdout + done.stderr
            assert "moved on   c failed probe" in done.stdout and "trying d" in done.stdout
            shown = await asyncio.to_thread(haru, "op", (await failover_any(log)).op_id, nats_url=world.url)
            assert "tried first: c" in shown.stdout and "[d]" in shown.stdout, shown.stdout
        else:
            result = await request_operation(log, "default", "promotion", "", by="test", now=now())
            assert result.status == "accepted", result.message
        view = await wait_view(log, lambda v: v.active == "d" and v.operation is None, timeout=30, what="promoted d")
        promo = await failover_any(log)
        assert (promo.reason, promo.target, promo.tried) == ("manual", "d", ("c",))
    assert [m.active for m in await route_moves(log)] == ["a", "d"]
    assert serving(view, "d")


async def failover_any(log):
    ops = [
        op
        for op in fold_operations(await log.history(subjects.op("default")))
        if op.kind == "promotion" and op.reason != "initial"
    ]
    return ops[-1]
