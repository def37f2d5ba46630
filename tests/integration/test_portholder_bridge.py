"""The serving port holder bridges while no agent accepts (issue 14, agents/portholder.py).

A real holder process, the test in the agent's place (it holds the listening socket and the lease), and
an HTTP server on 127.0.0.1 in a runtime's place, named by an identity file in the state directory as an
agent writes them. The bridge forwards the three inference paths to it (JSON and SSE, streamed as it
comes), answers /v1/models, refuses the rest in OpenAI's error shape, and stops accepting when an agent
attaches while finishing what it forwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from haru.agents import portholder

pytestmark = pytest.mark.timeout(60)


class Upstream:
    """A runtime stand-in: /v1/chat/completions answers JSON, or SSE in two parts with a pause between."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict, bytes]] = []
        self.release = asyncio.Event()  # the SSE stream's second part waits for it
        self.first_sent = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append((request.path, {k.lower(): v for k, v in request.headers.items()}, body))
        if not json.loads(body).get("stream"):
            return web.json_response({"id": "x", "object": "chat.completion", "echo": json.loads(body)})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"part": 1}\n\n')
        self.first_sent.set()
        await self.release.wait()
        await response.write(b'data: {"part": 2}\n\ndata: [DONE]\n\n')
        await response.write_eof()
        return response

    async def __aenter__(self) -> Upstream:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_post("/v1/embeddings", self.handle)
        app.router.add_post("/tokenize", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.release.set()
        assert self.runner is not None
        await self.runner.cleanup()


def write_identity(state_dir: Path, model: str, port: int) -> None:
    d = state_dir / "runtimes"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{model}.json").write_text(
        json.dumps(
            {"pid": os.getpid(), "start": 1, "argv": [], "port": port, "model": model, "runtime": "vllm", "plan": {}}
        )
    )


def refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: a connection to it is refused


@contextlib.asynccontextmanager
async def holder(state_dir: Path):
    """A holder started as an agent starts it; yields (the listening socket, the lease, the port URL)."""
    sock, lease = await asyncio.to_thread(portholder.listening_socket, state_dir, "127.0.0.1", 0)
    try:
        yield sock, lease, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()
        lease.close()
        await asyncio.to_thread(portholder.stop_holder, state_dir)


async def wait_stats(state_dir: Path, pred, what: str) -> dict:
    deadline = time.monotonic() + 10
    while True:
        stats = await asyncio.to_thread(portholder.holder_stats, state_dir)
        if pred(stats):
            return stats
        assert time.monotonic() < deadline, f"{what}: {stats}"
        await asyncio.sleep(0.02)


async def test_the_bridge_forwards_by_model_streams_and_refuses_the_rest(tmp_path):
    state = tmp_path / "state"
    async with Upstream() as up, holder(state) as (_sock, lease, url), aiohttp.ClientSession() as s:
        write_identity(state, "m1", up.port)
        write_identity(state, "gone", refused_port())
        assert (await asyncio.to_thread(portholder.holder_stats, state))["bridging"] is False  # an agent holds it
        lease.close()  # the agent exited: the holder bridges
        await wait_stats(state, lambda st: st["bridging"] and st["leases"] == 0, "bridging once the lease closed")

        # JSON: forwarded byte-identical, the connection closed after it, only the passed headers upstream
        body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
        async with s.post(
            url + "/v1/chat/completions?x=1", json=body, headers={"X-Request-Id": "r1", "Cookie": "secret"}
        ) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Connection"].lower() == "close"
            assert (await r.json())["echo"] == body
        path, headers, raw = up.requests[-1]
        assert path == "/v1/chat/completions" and json.loads(raw) == body
        assert headers["x-request-id"] == "r1" and "cookie" not in headers and headers["connection"] == "close"

        async with s.post(url + "/tokenize", json={"model": "m1", "prompt": "hi"}) as r:  # the runtime's tokenizer
            assert r.status == 200 and up.requests[-1][0] == "/tokenize"

        # SSE: the first event reaches the client while the runtime still holds the second
        async with s.post(url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
            assert first == b'data: {"part": 1}\n\n'
            up.release.set()
            rest = await r.content.read()
            assert rest == b'data: {"part": 2}\n\ndata: [DONE]\n\n'
        up.release.clear()

        async with s.get(url + "/v1/models") as r:
            assert r.status == 200
            assert sorted(m["id"] for m in (await r.json())["data"]) == ["gone", "m1"]

        async def refused(method: str, path: str, status: int, code: str, **kw) -> str:
            async with s.request(method, url + path, **kw) as r:
                doc = await r.json(content_type=None)
                assert r.status == status and doc["error"]["code"] == code, (r.status, doc)
                assert set(doc["error"]) == {"message", "type", "param", "code"}
                return doc["error"]["message"]

        assert "not served here" in await refused("POST", "/sleep", 404, "not_found", json=body)
        assert "not served here" in await refused("GET", "/health", 404, "not_found")
        await refused("GET", "/v1/chat/completions", 405, "method_not_allowed")

        async def chunks():
            yield json.dumps(body).encode()

        assert "Content-Length" in await refused("POST", "/v1/chat/completions", 411, "length_required", data=chunks())
        msg = await refused("POST", "/v1/chat/completions", 503, "agent_restarting", json={**body, "model": "m9"})
        assert "`m9`" in msg and "restarting" in msg
        msg = await refused("POST", "/v1/chat/completions", 503, "agent_restarting", json={**body, "model": "gone"})
        assert "`gone`" in msg and "refused" in msg and "restarting" in msg
        await refused(
            "POST",
            "/v1/chat/completions",
            400,
            "invalid_request",
            data=b"[1]",
            headers={"Content-Type": "application/json"},
        )
        sent = len(up.requests)

        stats = await asyncio.to_thread(portholder.holder_stats, state)
        # sent to a runtime: the JSON, the tokenize and the SSE request, once each; the rest answered by the bridge
        # itself
        assert stats["bridged"] == 3 and sent == 3 and stats["bridge_refused"] == 7, stats


async def test_a_token_in_the_holders_environment_is_required_and_sizes_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setenv("HARU_SERVING_TOKEN", "s3cret")  # the holder inherits the agent's environment
    monkeypatch.setenv("HARU_SERVING_MAX_BODY_BYTES", "1000")
    state = tmp_path / "state"
    async with Upstream() as up, holder(state) as (_sock, _lease, url), aiohttp.ClientSession() as s:
        write_identity(state, "m1", up.port)
        assert await asyncio.to_thread(portholder.bridge, state) is True
        body = {"model": "m1", "messages": []}
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic s3cret"}):
            async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "unauthorized"
            async with s.get(url + "/v1/models", headers=headers) as r:
                assert r.status == 401
        assert up.requests == []
        async with s.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer s3cret"}) as r:
            assert r.status == 200 and (await r.json())["echo"] == body
        auth = {"Authorization": "Bearer s3cret"}
        async with s.post(url + "/v1/chat/completions", json={**body, "pad": "x" * 2000}, headers=auth) as r:
            assert r.status == 413 and (await r.json())["error"]["code"] == "payload_too_large"
        async with s.post(url + "/v1/chat/completions", json=body, headers={**auth, "X-Big": "y" * 70_000}) as r:
            assert r.status == 400 and "head is over" in (await r.json())["error"]["message"]
        assert len(up.requests) == 1


async def test_an_attaching_agent_stops_the_bridge_which_finishes_its_streams(tmp_path):
    state = tmp_path / "state"
    async with Upstream() as up, holder(state) as (sock, lease, url), aiohttp.ClientSession() as s:
        write_identity(state, "m1", up.port)
        lease.close()
        await wait_stats(state, lambda st: st["bridging"], "bridging")
        body = {"model": "m1", "messages": [], "stream": True}
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            assert await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5) == b'data: {"part": 1}\n\n'
            # the next agent attaches while the bridge streams
            sock2, lease2 = await asyncio.to_thread(portholder.listening_socket, state, "127.0.0.1", 0)
            try:
                assert sock2.getsockname() == sock.getsockname()
                stats = await wait_stats(state, lambda st: not st["bridging"], "not bridging once an agent attached")
                assert stats["leases"] == 1
                # a new connection waits for the agent: the holder no longer accepts
                before = stats["bridge_connections"]
                reader, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
                writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                await writer.drain()
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(reader.read(1), 0.5)
                conn, _ = await asyncio.get_running_loop().sock_accept(sock2)  # the agent takes it
                conn.close()
                writer.close()
                assert (await asyncio.to_thread(portholder.holder_stats, state))["bridge_connections"] == before
                # ...while the stream the bridge took before finishes
                up.release.set()
                assert await asyncio.wait_for(r.content.read(), 5) == b'data: {"part": 2}\n\ndata: [DONE]\n\n'
            finally:
                sock2.close()
                lease2.close()
        # the agent is gone again (its lease closed): the holder bridges again
        await wait_stats(state, lambda st: st["bridging"], "bridging again")
        async with s.post(url + "/v1/embeddings", json={"model": "m1", "input": "x"}) as r:
            assert r.status == 200
