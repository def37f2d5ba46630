"""The gateway under control-plane faults: /healthz names what is down, and a route move reaches
clients from the route subject itself when the projector is dead.

Real nats-server, real Projector and Promoter tasks (their heartbeats are real), real upstream
sockets; the route moves are appended on the route subject as the promoter's flip appends them.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from haru.core import subjects
from haru.core.events import RouteMoved
from haru.core.residency import Sleeping
from haru.core.views import view_encoder
from haru.host import alive
from haru.host.natsd import NatsServer
from haru.host.tasks import cancel_and_wait
from haru.projections.projector import Projector
from haru.promoter.service import run_promoter
from tests.support.clock import now
from tests.support.gateway import CHAT, MODEL, Fleet, get_json, intent_of, post_raw, running_gateway, view_of
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(90)
CHAT_JSON = json.dumps(CHAT)


async def health(gw_url: str, strict: bool = False) -> tuple[int, dict]:
    return await get_json(gw_url, "/healthz?strict=1" if strict else "/healthz")


async def test_healthz_names_the_projector_promoter_and_nats_when_they_are_down(event_log, nats_server):
    async with running_gateway(event_log) as gw:
        await asyncio.sleep(alive.SILENT_AFTER_S + 0.5)  # listened long enough to call silence a verdict
        status, body = await health(gw.url)
        assert status == 200 and body["status"] == "degraded", body
        assert body["down"] == ["projector", "promoter"], body
        assert (await health(gw.url, strict=True))[0] == 503
        assert (await get_json(gw.url, "/healthz?strict"))[0] == 503  # the bare flag is strict too

        projector = asyncio.create_task(Projector(event_log).run())
        promoter = asyncio.create_task(run_promoter(event_log, identity="promoter:test"))
        try:

            async def ok():
                s, b = await health(gw.url, strict=True)
                return (s, b) if s == 200 and b["status"] == "ok" else None

            _, body = await wait_until(
                ok, 20, interval_s=0.1, what="healthz ok with a projector and a promoter beating"
            )
            assert body["down"] == [] and body["control_plane"]["promoter"]["alive"] == 1, body

            # the promoter dies: named within a few seconds, the projector still fine
            await cancel_and_wait(promoter)

            async def promoter_down():
                s, b = await health(gw.url, strict=True)
                return (s, b) if b["down"] == ["promoter"] else None

            status, body = await wait_until(promoter_down, 20, interval_s=0.1, what="healthz to name the promoter")
            assert status == 503 and body["status"] == "degraded", body

            # NATS dies: named at once, whatever else is true
            nats_server.kill()

            async def nats_down():
                s, b = await health(gw.url)
                return (s, b) if "nats" in b["down"] else None

            status, body = await wait_until(nats_down, 20, interval_s=0.1, what="healthz to name nats")
            assert status == 200 and body["down"][0] == "nats" and body["control_plane"]["nats"]["connected"] is False
            again = NatsServer(nats_server.store_dir, port=nats_server.port)
            again.start_sync()
            try:

                async def back():
                    s, b = await health(gw.url)
                    return b if b["down"] == ["promoter"] else None

                await wait_until(back, 30, interval_s=0.1, what="NATS back and the projector heard again")
            finally:
                again.stop_sync()
        finally:
            await cancel_and_wait(projector, promoter)


async def test_a_route_move_reaches_clients_from_the_route_subject_with_the_projector_dead(event_log, gw, upstreams):
    a, b = await upstreams("a"), await upstreams("b")
    route = subjects.route("default")
    first = await event_log.append(route, RouteMoved(at=now(), active="a"), expect=0)
    # What a dead projector last wrote: b's models asleep (it never saw them wake) and a active.
    stale = {("b", m): Sleeping(level=1, since=now()) for m in (MODEL,)}
    fleet = Fleet(event_log, gw)
    await fleet.put_view(view_of("default", {"a": a.url, "b": b.url}, active="a", seq=first, residency=stale))
    await fleet.publish(intent_of("default", "a", a.url, revision=first))
    status, data, _ = await post_raw(
        gw.url + "/v1/chat/completions", f'{{"model": "{MODEL}", "messages": {CHAT_JSON}}}'.encode()
    )
    assert status == 200 and b"[domain a]" in data

    # The promoter's flip, after its probe of b: no projector runs to turn it into an intent.
    moved = await event_log.append(route, RouteMoved(at=now(), active="b", previous="a", op_id="op-test"), expect=first)

    async def on_b():
        s, d, _ = await post_raw(
            gw.url + "/v1/chat/completions", f'{{"model": "{MODEL}", "messages": {CHAT_JSON}}}'.encode()
        )
        return (s, d) if s == 200 and b"[domain b]" in d else None

    await wait_until(on_b, 10, interval_s=0.1, what="chat answered by b")
    assert gw.table.get("default").revision == moved

    # A projector catching up publishes an intent from before the move: routing stays on b.
    await event_log.publish_intent(
        "default", view_encoder.encode(intent_of("default", "a", a.url, revision=first)), expect=fleet.intent_seq
    )
    await asyncio.sleep(0.5)
    assert gw.table.get("default").active == "b"
    assert await on_b()
    # An event that is not a route move, or a move on any other subject, moves nothing.
    await event_log.append(subjects.agent("default", "a"), RouteMoved(at=now(), active="a"), expect=0)
    await asyncio.sleep(0.5)
    assert gw.table.get("default").active == "b"
