"""An uncut stream goes through the gateway byte for byte (only a stream continued after a cut is
re-encoded: gateway/resume.py). The upstream writes an SSE body in awkward pieces, cut inside events,
inside a multi-byte character and inside an escape, with CRLF events, a comment, escapes a JSON
encoder would write otherwise (`\\u0001`, `\\/`, `\\u00e9`) and spaces a compact encoder would drop:
the client must receive exactly those bytes."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from tests.support.gateway import MODEL, Fleet, intent_of, running_gateway, view_of

pytestmark = pytest.mark.timeout(30)

BODY = (
    b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
    b": a comment line\n\n"
    b'data: {"id": "chatcmpl-x", "choices": [{"index": 0, "delta": '
    b'{"content": "\\u0001\\/ caf\\u00e9 \xc3\xa9\xe2\x82\xac"}}]}\r\n\r\n'
    b'data: {"choices":[{"index":0,"delta":{"content":"\\ud83d\\ude00 '
    b'\\"q\\" \\n"},"finish_reason":null}],"id":"chatcmpl-x"}\n\n'
    b'data: {"id":"chatcmpl-x","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)


def pieces(body: bytes) -> list[bytes]:
    """The body cut at awkward places: inside the first event, inside a UTF-8 character, inside an
    escape, between the CR and LF of an event's end."""
    euro = body.index(b"\xe2\x82\xac") + 1
    escape = body.index(b"\\ude00") + 3
    crlf = body.index(b"\r\n\r\n") + 1
    cuts = sorted({17, crlf, euro, escape, len(body) - 5})
    return [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]


class RawUpstream:
    def __init__(self) -> None:
        self.runner: web.ServerRunner | None = None
        self.url = ""

    async def start(self) -> RawUpstream:
        self.runner = web.ServerRunner(web.Server(self.handle, access_log=None), handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for piece in pieces(BODY):
            await resp.write(piece)
            await asyncio.sleep(0.02)  # each piece its own read on the gateway's side
        await resp.write_eof()
        return resp


async def test_an_uncut_stream_reaches_the_client_byte_for_byte(event_log):
    upstream = await RawUpstream().start()
    try:
        async with running_gateway(event_log) as gw:
            fleet = Fleet(event_log, gw)
            await fleet.put_view(
                view_of("default", {"a": upstream.url, "b": upstream.url}, active="a", models=(MODEL,))
            )
            await fleet.publish(intent_of("default", "a", upstream.url, revision=1, models=(MODEL,)))
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
            async with aiohttp.ClientSession() as s:
                async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                    got = await r.read()
            async with aiohttp.ClientSession() as s:  # the same request straight to the upstream
                async with s.post(upstream.url + "/v1/chat/completions", json=body) as r:
                    direct = await r.read()
        assert direct == BODY
        assert got == BODY
    finally:
        assert upstream.runner is not None
        await upstream.runner.cleanup()
