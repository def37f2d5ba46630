"""A real HAProxy and a real nginx in front of a simulated fleet (real agents, projector, promoter,
nats-server), each driven by a route follower (`haru.routers.Follower`), under client load: a planned
promotion loses no request, because the old active is put to sleep only once the router acknowledged the
new route; a GPU detached from the active moves the router to the new active, and what the clients saw is
printed (a plain router cannot hold a request while the standby wakes: that costs what it costs)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime

import pytest

from haru.core import subjects
from haru.core.events import RouteMoved, StepCompleted
from haru.host.tasks import cancel_and_wait
from haru.log.requests import request_operation
from haru.routers import Follower
from tests.support.failover_sim import sim
from tests.support.promoter import wait_view
from tests.support.routers import haproxy, nginx
from tests.support.sim_fleet import FLEET, ChatLoad, sim_fleet, sim_layout, steady
from tests.support.wait import wait_until

ROUTERS = {"haproxy": haproxy, "nginx": nginx}


@contextlib.asynccontextmanager
async def followed(tmp_path, event_log, router: str):
    """The router started, and its follower driving it; yields (router process, follower)."""
    async with ROUTERS[router](tmp_path) as proc:
        f = Follower(event_log, FLEET, "edge", proc.target(), interval_s=0.25, backoff_s=0.1)
        task = asyncio.create_task(f.run())
        try:
            yield proc, f
        finally:
            await cancel_and_wait(task)


async def flip_of(event_log, domain: str):
    for rec in reversed(await event_log.history(subjects.route(FLEET))):
        if isinstance(rec.event, RouteMoved) and rec.event.active == domain:
            return rec
    return None


async def followed_after(event_log, f: Follower, domain: str) -> tuple[int, float]:
    """The flip to `domain`'s revision, once the follower applied it; and seconds from the flip's append
    (its time in the event) to the router holding it."""
    flip = await wait_until(lambda: flip_of(event_log, domain), 60, what=f"the flip to {domain}")
    try:
        await wait_until(
            lambda: f.applied is not None and f.applied.revision >= flip.seq,
            10,
            what=lambda: f"{f.router} applying the flip at revision {flip.seq}: {f.state()}",
        )
    except AssertionError as exc:
        last = await event_log.last_intent(FLEET)
        raise AssertionError(f"{exc}; the last intent published: seq {last[1] if last else 0}") from None
    assert f.applied_at is not None
    return flip.seq, (f.applied_at - flip.event.at).total_seconds()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("router", ["haproxy", "nginx"])
async def test_a_planned_promotion_through_a_followed_router_loses_no_request(tmp_path, nats_server, event_log, router):
    layout = sim_layout(tmp_path / "layout.json", tmp_path)
    async with sim_fleet(tmp_path, nats_server, event_log, layout):
        view = await wait_view(event_log, steady, timeout=60, fleet=FLEET, what="a active, b a standby")
        async with followed(tmp_path, event_log, router) as (proc, f):
            await wait_until(lambda: f.applied is not None and f.applied.revision == view.route_revision, 10)
            async with ChatLoad(proc.url, clients=4) as load:
                await wait_until(lambda: load.ok >= 20, 20, what="steady traffic through the router")
                result = await request_operation(event_log, FLEET, "promotion", "b", by="test", now=datetime.now(UTC))
                assert result.status == "accepted", result
                revision, took_s = await followed_after(event_log, f, "b")
                done = await wait_view(
                    event_log, lambda v: v.active == "b" and v.operation is None, 60, fleet=FLEET, what="b promoted"
                )
                ok_at_settle = load.ok
                await wait_until(lambda: load.ok >= ok_at_settle + 20, 20, what="traffic after the promotion")
        print(f"{router}: followed the flip in {took_s * 1000:.0f} ms; {load.ok} answered, {len(load.failed)} failed")
        assert load.failed == [], load.failed[:5]
        settle = [
            r.event
            for r in await event_log.history(subjects.op(FLEET))
            if isinstance(r.event, StepCompleted)
            and r.event.step == "settle_old_active"
            and r.event.op_id == done.last_operation.op_id
        ]
        assert settle and "routers: applied by edge" in settle[-1].detail, settle
        assert f.applied.active == "b" and f.applied.revision == revision


@pytest.mark.timeout(150)
@pytest.mark.parametrize("router", ["haproxy", "nginx"])
async def test_a_detached_gpu_moves_a_followed_router_to_the_new_active(tmp_path, nats_server, event_log, router):
    layout = sim_layout(tmp_path / "layout.json", tmp_path)
    async with sim_fleet(tmp_path, nats_server, event_log, layout):
        view = await wait_view(event_log, steady, timeout=60, fleet=FLEET, what="a active, b a standby")
        async with followed(tmp_path, event_log, router) as (proc, f):
            await wait_until(lambda: f.applied is not None and f.applied.revision == view.route_revision, 10)
            async with ChatLoad(proc.url, clients=4) as load:
                await wait_until(lambda: load.ok >= 20, 20, what="steady traffic through the router")
                t0 = time.monotonic()
                sim(tmp_path, "detach-gpu", "a")
                _, took_s = await followed_after(event_log, f, "b")
                applied = time.monotonic()
                ok_then = load.ok
                await wait_until(lambda: load.ok >= ok_then + 20, 20, what="traffic served by b")
        late = [what for at, what in load.failed if at > applied + 0.5]
        print(
            f"{router}: GPU detach -> router on b {time.monotonic() - t0:.1f} s wall; flip -> applied "
            f"{took_s * 1000:.0f} ms; {load.ok} answered, {len(load.failed)} failed"
        )
        assert f.applied.active == "b"
        assert late == [], late[:5]  # once the router holds the new route, clients are served
