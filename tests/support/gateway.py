"""The gateway's test world: upstreams that answer as an inference server does (well or badly), a fleet whose
view and intent the tests write, and a gateway running on the test's event log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from datetime import UTC, datetime

import aiohttp
import msgspec
import openai
from aiohttp import web

from haru.core import subjects
from haru.core.residency import Answer, Lost, Resident, Sleeping
from haru.core.specs import Policy
from haru.core.views import DomainView, FleetView, ModelView, OperationView, RouteIntent, Target, view_encoder
from haru.gateway import Gateway, GatewayConfig
from tests.support.clock import now
from tests.support.wait import wait_until

MODEL = "qwen3.6:27b"
SMALL = "meta-llama/Llama-3.1-8B-Instruct"
TOKEN = "s3cret-token"


class Upstream:
    """A tiny vLLM-shaped server on a real socket. Deterministic bodies; records what it received.

    Request body knobs: "stream": true -> SSE with `chunks` chunks `gap` seconds apart (and an
    optional `pause` before chunk `pause_at`); "header_delay": seconds before the response headers.
    """

    def __init__(self, domain: str) -> None:
        self.domain = domain
        self.received: list[tuple[str, bytes, dict[str, str]]] = []
        self.cancelled = 0
        self.completed = 0
        self.written = 0
        self.runner: web.ServerRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Upstream:
        server = web.Server(self.handle, handler_cancellation=True, access_log=None)
        self.runner = web.ServerRunner(server, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def json_body(self, path: str, model: str) -> bytes:
        return json.dumps(
            {
                "id": f"cmpl-{self.domain}",
                "object": "chat.completion",
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": f"[domain {self.domain}] hi"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
                "path": path,
            },
            separators=(",", ":"),
        ).encode()

    @staticmethod
    def chunk(domain: str, model: str, i: int, text: str) -> bytes:
        obj = {
            "id": f"chunk-{domain}",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": model,
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
        }
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        self.received.append((request.path, body, dict(request.headers)))
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": []})
        try:
            req = json.loads(body)
        except ValueError:
            return web.json_response({"error": {"message": "bad json upstream"}}, status=400)
        model = req.get("model", "")
        try:
            if req.get("header_delay"):
                await asyncio.sleep(req["header_delay"])
            if req.get("upstream_status"):
                return web.Response(
                    body=b'{"error":{"message":"upstream says no","code":422}}',
                    status=req["upstream_status"],
                    content_type="application/json",
                )
            if not req.get("stream"):
                self.completed += 1
                return web.Response(body=self.json_body(request.path, model), content_type="application/json")
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
            await resp.prepare(request)
            if req.get("blob_mib"):  # a flood: as fast as the reader takes it
                piece = b"data: " + b"x" * (64 * 1024 - 8) + b"\n\n"
                for _ in range(req["blob_mib"] * 16):
                    await resp.write(piece)
                    self.written += len(piece)
                await resp.write_eof()
                self.completed += 1
                return resp
            n, gap = int(req.get("chunks", 5)), float(req.get("gap", 0.0))
            for i in range(n):
                if i and gap:
                    await asyncio.sleep(gap)
                if req.get("pause") and i == req.get("pause_at", 1):
                    await asyncio.sleep(req["pause"])
                text = f"[domain {self.domain}]" if i == 0 else f" tok{i}"
                await resp.write(self.chunk(self.domain, model, i, text))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            self.completed += 1
            return resp
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def view_of(
    fleet: str, urls: dict[str, str], *, active: str, models=(MODEL, SMALL), seq: int = 1, residency=None
) -> FleetView:
    residency = residency or {}
    domains = {}
    for name, url in urls.items():
        domains[name] = DomainView(
            name=name,
            serving_url=url,
            reachable=True,
            models={
                m: ModelView(name=m, admitted=True, residency=residency.get((name, m), Resident(since=now())))
                for m in models
            },
        )
    return FleetView(fleet=fleet, domains=domains, active=active, route_revision=seq, seq=seq)


def intent_of(
    fleet: str,
    domain: str,
    url: str,
    *,
    revision: int,
    answers: dict[str, Answer] | None = None,
    models=(MODEL, SMALL),
    serve: str = "agent",
    model_urls: dict[str, str] | None = None,
    operation: str = "",
) -> RouteIntent:
    if answers is None:
        answers = {m: Answer(answer="ready") for m in models}
    return RouteIntent(
        fleet=fleet,
        revision=revision,
        active=Target(domain=domain, serving_url=url, serve=serve, reachable=True, model_urls=model_urls or {}),
        answers=answers,
        operation=operation,
    )


class Fleet:
    """Publishes views and intents into the real log and waits until the gateway routes by them."""

    def __init__(self, log, gw: Gateway, name: str = "default") -> None:
        self.log, self.gw, self.name = log, gw, name
        self.view_rev = 0
        self.intent_seq = 0

    async def put_view(self, view: FleetView) -> None:
        self.view_rev = await self.log.put_view(
            subjects.view_key(self.name), view_encoder.encode(view), last=self.view_rev
        )
        await wait_until(
            lambda: (r := self.gw.table.get(self.name)) is not None and r.view is not None and r.view.seq == view.seq,
            5.0,
            interval_s=0.005,
        )

    async def publish(self, intent: RouteIntent) -> None:
        self.intent_seq = await self.log.publish_intent(self.name, view_encoder.encode(intent), expect=self.intent_seq)
        seq = self.intent_seq
        await wait_until(
            lambda: (r := self.gw.table.get(self.name)) is not None and r.intent_seq == seq, 5.0, interval_s=0.005
        )


@contextlib.asynccontextmanager
async def running_gateway(log, **config):
    cfg = GatewayConfig(port=0, **config)
    async with Gateway(cfg, log) as gw:
        yield gw


def sdk(gw: Gateway, *, fleet: str | None = None, token: str = "unused", retries: int = 0) -> openai.AsyncOpenAI:
    headers = {"X-Haru-Fleet": fleet} if fleet else None
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=token, max_retries=retries, default_headers=headers)


CHAT = [{"role": "user", "content": "hello"}]


async def post_raw(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes, list[bytes]]:
    chunks: list[bytes] = []
    async with aiohttp.ClientSession() as s:
        async with s.post(url, data=body, headers={"Content-Type": "application/json", **(headers or {})}) as r:
            async for chunk in r.content.iter_any():
                chunks.append(chunk)
            return r.status, b"".join(chunks), chunks


async def get_json(gw_url: str, path: str, token: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s:
        async with s.get(gw_url + path, headers=headers) as r:
            return r.status, await r.json(content_type=None)


async def get_text(gw: Gateway, path: str, token: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + path, headers=headers) as r:
            return await r.text()


class RawUpstream:
    """An asyncio server speaking HTTP/1.1 by hand, to produce framings and closes on purpose.

    Per connection it answers requests with `answer(n)` (n = the request's number on that
    connection); `answer` returning None closes the connection without a byte.
    """

    def __init__(self, answer) -> None:
        self.answer = answer
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> RawUpstream:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(
                    next(
                        line.split(b":")[1]
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    )
                )
                await reader.readexactly(length)
                n += 1
                parts = self.answer(n)
                if parts is None:
                    writer.close()
                    return
                for part in parts:
                    writer.write(part)
                    await writer.drain()
                    await asyncio.sleep(0.02)
                if parts and b"Connection: close" in parts[0]:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()


OK_JSON = [b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}']


class Slowloris:
    """A connection that sends a request head one header line at a time, forever, and notes when
    the server closes it."""

    def __init__(self) -> None:
        self.closed_at: float | None = None

    async def run(self, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n")
            await writer.drain()
            trickle = asyncio.create_task(self._trickle(writer))
            try:
                while await reader.read(4096):
                    pass  # whatever it answers (a 400 for a broken head is also fine): wait for the close
            except ConnectionError:
                pass
            self.closed_at = time.monotonic()
            trickle.cancel()
        finally:
            writer.close()

    @staticmethod
    async def _trickle(writer: asyncio.StreamWriter) -> None:
        i = 0
        while True:
            await asyncio.sleep(0.3)
            i += 1
            writer.write(b"X-Slow-%d: y\r\n" % i)
            try:
                await writer.drain()
            except ConnectionError:
                return


FAST = Policy(heartbeat_timeout_ms=500)


def fleet_view(
    urls: dict[str, str],
    *,
    active: str,
    policy: Policy = FAST,
    seq: int = 1,
    wake_ms: int = 400,
    operation: OperationView | None = None,
    last_operation: OperationView | None = None,
    runtime: str = "vllm",
    standby_state=None,
    reload_ms: int = 30_000,
    active_state=None,
) -> FleetView:
    """Two domains: `active`, whose model was lost to a crash (a cold reload of `reload_ms`, 30 s,
    measured), and the other a standby asleep whose measured wake is `wake_ms`: the promoter fails over
    at once."""
    standby_state = standby_state or Sleeping(since=datetime.now(UTC))
    states = {(d, MODEL): standby_state for d in urls if d != active}
    states[(active, MODEL)] = active_state or Lost(since=datetime.now(UTC), reason="process_exited")
    view = view_of("default", urls, active=active, models=(MODEL,), seq=seq, residency=states)
    domains = {}
    for name, dv in view.domains.items():
        models = {
            m: msgspec.structs.replace(mv, wake_ms=wake_ms if name != active else 0, runtime=runtime, load_ms=reload_ms)
            for m, mv in dv.models.items()
        }
        domains[name] = msgspec.structs.replace(dv, models=models)
    return msgspec.structs.replace(
        view, domains=domains, policy=policy, operation=operation, last_operation=last_operation
    )


class TwoDomains:
    """The fleet of every test here: domains a (the active) and b, behind the real gateway."""

    def __init__(self, event_log, gw, a, b) -> None:
        self.a, self.b = a, b
        self.fleet = Fleet(event_log, gw)

    @property
    def urls(self) -> dict[str, str]:
        return {"a": self.a.url, "b": self.b.url}

    async def view(self, **kw) -> None:
        """Publish `fleet_view` of a and b with `kw`, a still the active."""
        await self.fleet.put_view(fleet_view(self.urls, active="a", **kw))

    async def route_to_a(self, *, answers: dict[str, Answer] | None = None, intent_op: str = "", **kw) -> None:
        """The view (`kw`), then the route to a, whose model is answered `answers` (default: ready)."""
        await self.view(**kw)
        await self.fleet.publish(
            intent_of("default", "a", self.a.url, revision=1, answers=answers, models=(MODEL,), operation=intent_op)
        )

    async def move_to_b(self) -> None:
        await self.fleet.publish(intent_of("default", "b", self.b.url, revision=2, models=(MODEL,)))
