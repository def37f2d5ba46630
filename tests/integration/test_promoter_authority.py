"""The promoter obeys the subject, and its flip cannot be wedged. Real nats-server, in-process
promoters, in-test agents (promoter_fake).

- A `route_moved` an agent stores on its own subject moves nothing; the next genuine promotion
  flips the route.
- Something on the route subject that is not a route move (a body that does not decode, a
  misplaced event) does not make every later flip abort: the flip expects the route subject's
  real last sequence.
- The production writers (apply, the promoter, the control API's `request_operation`) only ever
  append events the table allows on the subjects they write, as the roles the table names.
"""

from __future__ import annotations

import contextlib

import pytest

from haru.core import authority, subjects
from haru.core.errors import Conflict
from haru.core.events import (
    ModelLost,
    OperationAborted,
    OperationCompleted,
    RouteMoved,
    StepCompleted,
    StepFailed,
    StepStarted,
)
from haru.log.apply import apply
from haru.log.eventlog import EventLog
from haru.log.history import misplaced_records
from haru.log.requests import request_operation
from tests.support.clock import now
from tests.support.promoter import op_events, promoters, route_moves, view_of, wait_op_end, wait_view
from tests.support.promoter_fake import FakeAgent, layout

pytestmark = pytest.mark.timeout(60)
MODELS = ["m1", "m2"]


@pytest.fixture
async def fleet(nats_server, event_log):
    await apply(event_log, layout(), now())
    async with (
        FakeAgent(nats_server.url, "default", "a", MODELS) as a,
        FakeAgent(nats_server.url, "default", "b", MODELS) as b,
    ):
        yield event_log, a, b


async def routed_to_a(log):
    return await wait_view(
        log,
        lambda v: (
            v.active == "a"
            and v.operation is None
            and v.last_operation is not None
            and v.last_operation.state == "completed"
        ),
        what="first route to a",
    )


@contextlib.asynccontextmanager
async def promotion_requested_by_the_gateway(log, nats_server):
    """Promoters (slowed, so a forger can write between steps) routing to a, and a promotion of b that
    the gateway's credentials requested, under way: (the gateway's log, the accepted request)."""
    async with (
        promoters(nats_server.url, step_delay_ms=300),
        EventLog.connect([nats_server.url], writer="gateway:127.0.0.1:0") as gateway,
    ):
        await routed_to_a(log)
        accepted = await request_operation(gateway, "default", "promotion", "b", by=gateway.writer, now=now())
        assert accepted.status == "accepted"
        await wait_view(log, lambda v: v.operation is not None and v.operation.steps, what="the first step started")
        yield gateway, accepted


async def append_on_tip(writer: EventLog, subject: str, event) -> None:
    """Append where the subject is now: the op subject moves under a forger while the promoter works."""
    while True:
        try:
            await writer.append(subject, event, expect=await writer.last_seq_of(subject))
            return
        except Conflict:
            continue


async def promote(log, target: str) -> OperationCompleted:
    accepted = await request_operation(log, "default", "promotion", target, by="cli:test", now=now())
    assert accepted.status == "accepted", accepted
    end = await wait_op_end(log, accepted.op_id)
    assert isinstance(end, OperationCompleted), [str(e) for e in await op_events(log, op_id=accepted.op_id)]
    return end


async def test_a_route_moved_forged_on_an_agent_subject_moves_nothing(fleet, nats_server):
    log, a, b = fleet
    async with promoters(nats_server.url):
        view = await routed_to_a(log)
        revision = view.route_revision
        # Agent b's own subjects: a route move to b, and a's models lost (a body naming domain a).
        await b.append(subjects.agent("default", "b"), RouteMoved(at=now(), active="b", by=b.log.writer))
        model = subjects.model("default", "b", "m1")
        await b.append(model, ModelLost(at=now(), domain="a", model="m1", reason="gpu_detached", by=b.log.writer))
        view = await wait_view(log, lambda v: v.anomalies >= 2, what="both forgeries counted")
        assert view.active == "a" and view.route_revision == revision and view.operation is None
        assert (
            "route_moved on haru.evt.default.b.agent by agent:default/b@fake not applied" in view.last_anomaly
            or "model_lost on haru.evt.default.b.model.m1 by agent:default/b@fake not applied" in view.last_anomaly
        )
        assert [str(m).split(":")[0] for m in misplaced_records(await log.history())] == [
            f"seq {view.seq - 1} on haru.evt.default.b.agent",
            f"seq {view.seq} on {model}",
        ]
        # The genuine promotion flips the route at once.
        await promote(log, "b")
    assert [m.active for m in await route_moves(log)] == ["a", "b"]


async def test_garbage_on_the_route_subject_does_not_wedge_the_flip(fleet, nats_server):
    log, a, b = fleet
    route = subjects.route("default")
    async with promoters(nats_server.url):
        await routed_to_a(log)
        # Only the promoter role may write here; even so, neither a body that does not decode nor a
        # misplaced event may make the route's revision and its real last sequence disagree for good.
        await log.js.publish(route, b'{"type": "route_moved", "active": 7}')
        await log.append(
            route, ModelLost(at=now(), domain="a", model="m1", reason="evicted"), expect=await log.last_seq_of(route)
        )
        real_last = await log.last_seq_of(route)
        await wait_view(log, lambda v: v.route_seq == real_last, what="the view folded the garbage")
        await promote(log, "b")
        flip = [e for e in await op_events(log) if isinstance(e, StepCompleted) and e.step == "flip"][-1]
        moved = int(flip.detail.split("route revision ")[1].split(":")[0])
        assert moved > real_last and moved == await log.last_seq_of(route)
        await promote(log, "a")  # and the next one too
    assert [m.active for m in await route_moves(log)] == ["a", "b", "a"]
    assert (await view_of(log)).active == "a"


# --------------------------------------------------------------------------- the writers' audit

ROLE_OF_WRITER = {"promoter": "promoter", "cli": "operator", "gateway": "gateway", "agent": "agent"}


async def test_production_writers_append_only_what_the_table_allows(fleet, nats_server, monkeypatch):
    """Every `EventLog.append` (and `append_batch`) made by apply, the promoter and the control API's request path in a
    first route, a manual promotion, a demotion and an auto-failover: placed, and written by a role
    the table names for its subject kind."""
    log, a, b = fleet
    appended: list[tuple[str, str, object]] = []
    original = EventLog.append

    async def recording(self, subject, event, *, expect):
        appended.append((self.writer, subject, event))
        return await original(self, subject, event, expect=expect)

    original_batch = EventLog.append_batch

    async def recording_batch(self, appends, *, expect):
        appended.extend((self.writer, subject, event) for subject, event in appends)
        return await original_batch(self, appends, expect=expect)

    monkeypatch.setattr(EventLog, "append", recording)
    monkeypatch.setattr(EventLog, "append_batch", recording_batch)
    async with (
        EventLog.connect([nats_server.url], writer="cli:apply") as operator,
        EventLog.connect([nats_server.url], writer="gateway:127.0.0.1:0") as gateway,
    ):
        await apply(operator, layout(degraded_grace_ms=400), now(), by="cli:apply")  # a changed policy: decl events
        async with promoters(nats_server.url):
            await routed_to_a(log)
            accepted = await request_operation(gateway, "default", "promotion", "b", by=gateway.writer, now=now())
            assert isinstance(await wait_op_end(log, accepted.op_id), OperationCompleted)
            demoted = await request_operation(gateway, "default", "demotion", "a", by=gateway.writer, now=now())
            assert isinstance(await wait_op_end(log, demoted.op_id), OperationCompleted)
            await b.unserve()  # the active goes silent: liveness, auto-failover to a
            await wait_view(
                log,
                lambda v: v.active == "a" and v.operation is None and v.domains["b"].reachable is False,
                what="failover to a",
            )
    writers = {w.split(":")[0] for w, _, _ in appended}
    assert {"cli", "promoter", "gateway"} <= writers, writers
    kinds = set()
    for writer, subject, event in appended:
        assert authority.misplaced(subject, event) == "", (writer, subject, event)
        kind = subjects.where(subject).kind
        kinds.add(kind)
        role = ROLE_OF_WRITER[writer.split(":")[0]]
        assert role in authority.writers_of(kind), f"{writer} ({role}) wrote {subject}"
        if role == "agent":  # agent:<fleet>/<domain>@host writes only its own domain
            fleet, domain = writer.split(":")[1].split("@")[0].split("/")
            assert subject.startswith(f"haru.evt.{fleet}.{domain}."), (writer, subject)
    assert {"decl", "op", "route", "liveness", "model", "training"} <= kinds, kinds
    assert misplaced_records(await log.history()) == []


async def test_a_flip_started_by_another_op_writer_before_the_probe_never_moves_the_route(fleet, nats_server):
    """The gateway's credentials may write the op subject (promote/demote requests). A `step_started`
    for the flip recorded there mid-operation is resumed by the promoter when its lease runs out,
    and refused when run: no probe completed in the operation, so the route does not move."""
    log, a, b = fleet
    op = subjects.op("default")
    async with promotion_requested_by_the_gateway(log, nats_server) as (gateway, accepted):
        await append_on_tip(gateway, op, StepStarted(at=now(), op_id=accepted.op_id, step="flip"))
        end = await wait_op_end(log, accepted.op_id, timeout=30)
        assert isinstance(end, OperationAborted) and end.step == "flip", end
        failed = [e for e in await op_events(log, op_id=accepted.op_id) if isinstance(e, StepFailed)]
        assert failed and failed[-1].error_code == "flip_refused" and "not probed" in failed[-1].error
        assert [m.active for m in await route_moves(log)] == ["a"]
        await promote(log, "b")  # the next genuine promotion probes b and flips
    assert [m.active for m in await route_moves(log)] == ["a", "b"]


async def test_a_probe_completion_forged_by_another_op_writer_is_probed_again_before_the_flip(fleet, nats_server):
    """The gateway's credentials may write the op subject. A `step_started` + `step_completed` for
    the probe recorded there early in a promotion make the decider skip the probe step, but not the
    probe: the flip moves the route only to a domain this promoter process probed itself, so it
    probes b again, b fails it, and routing stays on a."""
    log, a, b = fleet
    op = subjects.op("default")
    b.fail_probe = True
    async with promotion_requested_by_the_gateway(log, nats_server) as (gateway, accepted):
        for forged in (
            StepStarted(at=now(), op_id=accepted.op_id, step="probe", by="promoter:forged"),
            StepCompleted(
                at=now(), op_id=accepted.op_id, step="probe", detail="all models answered", by="promoter:forged"
            ),
        ):
            await append_on_tip(gateway, op, forged)
        end = await wait_op_end(log, accepted.op_id, timeout=30)
        records = await op_events(log, op_id=accepted.op_id)
        assert isinstance(end, OperationAborted) and end.step == "flip", [str(e) for e in records]
        # the decider took the forged completion as the probe step: the promoter never started one
        assert [e.by for e in records if isinstance(e, StepStarted) and e.step == "probe"] == ["promoter:forged"]
        failed = [e for e in records if isinstance(e, StepFailed)]
        assert failed and failed[-1].step == "flip" and failed[-1].error_code == "probe_failed", failed
        assert (
            "probed again before the flip" in failed[-1].error
            and "was not appended by this promoter" in failed[-1].error
        )
        assert [m.active for m in await route_moves(log)] == ["a"]
        b.fail_probe = False
        await promote(log, "b")  # a genuine promotion probes b and flips
    assert [m.active for m in await route_moves(log)] == ["a", "b"]
