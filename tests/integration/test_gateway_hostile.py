"""The gateway against hostile clients, with real sockets: slowloris heads, trickled bodies, JSON
nested 10,000 deep, the bearer scheme in any case, and /healthz without a token."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest

from tests.support.gateway import CHAT, MODEL, TOKEN, Fleet, Slowloris, intent_of, running_gateway, view_of

pytestmark = pytest.mark.timeout(120)

SLOW = 48  # slowloris connections
CAP = 8  # HARU_CLIENT_MAX_IDLE for these tests
HEADER_TIMEOUT_MS = 1500


async def test_slow_heads_are_bounded_in_count_and_time_and_others_get_in(event_log, upstreams):
    up = await upstreams("a")
    async with running_gateway(event_log, client_header_timeout_ms=HEADER_TIMEOUT_MS, client_max_idle=CAP) as gw:
        fleet = Fleet(event_log, gw)
        await fleet.put_view(view_of("default", {"a": up.url}, active="a"))
        await fleet.publish(intent_of("default", "a", up.url, revision=1))
        slow = [Slowloris() for _ in range(SLOW)]
        started = time.monotonic()
        tasks = [asyncio.create_task(s.run(gw.port)) for s in slow]
        # The cap: once they are all connected, at most CAP of them can still be open.
        async with asyncio.timeout(30):
            while sum(s.closed_at is None for s in slow) > CAP:
                await asyncio.sleep(0.05)
        assert gw._server is not None and gw._server.idle_closed >= SLOW - CAP
        # A normal client still gets in (and is answered) while the slow ones trickle.
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
            reply = await client.chat.completions.create(model=MODEL, messages=CHAT)
        assert reply.choices[0].message.content == "[domain a] hi"
        # The header timeout: every slow one is closed, however many bytes it keeps sending.
        async with asyncio.timeout(60):
            await asyncio.gather(*tasks)
        assert all(s.closed_at is not None for s in slow)
        # Closed by the timeout, not at once (generous bound on the other side: the timer is 1.5 s).
        assert max(s.closed_at for s in slow) - started >= HEADER_TIMEOUT_MS / 1000 * 0.9


async def test_a_trickled_body_gets_a_408_and_the_connection_is_closed(event_log):
    async with running_gateway(event_log, client_body_timeout_ms=1000) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model": '
        )
        await writer.drain()
        async with asyncio.timeout(30):
            raw = await reader.read()  # to EOF: the server closes it
        writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), raw[:200]
        err = json.loads(body)["error"]
        assert err["code"] == "request_timeout" and "HARU_CLIENT_BODY_TIMEOUT_MS" in err["message"]


async def test_deep_json_is_a_400_in_openais_shape(event_log):
    deep = b'{"model": "m", "messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    deeper_object = b'{"a":' * 10_000 + b"1" + b"}" * 10_000
    async with running_gateway(event_log) as gw:
        async with aiohttp.ClientSession() as s:
            for path, body in (
                ("/v1/chat/completions", deep),
                ("/v1/completions", deeper_object),
                ("/v1/fleets/default/promote", deeper_object),
            ):
                for _ in range(2):
                    async with s.post(gw.url + path, data=body, headers={"Content-Type": "application/json"}) as r:
                        assert r.status == 400, (path, await r.text())
                        err = (await r.json())["error"]
                        assert set(err) == {"message", "type", "param", "code"}
                        assert err["code"] == "invalid_request" and "nested too deeply" in err["message"]


async def test_bearer_in_any_case_and_healthz_names_no_fleet_without_the_token(event_log, upstreams):
    up = await upstreams("a")
    async with running_gateway(event_log, api_token=TOKEN) as gw:
        fleet = Fleet(event_log, gw, name="secret-fleet")
        await fleet.put_view(view_of("secret-fleet", {"a": up.url}, active="a"))
        await fleet.publish(intent_of("secret-fleet", "a", up.url, revision=1))
        async with aiohttp.ClientSession() as s:
            for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
                async with s.get(gw.url + "/v1/fleets", headers={"Authorization": f"{scheme} {TOKEN}"}) as r:
                    assert r.status == 200, scheme
            for wrong in (f"Basic {TOKEN}", f"Bearer{TOKEN}", "bearer nope", TOKEN):
                async with s.get(gw.url + "/v1/fleets", headers={"Authorization": wrong}) as r:
                    assert r.status == 401, wrong
            async with s.get(gw.url + "/healthz") as r:
                assert r.status == 200
                text = await r.text()
            assert "secret-fleet" not in text and "fleets" not in json.loads(text)
            async with s.get(gw.url + "/healthz", headers={"Authorization": f"bearer {TOKEN}"}) as r:
                assert "secret-fleet" in (await r.json())["fleets"]
