"""The promoter's saga, written once and run on both logs (tests/support/log_world.py: JetStream on
a real nats-server, and in memory), with in-test agents speaking the agent contract (promoter_fake).

Covers the saga end to end: the first route, auto-failover (unreachable, gpu_detached, degraded),
aborts before the flip (probe failure, wake out of memory) with the pointer unchanged, eligibility
and rejoining as standby, racing replicas, manual promote/demote with every status, and a lost link
that is not taken for dead domains. The CLI's scenario needs a server (the `haru` child process).
What else only a server shows (a store that stops answering, a SIGKILLed process) is in
test_promoter_store_faults.py and test_promoter_crash.py.
"""

from __future__ import annotations

import asyncio

import pytest

from haru.core import subjects
from haru.core.events import (
    EligibilityChanged,
    FailoverDeclined,
    OperationAborted,
    OperationCompleted,
    PromotionRequested,
    StepCompleted,
    StepFailed,
    StepStarted,
)
from haru.log.apply import apply
from haru.log.requests import request_operation
from tests.support.clock import now
from tests.support.promoter import (
    asleep_and_training,
    assert_one_failover_each_step_once,
    fake_agent,
    op_events,
    promoters,
    route_moves,
    routed_to_a,
    serving,
    view_of,
    wait_op_end,
    wait_view,
)
from tests.support.promoter_fake import FakeAgent, layout
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(60)
MODELS = ["m1", "m2"]


@pytest.fixture
async def fleet(world):
    """A declared two-domain fleet on either log, with a fake agent on each domain."""
    await apply(world.log, layout(), now())
    async with fake_agent(world, "a", MODELS) as a, fake_agent(world, "b", MODELS) as b:
        yield world.log, a, b


@pytest.fixture
async def server_fleet(nats_server, event_log):
    """The same fleet on a real nats-server only, for what needs one (the CLI as a child process)."""
    await apply(event_log, layout(), now())
    async with (
        FakeAgent(nats_server.url, "default", "a", MODELS) as a,
        FakeAgent(nats_server.url, "default", "b", MODELS) as b,
    ):
        yield event_log, a, b


# ------------------------------------------------------------------------------------ first route


async def test_first_route_promotes_the_first_declared_domain_through_the_saga(fleet, world):
    log, a, b = fleet
    async with promoters(world):
        view = await routed_to_a(log)
    assert serving(view, "a")
    assert [m.active for m in await route_moves(log)] == ["a"]
    ops = await op_events(log)
    first = next(e for e in ops if isinstance(e, PromotionRequested))
    assert (first.target, first.reason) == ("a", "initial")
    steps = [e.step for e in ops if isinstance(e, StepCompleted) and e.op_id == first.op_id]
    assert steps == ["stop_training", "verify_gpu", "wake", "probe", "flip", "settle_old_active"]
    assert [v for v, _ in b.calls] == ["sleep", "start_training"]
    # every step was started by the replica that ran it
    assert {e.by for e in ops if isinstance(e, StepStarted) and e.op_id == first.op_id} == {"promoter:test-0"}


# --------------------------------------------------------------------------------- auto-failover


async def test_unreachable_active_fails_over_then_rejoins_as_standby(fleet, world):
    log, a, b = fleet
    async with promoters(world):
        await routed_to_a(log)
        await a.unserve()  # the agent process is gone: no heartbeats, no responders
        view = await wait_view(
            log,
            lambda v: v.active == "b" and v.operation is None and not v.domains["a"].eligible,
            what="failover to b, a ineligible",
        )
        assert serving(view, "b")
        assert view.domains["a"].reachable is False
        assert "unreachable" in view.domains["a"].ineligible_why or "agent" in view.domains["a"].ineligible_why
        promo = view.last_operation
        assert (promo.kind, promo.reason, promo.state) == ("promotion", "domain_unreachable", "completed")
        settle = [s for s in promo.steps if s.step == "settle_old_active"][-1]
        # best effort that cannot apply, for the very reason of the failover: skipped, with why, not failed
        assert settle.state == "skipped" and "a is unreachable (the reason for this operation)" in settle.detail
        if world.url is not None:  # `haru op` (a child process, so on the server) words it the same way
            from tests.support import haru

            shown = await asyncio.to_thread(haru, "op", promo.op_id, nats_url=world.url)
            line = [ln for ln in shown.stdout.splitlines() if "settle_old_active" in ln][-1]  # its outcome
            assert line.split()[1] == "skipped" and "a is unreachable" in line, shown.stdout
        # the agent comes back (a restarted process: models reloaded, resident)
        async with fake_agent(world, "a", MODELS) as a2:
            view = await wait_view(
                log,
                lambda v: v.domains["a"].eligible and asleep_and_training(v, "a") and v.operation is None,
                what="a rejoins as standby",
            )
            assert view.active == "b"
            assert [v for v, _ in a2.calls] == ["sleep", "start_training"]
    assert [m.active for m in await route_moves(log)] == ["a", "b"]


async def test_gpu_detached_on_the_active_fails_over_and_attach_makes_it_standby(fleet, world):
    log, a, b = fleet
    async with promoters(world):
        await routed_to_a(log)
        await a.detach_gpu()
        view = await wait_view(
            log, lambda v: v.active == "b" and v.operation is None and not v.domains["a"].eligible, what="failover to b"
        )
        assert view.last_operation.reason == "gpu_detached"
        assert "GPU 0" in view.domains["a"].ineligible_why or "gpu" in view.domains["a"].ineligible_why.lower()
        # still ineligible a moment later: nothing demotes a domain whose GPU is gone
        await wait_until(lambda: _settled(log), 5)
        assert not (await view_of(log)).domains["a"].eligible
        await a.attach_gpu()
        view = await wait_view(
            log,
            lambda v: v.domains["a"].eligible and asleep_and_training(v, "a") and v.operation is None,
            what="a standby after attach",
        )
        assert view.active == "b" and serving(view, "b")
    assert [m.active for m in await route_moves(log)] == ["a", "b"]


async def _settled(log):
    v = await view_of(log)
    return v.operation is None


async def test_a_degraded_active_fails_over_after_the_grace(fleet, world):
    log, a, b = fleet
    async with promoters(world):
        await routed_to_a(log)
        await a.lose("m1", "process_exited")
        view = await wait_view(log, lambda v: v.active == "b" and v.operation is None, what="failover after grace")
        promo = view.last_operation
        assert promo.reason == "degraded" and "process_exited" in promo.detail
        lost_at = view.domains["a"].models["m1"].residency.since
        assert (promo.requested_at - lost_at).total_seconds() * 1000 >= view.policy.degraded_grace_ms


# ------------------------------------------------------------------------------- aborts


@pytest.mark.parametrize(
    "fault, step, code", [("fail_probe", "probe", "probe_failed"), ("oom_on_wake", "wake", "out_of_memory")]
)
async def test_a_failure_before_the_flip_aborts_and_routing_never_moves(fleet, world, fault, step, code):
    log, a, b = fleet
    async with promoters(world):
        await routed_to_a(log)
        setattr(b, fault, True)
        await a.unserve()
        aborted = await wait_until(lambda: _first(log, OperationAborted), 15.0, what="the abort")
        view = await view_of(log)
    failed = [e for e in await op_events(log, op_id=aborted.op_id) if isinstance(e, StepFailed)]
    assert [(f.step, f.error_code) for f in failed] == [(step, code)]
    assert (aborted.step, aborted.error) == (step, failed[0].error)  # the abort names the step and its error
    assert view.active == "a"
    assert [m.active for m in await route_moves(log)] == ["a"]


async def _first(log, kind):
    for e in await op_events(log):
        if isinstance(e, kind):
            return e
    return None


async def test_an_unfit_standby_is_declined_once_with_the_reason(fleet, world):
    log, a, b = fleet
    async with promoters(world):
        await routed_to_a(log)
        await b.lose("m2", "evicted")
        await a.unserve()
        declined = await wait_until(lambda: _first(log, FailoverDeclined), 15.0, what="failover_declined")
        assert declined.candidate == "b" and "m2" in declined.why and "lost" in declined.why
        await wait_until(lambda: _settled(log), 2)
        await asyncio.sleep(0.5)
    declines = [e for e in await op_events(log) if isinstance(e, FailoverDeclined)]
    assert len(declines) == 1
    assert [m.active for m in await route_moves(log)] == ["a"]


# ------------------------------------------------------------------------------- replicas


async def test_five_promoters_racing_one_failure_move_the_route_once(fleet, world):
    log, a, b = fleet
    async with promoters(world, 5):
        await routed_to_a(log)
        await a.unserve()
        await wait_view(
            log, lambda v: v.active == "b" and v.operation is None and not v.domains["a"].eligible, what="failover"
        )
    ops = await assert_one_failover_each_step_once(log, b)
    ends = [e for e in ops if isinstance(e, (OperationCompleted, OperationAborted))]
    assert len(ends) == len({e.op_id for e in ends})
    assert len([e for e in ops if isinstance(e, EligibilityChanged)]) == 1


# ------------------------------------------------------------------------------- manual


async def test_manual_promote_and_demote_every_status(fleet, world):
    log, a, b = fleet
    assert (await request_operation(log, "nope", "promotion", "a", by="t", now=now())).status == "not_found"
    assert (await request_operation(log, "default", "promotion", "zz", by="t", now=now())).status == "not_found"
    assert (await request_operation(log, "default", "promotion", "BAD", by="t", now=now())).status == "not_found"
    async with promoters(world, step_delay_ms=150):
        await routed_to_a(log)
        assert (await request_operation(log, "default", "promotion", "a", by="t", now=now())).status == "noop"
        refused = await request_operation(log, "default", "demotion", "a", by="t", now=now())
        assert refused.status == "refused" and "active" in refused.message
        accepted = await request_operation(log, "default", "promotion", "b", by="cli:t", now=now())
        assert accepted.status == "accepted" and accepted.op_id
        joined = await request_operation(log, "default", "promotion", "b", by="t", now=now())
        assert (joined.status, joined.op_id) == ("joined", accepted.op_id)
        conflict = await request_operation(log, "default", "demotion", "a", by="t", now=now())
        assert (conflict.status, conflict.op_id) == ("conflict", accepted.op_id)
        end = await wait_op_end(log, accepted.op_id)
        assert isinstance(end, OperationCompleted)
        view = await view_of(log)
        assert serving(view, "b") and asleep_and_training(view, "a")
        req = next(e for e in await op_events(log, op_id=accepted.op_id) if isinstance(e, PromotionRequested))
        assert req.by == "cli:t" and req.reason == "manual"
        # a standby can be demoted by hand (idempotent: asleep and training again)
        demoted = await request_operation(log, "default", "demotion", "a", by="t", now=now())
        assert demoted.status == "accepted"
        assert isinstance(await wait_op_end(log, demoted.op_id), OperationCompleted)
    assert [m.active for m in await route_moves(log)] == ["a", "b"]


# ------------------------------------------------------------------------------------ the CLI


async def test_the_cli_prints_the_op_id_waits_for_the_steps_and_exits_by_status(server_fleet, nats_server):
    import json

    from haru.cli.common import ExitStatus
    from tests.support import haru

    log, a, b = server_fleet

    def cli(*args):
        return asyncio.to_thread(haru, *args, nats_url=nats_server.url)

    missing = await cli("promote", "zz")
    assert missing.returncode == ExitStatus.NOT_FOUND and "no domain 'zz'" in missing.stderr
    # The demotion below is held at its sleep while two CLI processes start (~1 s each, more on a loaded
    # machine): the command bound must outlast them, or the held step fails before they ask.
    await apply(log, layout(command_timeout_ms=20_000), now())
    async with promoters(nats_server.url, step_delay_ms=100):
        await routed_to_a(log)
        noop = await cli("promote", "a")
        assert noop.returncode == ExitStatus.OK and "already active" in noop.stdout
        refused = await cli("demote", "a", "--json")
        assert refused.returncode == ExitStatus.ERROR and json.loads(refused.stdout)["status"] == "refused"
        waited = await cli("promote", "b", "--wait")
        assert waited.returncode == ExitStatus.OK, waited.stderr
        assert "unreachable" not in waited.stderr, "a clean exit is not the control plane going away"
        lines = waited.stdout.splitlines()
        op_id = lines[0]
        assert op_id.startswith("op-")
        assert [ln.split()[0] for ln in lines[1:]] == [
            "requested",
            "stop_training",
            "verify_gpu",
            "wake",
            "probe",
            "flip",
            "settle_old_active",
            "completed",
        ]
        assert isinstance(await wait_op_end(log, op_id), OperationCompleted)
        # another operation in flight -> conflict (exit 4), printing the op in the way
        a.hold["sleep"] = asyncio.Event()  # the demotion stays in flight until released
        accepted = await request_operation(log, "default", "demotion", "a", by="t", now=now())
        conflict = await cli("promote", "a")
        assert conflict.returncode == ExitStatus.CONFLICT and conflict.stdout.strip() == accepted.op_id
        joined = await cli("demote", "a", "--json")
        assert joined.returncode == ExitStatus.OK and json.loads(joined.stdout) == {
            "status": "joined",
            "op_id": accepted.op_id,
            "message": json.loads(joined.stdout)["message"],
        }
        a.hold.pop("sleep").set()
        await wait_op_end(log, accepted.op_id)
        listed = await cli("op")
        assert listed.returncode == ExitStatus.OK
        assert [ln.split()[0] for ln in listed.stdout.splitlines()][-2:] == [op_id, accepted.op_id]
        shown = await cli("op", op_id)
        assert "promotion of b (manual" in shown.stdout and "settle_old_active" in shown.stdout
        assert (await cli("op", "op-nope")).returncode == ExitStatus.NOT_FOUND
    # --wait on an aborted operation exits 1 and says where it stopped
    a.fail_probe = True
    async with promoters(nats_server.url):
        aborted = await cli("promote", "a", "--wait")
    assert aborted.returncode == ExitStatus.ERROR
    assert "aborted" in aborted.stdout and "probe" in aborted.stdout and "routing did not move" in aborted.stdout


async def test_a_lost_link_is_not_mistaken_for_dead_domains_and_the_promoter_acts_again(fleet, world):
    """The log and the bus go away for longer than the heartbeat timeout (a NATS restart; in memory,
    a dropped link): nobody heard anybody, yet no domain is declared unreachable, the promoter's
    follower replays afresh from its position, and the promoter still acts."""
    log, a, b = fleet
    async with promoters(world) as (promoter,):
        await routed_to_a(log)
        before, restarts = await log.last_seq(), promoter.follower.restarts
        await world.drop_link(1.5)  # longer than heartbeat_timeout_ms (800)
        await wait_until(
            lambda: _value(promoter.follower.restarts > restarts), 15.0, what="a fresh replay after the link came back"
        )
        await asyncio.sleep(1.0)
        view = await view_of(log)
        assert view.active == "a" and view.domains["a"].eligible
        # the promoter still works after the link came back: a manual promotion goes through
        accepted = await wait_until(lambda: _request(log, "b"), 10, what="a request after the link came back")
        assert isinstance(await wait_op_end(log, accepted.op_id), OperationCompleted)
    recs = await log.history(subjects.fleet_events("default"), from_seq=before + 1)
    assert not [r for r in recs if type(r.event).__name__ == "DomainUnreachable"], [
        type(r.event).__name__ for r in recs
    ]
    assert [m.active for m in await route_moves(log)] == ["a", "b"]


async def _value(value):
    return value


async def _request(log, target):
    try:
        res = await request_operation(log, "default", "promotion", target, by="t", now=now())
    except Exception:  # the test's own connection may still be reconnecting
        return None
    return res if res.status == "accepted" else None
