"""The proxy's responses: what a client gets back, framed and written by the gateway itself.

    Whole(...)              a sized response, head and body in one transport write
    Stream(...)             a streamed response (chunked, or as it came under the upstream's length)
    response_headers(h)     the upstream's headers a client gets, its length, SSE or not, what it defaulted
    pump(request, resp, conn, fwd)   an upstream body streamed to the client to its end
    error_response(refusal)          a refusal in OpenAI's shape, with its headers

Split from gateway/proxy.py, which decides where a request goes; this module only writes what comes
back. What `web.Response`/`web.StreamResponse` would send, header for header, without their per-response
preparation (docs/gateway.md, "What the proxy costs").
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

import structlog
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE

from haru.gateway.errors import UpstreamError
from haru.gateway.routing import Forward, Refusal
from haru.gateway.upstream import Connection
from haru.gateway.usage import UsageTap, usage_of

__all__ = ["Stream", "Whole", "error_response", "pump", "response_headers", "usage_in"]

log = structlog.get_logger("haru.gateway")

# Response headers not copied back: hop-by-hop and framing (aiohttp frames the response itself).
_DROP_RESPONSE = frozenset(
    {"content-length", "transfer-encoding", "connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade"}
)

# Response headers aiohttp adds when the upstream sent none (Date, Server, a Content-Type for a body).
_DEFAULTED = {"date": 1, "server": 2, "content-type": 4}
_REASONS = {int(s): s.phrase for s in HTTPStatus}


class Whole(web.StreamResponse):
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


class Stream(web.StreamResponse):
    """A streamed response framed and written by the proxy, straight to the transport.

    What `web.StreamResponse` would send (the same head as `Whole`'s; chunked, or as it came under
    the upstream's Content-Length), without its per-response header preparation and per-write
    bookkeeping. With `hold`, the head waits for the first body bytes and goes out with them in one
    write. A client that went away makes a write raise ConnectionResetError, as aiohttp's does.
    HTTP/1.1 clients and statuses that carry a body only, as `Whole`.
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
    """The head of a `Whole` or `Stream` response, up to `Content-Length: ` (or through
    `Transfer-Encoding: chunked` and the blank line). Cached: an upstream repeats its header set from
    response to response, its Date changing once a second (`Whole` 1.57 -> 1.10 us, issue 20); a
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


def response_headers(headers: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], int | None, bool, int]:
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


def usage_in(data: bytes, sse: bool):
    """The `usage` of a whole response body, SSE or JSON."""
    if not sse:
        return usage_of(data)
    tap = UsageTap()
    tap.feed(data)
    return tap.usage


async def pump(
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
