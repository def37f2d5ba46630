"""The chat proxy: POST /v1/chat/completions, /v1/completions, /v1/embeddings.

Per request: read the body (bounded by HARU_CHAT_MAX_BODY_BYTES, checked from Content-Length before
reading and again while reading), decode only `model` from it, resolve (fleet, model) in the
in-memory routing table, and forward the body bytes unchanged to the target over a pooled
keep-alive connection (`gateway.upstream`). The time to the upstream's response headers is bounded
by HARU_CHAT_HEADER_TIMEOUT_MS and nothing else: no timer runs on a body, so a stream that goes
quiet mid-generation is never cut by the transport.

Responses pass through untouched: a sized response up to `buffer_limit_bytes` that is not SSE is
returned as one body with Content-Length (cheaper than chunked, docs/design.md); anything else (SSE, or
unsized) is streamed chunk by chunk as it arrives. A client that disconnects cancels the handler
(the server runs with handler_cancellation), which closes the upstream connection, so the runtime
stops generating. A response the client did not take whole is never put back in the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from http import HTTPStatus

import msgspec
import structlog
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE, HttpVersion11
from multidict import CIMultiDict

from haru.core.openai_errors import PAYLOAD_TOO_LARGE, REQUEST_TIMEOUT, UPSTREAM_TIMEOUT, UPSTREAM_UNREACHABLE
from haru.gateway.canary import CanaryCounts
from haru.gateway.config import GatewayConfig
from haru.gateway.errors import UpstreamError
from haru.gateway.hold import Holds, back_since, hold_plan
from haru.gateway.metrics import UNKNOWN_FLEET, UNKNOWN_MODEL, GatewayMetrics
from haru.gateway.resume import Resumer
from haru.gateway.routing import (
    FleetRoutes,
    Forward,
    Refusal,
    RoutingTable,
    model_of,
)
from haru.gateway.stranded import stranded
from haru.gateway.upstream import Connection, Pool
from haru.gateway.usage import UsageTap, usage_of
from haru.host.httpguard import BodyTimeout, BodyTooLarge, read_body

log = structlog.get_logger("haru.gateway")

CHAT_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
_CHAT = "/v1/chat/completions"
# A serving port (agents/serving.py) marks a 502/503 that says the runtime behind it is gone.
GONE_HEADER = "x-haru-runtime-gone"
RETRIED_HEADER = "X-Haru-Retried"
HELD_HEADER = "X-Haru-Held-Ms"


class _Gone(Exception):
    """The domain's serving port answered 502/503 for a runtime that is gone, before any byte reached
    the client: the request may go once more to a live domain (control flow inside the proxy)."""

    def __init__(self, refusal: Refusal) -> None:
        self.refusal = refusal


# Request headers never forwarded: hop-by-hop, framing (set again for the upstream), the
# client's credentials for Haru (the serving token replaces them) and Haru's own routing header.
_DROP_REQUEST = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "authorization",
        "x-haru-fleet",
    }
)
# Response headers not copied back: hop-by-hop and framing (aiohttp frames the response itself).
_DROP_RESPONSE = frozenset(
    {"content-length", "transfer-encoding", "connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade"}
)

# Response headers aiohttp adds when the upstream sent none (Date, Server, a Content-Type for a body).
_DEFAULTED = {"date": 1, "server": 2, "content-type": 4}
_REASONS = {int(s): s.phrase for s in HTTPStatus}


class _Whole(web.StreamResponse):
    """A whole sized response, head and body serialised by the proxy and sent in one transport write.

    What aiohttp's `web.Response` would send, header for header (Date, Server and Content-Type
    defaulted the same way, `Connection: close` when the client asked for it), without its
    per-response header preparation, which was ~8% of the gateway's CPU at 32 connections (issue
    20). Only for HTTP/1.1 clients and statuses that carry a body; everything else takes
    `web.Response`. aiohttp's request handler sees a response whose EOF is already sent.
    """

    def __init__(
        self,
        status: int,
        headers: list[tuple[str, str]],
        defaults: int,
        domain: str,
        body: bytes,
        keep_alive: bool,
        chunked: bool = False,
    ) -> None:
        super().__init__(status=status)
        head = _head(status, tuple(headers), defaults, domain, keep_alive, chunked, chunked or bool(body))
        if not chunked:
            self._data = b"%b%d\r\n\r\n%b" % (head, len(body), body)
        elif body:
            self._data = b"%b%x\r\n%b\r\n0\r\n\r\n" % (head, len(body), body)
        else:
            self._data = head + b"0\r\n\r\n"
        self._keep_alive = keep_alive

    async def prepare(self, request: web.BaseRequest):
        if self._eof_sent:
            return None
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        transport.write(self._data)
        writer = request.writer
        writer.output_size += len(self._data)
        self._eof_sent = True
        await writer.drain()
        return None


class _Stream(web.StreamResponse):
    """A streamed response framed and written by the proxy, straight to the transport.

    What `web.StreamResponse` would send (the same head as `_Whole`'s; chunked, or as it came under
    the upstream's Content-Length), without its per-response header preparation and per-write
    bookkeeping. With `hold`, the head waits for the first body bytes and goes out with them in one
    write. A client that went away makes a write raise ConnectionResetError, as aiohttp's does.
    HTTP/1.1 clients and statuses that carry a body only, as `_Whole`.
    """

    def __init__(
        self,
        status: int,
        headers: list[tuple[str, str]],
        defaults: int,
        domain: str,
        keep_alive: bool,
        length: int | None,
        hold: bool,
    ) -> None:
        super().__init__(status=status)
        self._chunked = length is None
        head = _head(status, tuple(headers), defaults, domain, keep_alive, self._chunked, True)
        self._head_bytes: bytes | None = head if length is None else b"%b%d\r\n\r\n" % (head, length)
        self._hold = hold
        self._keep_alive = keep_alive
        self._transport: asyncio.BaseTransport | None = None
        self._sink: AbstractStreamWriter | None = None

    async def prepare(self, request: web.BaseRequest):
        if self._sink is not None:
            return None  # started by the proxy; aiohttp calls this again once the handler returns
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self._transport, self._sink = transport, request.writer
        if not self._hold:
            self._send(b"")
        return None

    def _send(self, data: bytes) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        head = self._head_bytes
        if head is not None:
            self._head_bytes = None
            data = head + data
        transport.write(data)  # type: ignore[attr-defined]
        self._sink.output_size += len(data)  # type: ignore[union-attr]

    async def write(self, data) -> None:
        self._send(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked and data else data)
        await self._sink.drain()  # type: ignore[union-attr]  # waits only while the client's socket is full

    async def write_eof(self, data: bytes = b"") -> None:
        if self._eof_sent:
            return
        self._eof_sent = True
        if self._chunked:
            self._send(b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n")
        elif data or self._head_bytes is not None:
            self._send(data)
        await self._sink.drain()  # type: ignore[union-attr]


_HEADS: dict[tuple, bytes] = {}


def _head(
    status: int,
    headers: tuple[tuple[str, str], ...],
    defaults: int,
    domain: str,
    keep_alive: bool,
    chunked: bool,
    typed: bool,
) -> bytes:
    """The head of a `_Whole` or `_Stream` response, up to `Content-Length: ` (or through
    `Transfer-Encoding: chunked` and the blank line). Cached: an upstream repeats its header set from
    response to response, its Date changing once a second (`_Whole` 1.57 -> 1.10 us, issue 20); a
    Date the proxy adds is in the key."""
    date = rfc822_formatted_time() if not defaults & 1 else ""
    key = (status, headers, defaults, domain, keep_alive, chunked, typed, date)
    head = _HEADS.get(key)
    if head is not None:
        return head
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n"]
    lines.extend([f"{k}: {v}\r\n" for k, v in headers])
    lines.append(f"X-Haru-Domain: {domain}\r\n")
    if defaults != 7:
        if typed and not defaults & 4:
            lines.append("Content-Type: application/octet-stream\r\n")
        if date:
            lines.append(f"Date: {date}\r\n")
        if not defaults & 2:
            lines.append(f"Server: {SERVER_SOFTWARE}\r\n")
    if not keep_alive:
        lines.append("Connection: close\r\n")
    lines.append("Transfer-Encoding: chunked\r\n\r\n" if chunked else "Content-Length: ")
    head = "".join(lines).encode("utf-8")
    if len(_HEADS) >= 512:  # a new Date each second: the old heads go
        _HEADS.clear()
    _HEADS[key] = head
    return head


def error_response(refusal: Refusal, extra: dict[str, str] | None = None) -> web.Response:
    headers = {"Content-Type": "application/json"}
    if refusal.retry_after is not None:
        headers["Retry-After"] = str(refusal.retry_after)
    if not refusal.retryable:
        headers["x-should-retry"] = "false"  # the OpenAI SDKs honour it; 409 would be retried otherwise
    if refusal.domain:
        headers["X-Haru-Domain"] = refusal.domain
    if extra:
        headers.update(extra)
    return web.Response(body=refusal.body(), status=refusal.status, headers=headers)


class Proxy:
    """Forwards inference requests. One per gateway; owns the upstream connection pool."""

    def __init__(self, config: GatewayConfig, table: RoutingTable, metrics: GatewayMetrics) -> None:
        self.config = config
        self.table = table
        self.metrics = metrics
        self.default_fleet = config.default_fleet
        self.max_body = config.max_body_bytes
        self.header_timeout = config.header_timeout_ms / 1000
        self.body_timeout = config.client_body_timeout_ms / 1000
        self.buffer_limit = config.buffer_limit_bytes
        self.auth = f"Authorization: Bearer {config.serving_token}\r\n" if config.serving_token else ""
        self.pool: Pool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Failovers the client does not see (gateway/hold.py, gateway/resume.py): off the hot path.
        self.holds = Holds(table, metrics)
        self.canary = CanaryCounts()  # per (fleet, domain, model) requests and errors (gateway.canary)
        self.resumer = Resumer(self)
        table.listeners.append(self._strand)

    async def __aenter__(self) -> Proxy:
        self.pool = Pool(max_idle_per_host=self.config.connector_limit)
        self._loop = asyncio.get_running_loop()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def _strand(self, old: FleetRoutes | None, new: FleetRoutes) -> None:
        """A domain the view now calls unreachable: fail what is in flight to it (gateway/stranded.py)."""
        if self.pool is None:
            return
        for url, domain in stranded(old, new).items():
            n = self.pool.abandon(url, f"domain {domain!r} is unreachable (its heartbeats went silent)")
            if n:
                log.warning("gateway.stranded", fleet=new.fleet, domain=domain, url=url, requests=n)

    # ------------------------------------------------------------------------------ hot path

    async def handle(self, request: web.BaseRequest, path: str) -> web.StreamResponse:
        headers = request.headers
        fleet = headers.get("X-Haru-Fleet") or self.default_fleet
        if self.table.get(fleet) is None:  # not a fleet's name: perhaps its UUID ("slug or UUID")
            fleet = self.table.fleet_named(fleet) or fleet
        try:
            body = await read_body(request, self.body_timeout, self.max_body)
        except BodyTimeout:
            status, code = REQUEST_TIMEOUT
            self.metrics.request(self._fleet_label(fleet), UNKNOWN_MODEL, status)
            return error_response(
                Refusal(
                    status,
                    code,
                    f"the request body did not arrive within HARU_CLIENT_BODY_TIMEOUT_MS "
                    f"({self.config.client_body_timeout_ms} ms); send it at once, or raise the limit on the gateway",
                ),
                {"Connection": "close"},
            )
        except BodyTooLarge:
            status, code = PAYLOAD_TOO_LARGE
            refusal = Refusal(
                status,
                code,
                f"request body is larger than HARU_CHAT_MAX_BODY_BYTES ({self.max_body} bytes); "
                f"send less, or raise the limit on the gateway",
            )
            self.metrics.request(self._fleet_label(fleet), UNKNOWN_MODEL, status)
            return error_response(refusal, {"Connection": "close"})
        model = model_of(body)
        if not isinstance(model, str):
            self.metrics.request(self._fleet_label(fleet), UNKNOWN_MODEL, model.status)
            return error_response(model)
        result = self.table.resolve(fleet, model, time.time())
        if not isinstance(result, Forward):
            if result.status == 503:  # perhaps a failover cures it: hold
                return await self._held(request, path, body, fleet, model, result)
            label = model if result.code != "model_not_found" and result.code != "fleet_not_found" else UNKNOWN_MODEL
            self.metrics.request(self._fleet_label(fleet), label, result.status)
            return error_response(result)
        return await self._forward(request, path, body, result)

    # ------------------------------------------------------------------ through a failover

    async def _held(
        self, request: web.BaseRequest, path: str, body: bytes, fleet: str, model: str, refusal: Refusal
    ) -> web.StreamResponse:
        """A 503 a failover under way (or about to start) cures: hold the request for the new active."""
        plan = hold_plan(self.table.get(fleet), refusal.code, now=time.time())
        if plan is not None:
            started = time.monotonic()
            outcome = await self.holds.hold(fleet, model, len(body), plan, refusal, _any)
            if isinstance(outcome, Forward):
                held_ms = int((time.monotonic() - started) * 1000)
                return await self._forward(request, path, body, outcome, ((HELD_HEADER, str(held_ms)),))
            refusal = outcome
        self.metrics.request(self._fleet_label(fleet), model, refusal.status)
        return error_response(refusal)

    async def _retry(
        self, request: web.BaseRequest, path: str, body: bytes, fwd: Forward, why: str, refusal: Refusal
    ) -> web.StreamResponse:
        """`fwd`'s domain died before any byte of its response reached the client: send the request
        once more, to the new active (held until there is one) or, when the hold ends with the route
        unmoved, to whatever the fleet routes to then."""
        fleet, model = fwd.fleet, fwd.model
        now_fwd = self.table.resolve(fleet, model, time.time())
        if type(now_fwd) is Forward and (now_fwd.domain != fwd.domain or now_fwd.revision != fwd.revision):
            # the route moved already (a domain failed after the flip it caused was seen): no hold needed
            self.metrics.retried(fleet, why)
            log.info("gateway.retried", fleet=fleet, model=model, first=fwd.domain, then=now_fwd.domain, why=why)
            return await self._forward(
                request, path, body, now_fwd, ((RETRIED_HEADER, f"{fwd.domain}; {why}"),), retry=False
            )
        gone = why == "runtime_gone"  # the domain answered: its runtime is gone, and may come back in place
        plan = hold_plan(
            self.table.get(fleet), refusal.code, unreachable=True, gone=model if gone else "", now=time.time()
        )
        if plan is None:
            self.metrics.request(fleet, model, refusal.status)
            return error_response(refusal)

        since = time.time()

        def moved(f: Forward) -> bool:  # the route moved, or the model came back where it died (a restart)
            return (
                f.domain != fwd.domain
                or f.revision != fwd.revision
                or back_since(self.table.get(fleet), f.domain, f.model, since)
            )

        outcome = await self.holds.hold(fleet, model, len(body), plan, refusal, moved, unreachable=True, gone=gone)
        if not isinstance(outcome, Forward):
            outcome = self.table.resolve(fleet, model, time.time())
            if not isinstance(outcome, Forward):
                self.metrics.request(fleet, model, outcome.status)
                return error_response(outcome)
        self.metrics.retried(fleet, why)
        log.info("gateway.retried", fleet=fleet, model=model, first=fwd.domain, then=outcome.domain, why=why)
        return await self._forward(
            request, path, body, outcome, ((RETRIED_HEADER, f"{fwd.domain}; {why}"),), retry=False
        )

    def _fleet_label(self, fleet: str) -> str:
        """The fleet as a metric label: only fleets that exist, so clients cannot grow the label set."""
        return fleet if self.table.get(fleet) is not None else UNKNOWN_FLEET

    def _header_block(self, request: web.BaseRequest) -> str:
        """The client's headers minus hop-by-hop, framing and credentials, plus the serving token."""
        lines = []
        content_type = False
        for key, value in request.headers.items():
            lower = key.lower()
            if lower in _DROP_REQUEST:
                continue
            if lower == "content-type":
                content_type = True
            lines.append(f"{key}: {value}\r\n")
        if not content_type:
            lines.append("Content-Type: application/json\r\n")
        if self.auth:
            lines.append(self.auth)
        return "".join(lines)

    async def _forward(
        self,
        request: web.BaseRequest,
        path: str,
        body: bytes,
        fwd: Forward,
        extra: tuple[tuple[str, str], ...] = (),
        retry: bool = True,
    ) -> web.StreamResponse:
        fleet, model = fwd.fleet, fwd.model
        ttfb_hist, latency_hist = self.metrics.upstream(fleet, fwd.domain)
        pool = self.pool
        assert pool is not None and self._loop is not None, "the proxy is not started"
        started = time.perf_counter()
        try:
            target = pool.target(fwd.url)
            head = pool.head(target, path, self._header_block(request))
            conn = await pool.request(target, head, body, self._loop.time() + self.header_timeout)
        except TimeoutError:
            status, code = UPSTREAM_TIMEOUT
            self.canary.count(fleet, fwd.domain, model, "upstream_timeout")
            self.metrics.request(fleet, model, status)
            return error_response(
                Refusal(
                    status,
                    code,
                    f"domain {fwd.domain!r} did not send response headers for model {model!r} within "
                    f"HARU_CHAT_HEADER_TIMEOUT_MS ({self.config.header_timeout_ms} ms); a long non-streaming "
                    f"completion only sends headers when it is done: stream it, or raise the timeout",
                    None,
                    None,
                    fwd.domain,
                )
            )
        except UpstreamError as exc:
            status, code = UPSTREAM_UNREACHABLE
            self.canary.count(fleet, fwd.domain, model, f"upstream_unreachable: {exc}")
            log.warning(
                "gateway.upstream_unreachable", fleet=fleet, domain=fwd.domain, model=model, url=fwd.url, error=str(exc)
            )
            refusal = Refusal(
                status,
                code,
                f"domain {fwd.domain!r} is unreachable at {fwd.url} for model {model!r}: {exc}",
                None,
                None,
                fwd.domain,
            )
            if retry:  # nothing of a response reached the client: once more, to a live domain
                return await self._retry(request, path, body, fwd, "unreachable", refusal)
            self.metrics.request(fleet, model, status)
            return error_response(refusal)
        ttfb_hist.observe(time.perf_counter() - started)
        self.canary.count(fleet, fwd.domain, model, f"HTTP {conn.status}" if conn.status >= 500 else "")
        try:
            return await self._respond(request, conn, fwd, started, latency_hist, path, body, extra, retry)
        except _Gone as gone:
            refusal = gone.refusal
        finally:
            conn.release()  # back to the pool when read whole; otherwise closed, which stops the upstream
        return await self._retry(request, path, body, fwd, "runtime_gone", refusal)

    async def _respond(
        self,
        request: web.BaseRequest,
        conn: Connection,
        fwd: Forward,
        started: float,
        latency_hist,
        path: str = "",
        body: bytes = b"",
        extra: tuple[tuple[str, str], ...] = (),
        retry: bool = False,
    ) -> web.StreamResponse:
        status = conn.status
        if (status == 503 or status == 502) and retry:
            await self._check_gone(conn, fwd)
        kept, length, sse, defaults = _response_headers(conn.headers)
        if extra:
            kept[:0] = extra
        if length is not None and length <= self.buffer_limit and not sse:
            try:
                data = await conn.read()
            except UpstreamError as exc:
                return self._broke_off(fwd, exc)
            latency_hist.observe(time.perf_counter() - started)
            self.metrics.request(fwd.fleet, fwd.model, status)
            if status == 200:
                self.metrics.tokens(fwd.fleet, fwd.model, usage_of(data))
            if request.version == HttpVersion11 and 200 <= status and status not in (204, 304):
                return _Whole(status, kept, defaults, fwd.domain, data, request.keep_alive)
            out_headers = CIMultiDict(kept)
            out_headers["X-Haru-Domain"] = fwd.domain
            return web.Response(body=data, status=status, headers=out_headers)

        if (
            conn.complete
            and conn.error is None
            and request.version == HttpVersion11
            and 200 <= status
            and status not in (204, 304)
        ):
            # The whole stream came with the head (a short answer, or a fast upstream): one write,
            # framed as it would have been streamed (chunked, or the upstream's Content-Length).
            data = await conn.read()
            latency_hist.observe(time.perf_counter() - started)
            self.metrics.request(fwd.fleet, fwd.model, status)
            if status == 200:
                self.metrics.tokens(fwd.fleet, fwd.model, _usage(data, sse))
            self.metrics.streams(fwd.fleet)  # the fleet's in-flight series exists, at 0: nothing is left to stream
            return _Whole(status, kept, defaults, fwd.domain, data, request.keep_alive, chunked=length is None)

        if conn.error is not None and not conn.chunks:
            # The body was malformed from its first bytes and nothing has gone to the client yet: an
            # honest 502 rather than a 200 that breaks off.
            return self._broke_off(fwd, conn.error)
        # Body bytes came with the head: the head is held back and sent with them, one write instead
        # of two (with none waiting, the head goes at once, as the upstream sent it).
        hold = bool(conn.chunks) or conn.complete
        response: web.StreamResponse
        if request.version == HttpVersion11 and 200 <= status and status not in (204, 304):
            response = _Stream(status, kept, defaults, fwd.domain, request.keep_alive, length, hold)
        else:
            out_headers = CIMultiDict(kept)
            out_headers["X-Haru-Domain"] = fwd.domain
            response = web.StreamResponse(status=status, headers=out_headers)
            if length is not None:
                response.content_length = length  # keep the upstream's framing: no chunking of a sized body
            if hold:
                response._send_headers_immediately = False
        gauge = self.metrics.streams(fwd.fleet)
        gauge.inc()
        self.metrics.request(fwd.fleet, fwd.model, status)
        try:
            await response.prepare(request)
            if sse and status == 200 and path == _CHAT:  # a streamed chat completion: it survives a cut
                if await self.resumer.relay(request, response, conn, fwd, body, path):
                    latency_hist.observe(time.perf_counter() - started)
                return response
            tap = UsageTap() if status == 200 else None
            try:
                if await _pump(request, response, conn, fwd, tap, sse):
                    latency_hist.observe(time.perf_counter() - started)
            finally:
                if tap is not None:
                    self.metrics.tokens(fwd.fleet, fwd.model, tap.usage)
            return response
        except ConnectionError:
            return response  # the client went away: release() in _forward closes the upstream
        finally:
            gauge.dec()

    async def _check_gone(self, conn: Connection, fwd: Forward) -> None:
        """Raise _Gone when a 502/503 is the serving port saying the runtime is gone (read whole: small)."""
        reason = ""
        for key, value in conn.headers:
            if key.lower() == GONE_HEADER:
                reason = value
                break
        if not reason:
            return
        try:
            data = await conn.read()
        except UpstreamError:
            data = b""
        code = "model_lost"
        message = f"domain {fwd.domain!r}: the runtime of model {fwd.model!r} is gone ({reason})"
        with contextlib.suppress(msgspec.DecodeError, TypeError, AttributeError, KeyError):
            err = msgspec.json.decode(data)["error"]
            code, message = str(err.get("code") or code), str(err.get("message") or message)
        raise _Gone(Refusal(conn.status, code, message, None, "model", fwd.domain))

    def _broke_off(self, fwd: Forward, exc: BaseException) -> web.Response:
        status, code = UPSTREAM_UNREACHABLE
        self.metrics.request(fwd.fleet, fwd.model, status)
        return error_response(
            Refusal(
                status,
                code,
                f"domain {fwd.domain!r} broke off its response for model {fwd.model!r}: {exc}",
                None,
                None,
                fwd.domain,
            )
        )


def _any(fwd: Forward) -> bool:
    return True


def _response_headers(headers: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], int | None, bool, int]:
    """The upstream's headers a client gets (hop-by-hop and ours dropped), its Content-Length, whether
    it is an event stream, and which of Date, Server, Content-Type it sent (bits 1, 2, 4)."""
    kept: list[tuple[str, str]] = []
    length: int | None = None
    sse = False
    defaults = 0
    for key, value in headers:
        lower = key.lower()
        if lower in _DROP_RESPONSE:
            if lower == "content-length":
                length = int(value)
            continue
        if lower in _DEFAULTED:
            if lower == "content-type" and value.startswith("text/event-stream"):
                sse = True
            defaults |= _DEFAULTED[lower]
        elif lower == "x-haru-domain":
            continue  # ours, set by the response
        kept.append((key, value))
    return kept, length, sse, defaults


def _usage(data: bytes, sse: bool):
    """The `usage` of a whole response body, SSE or JSON."""
    if not sse:
        return usage_of(data)
    tap = UsageTap()
    tap.feed(data)
    return tap.usage


async def _pump(
    request: web.BaseRequest,
    response: web.StreamResponse,
    conn: Connection,
    fwd: Forward,
    tap: UsageTap | None = None,
    sse: bool = False,
) -> bool:
    """Stream the upstream's body to the client until its end (True), or until the upstream breaks
    off (False: the client's connection is closed without the final chunk, a truncated stream rather
    than a clean end, since the headers are gone already). `tap` reads the usage the body carries
    (SSE events, or a JSON body gathered whole: an unsized one, rare)."""
    whole: list[bytes] | None = [] if tap is not None and not sse else None
    while True:
        try:
            chunk = await conn.next()
        except UpstreamError as exc:
            log.warning(
                "gateway.upstream_broke_stream", fleet=fwd.fleet, domain=fwd.domain, model=fwd.model, error=str(exc)
            )
            if request.transport is not None:
                request.transport.close()
            return False
        if tap is not None:
            if whole is None:
                tap.feed(chunk)
            elif chunk and sum(map(len, whole)) < 1 << 20:
                whole.append(chunk)
        if not chunk or (conn.complete and not conn.chunks):
            if whole:
                tap.usage = usage_of(b"".join(whole))  # type: ignore[union-attr]
            if not chunk:
                await response.write_eof()
            else:
                await response.write_eof(chunk)  # the last bytes and the terminator in one write
            return True
        await response.write(chunk)
