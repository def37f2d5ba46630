"""The proxy's upstream client: keep-alive HTTP/1.1 connections over asyncio protocols, pooled per
(scheme, host, port), with the response body handed over piece by piece as it arrives.

    pool = Pool()
    head = pool.head(target, path, header_lines)           # bytes, up to `Content-Length: `
    resp = await pool.request(target, head, body, deadline)  # returns at the response head
    data = await resp.read()                              # or: while piece := await resp.next(): ...
    resp.release()                                        # back to the pool when complete, else closed

The caller gives a deadline for the head (HARU_CHAT_HEADER_TIMEOUT_MS), kept by one timer handle, and
nothing bounds a body, so a quiet stream is never cut. Cancelling a waiter closes the connection, so
the upstream sees the client go. Reading pauses while more than `HIGH_WATER` bytes wait unread (a
slow client slows the upstream instead of filling memory).

Idle connections are reused for at most `IDLE_REUSE_S` (uvicorn, under vLLM, closes idle ones after
5 s); a reused connection that closes before answering a single byte is retried once on a fresh one.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl as ssl_module
import time
from urllib.parse import urlsplit

from haru.gateway.errors import ProtocolError, UpstreamError
from haru.gateway.http1 import Headers, ResponseParser

HIGH_WATER = 1 << 20
LOW_WATER = 1 << 18
IDLE_REUSE_S = 2.0


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class Address:
    """Where to send: parsed once per distinct URL and cached by the pool."""

    __slots__ = ("key", "host", "port", "ssl", "path_prefix", "host_header")

    def __init__(self, base: str) -> None:
        parts = urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamError(f"{base!r} is not an http(s) URL")
        self.ssl = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.ssl else 80)
        self.key = (self.ssl, self.host, self.port)
        self.path_prefix = parts.path.rstrip("/")
        default = 443 if self.ssl else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if self.port == default else f"{host}:{self.port}"


class Connection(asyncio.Protocol):
    """One upstream connection carrying one request at a time."""

    def __init__(self, pool: Pool, key: tuple) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser: ResponseParser | None = None  # the response in progress; None while idle
        self._spare: ResponseParser | None = None  # reused for the next response on this connection
        self.head: asyncio.Future | None = None
        self.status = 0
        self.headers: Headers = []
        self.keep_alive = False
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.waiter: asyncio.Future | None = None
        self.complete = False
        self.error: BaseException | None = None
        self.closed = False
        self.paused = False
        self.reused = False
        self.idle_since = 0.0

    # --------------------------------------------------------------------------- protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None:  # bytes on an idle connection: it cannot be trusted any more
            self.close()
            return
        try:
            parser.feed(data)
        except ProtocolError as exc:
            self._fail(UpstreamError(f"the upstream sent a malformed response: {exc}"))
            self.close()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        parser = self.parser
        if parser is not None and not parser.done:
            try:
                parser.eof()
            except ProtocolError as err:
                e = UpstreamError(str(err))
                e.retryable = self.reused and not parser.started
                self._fail(e)

    # ------------------------------------------------------------------------- callbacks

    def _on_head(self, status: int, headers: Headers, keep_alive: bool) -> None:
        self.status, self.headers, self.keep_alive = status, headers, keep_alive
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def _on_data(self, data: bytes) -> None:
        self.chunks.append(data)
        self.buffered += len(data)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def _on_end(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        if self.head is not None and not self.head.done():
            self.head.set_exception(exc)
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -------------------------------------------------------------------------- request

    def send(self, data: bytes) -> asyncio.Future:
        loop = self.pool.loop
        parser = self._spare
        if parser is None:
            parser = self._spare = ResponseParser(self._on_head, self._on_data, self._on_end)
        else:
            parser.reset()
        self.parser = parser
        self.head = loop.create_future()
        self.status, self.headers, self.keep_alive = 0, [], False
        self.complete = False
        self.error = None
        self.chunks.clear()
        self.buffered = 0
        assert self.transport is not None
        self.transport.write(data)
        return self.head

    async def next(self) -> bytes:
        """The body received since the last call (waiting for some if none); b'' at its end.

        Raises UpstreamError if the upstream breaks off.
        """
        while True:
            chunks = self.chunks
            if chunks:
                # everything that has arrived, as one piece: fewer writes downstream, no added wait
                piece = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self.buffered = 0
                if self.paused and self.buffered < LOW_WATER and self.transport is not None:
                    self.paused = False
                    self.transport.resume_reading()
                return piece
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            self.waiter = self.pool.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    async def read(self) -> bytes:
        pieces = []
        while piece := await self.next():
            pieces.append(piece)
        return b"".join(pieces)

    def release(self) -> None:
        """Back to the pool if the response was read whole and the connection may be kept; else closed."""
        if self.complete and self.keep_alive and not self.closed and self.error is None and not self.chunks:
            self.parser = None
            self.head = None
            self.pool._put(self)
        else:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
            self.pool._forget(self)

    def abandon(self, why: str) -> None:
        """Fail the request in flight with UpstreamError(why) and drop the connection without flushing
        (its peer is unreachable: a graceful close would wait on it)."""
        self._fail(UpstreamError(why))
        transport = self.transport
        self.close()
        if transport is not None:
            transport.abort()


class Pool:
    """Idle keep-alive connections per (ssl, host, port), most recently used first.

    Created inside the event loop it serves, and keeps that loop: `asyncio.get_running_loop()` costs
    a getpid() system call each time on Python < 3.12 (two a request, issue 20).
    """

    def __init__(self, *, max_idle_per_host: int = 1024) -> None:
        self.loop = asyncio.get_running_loop()
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[tuple, list[Connection]] = {}
        self._targets: dict[str, Address] = {}
        self._open_by_key: dict[tuple, set[Connection]] = {}  # every open connection, for `abandon`
        self._ssl: ssl_module.SSLContext | None = None
        self.opened = 0  # connections opened, for tests and /healthz

    def target(self, base: str) -> Address:
        t = self._targets.get(base)
        if t is None:
            t = self._targets[base] = Address(base)
        return t

    def head(self, target: Address, path: str, header_block: str) -> bytes:
        """The request head up to and including `Content-Length: ` (the body's length follows)."""
        return (
            f"POST {target.path_prefix}{path} HTTP/1.1\r\nHost: {target.host_header}\r\n{header_block}Content-Length: "
        ).encode("utf-8", "surrogateescape")  # the bytes aiohttp decoded the client's headers from

    async def request(self, target: Address, head: bytes, body: bytes, deadline: float) -> Connection:
        """Send `head` (from `Pool.head`) and `body`; return at the response head.

        Raises TimeoutError when no response head arrived by `deadline` (the event loop's clock,
        `loop.time()`), connecting included. The bound is one timer handle on the loop, not an
        `asyncio.timeout` scope (~9 us a request, issue 20); a scope only guards the rare connect.
        """
        loop = self.loop
        data = b"%b%d\r\n\r\n%b" % (head, len(body), body)
        for attempt in (0, 1):
            # The retry never takes another idle connection: an upstream that closed one (a restart,
            # an agent draining) has usually closed all it had, and they fail the same way.
            conn = self._get(target.key) if attempt == 0 else None
            if conn is None:
                try:
                    async with asyncio.timeout_at(deadline):
                        conn = await self._open(target)
                except TimeoutError:
                    raise TimeoutError from None
            waiter = conn.send(data)
            timer = loop.call_at(deadline, _expire, waiter)
            try:
                await waiter
                return conn
            except UpstreamError as exc:
                conn.close()
                if attempt == 0 and exc.retryable:
                    continue  # a kept-alive connection the upstream had closed: once more, fresh
                raise
            except BaseException:
                conn.close()  # cancelled (client gone), or the header deadline: the upstream sees it
                raise
            finally:
                timer.cancel()
        raise AssertionError("unreachable")

    async def _open(self, target: Address) -> Connection:
        loop = self.loop
        ssl_ctx = None
        if target.ssl:
            if self._ssl is None:
                self._ssl = ssl_module.create_default_context()
            ssl_ctx = self._ssl
        try:
            _, conn = await loop.create_connection(
                lambda: Connection(self, target.key),
                target.host,
                target.port,
                ssl=ssl_ctx,
                server_hostname=target.host if ssl_ctx else None,
            )
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {target.host_header}: {exc.strerror or exc}") from exc
        self.opened += 1
        self._open_by_key.setdefault(target.key, set()).add(conn)
        return conn

    def _get(self, key: tuple) -> Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                conn.close()
                continue
            if now - conn.idle_since > IDLE_REUSE_S:
                conn.close()
                continue
            conn.reused = True
            return conn
        return None

    def _put(self, conn: Connection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self.max_idle_per_host:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def _forget(self, conn: Connection) -> None:
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
        open_ = self._open_by_key.get(conn.key)
        if open_ is not None:
            open_.discard(conn)
            if not open_:
                del self._open_by_key[conn.key]

    def abandon(self, base: str, why: str) -> int:
        """Fail every request in flight to `base` (a serving URL) and drop its connections, idle ones
        too; returns how many requests were failed."""
        failed = 0
        for conn in list(self._open_by_key.get(self.target(base).key, ())):
            if conn.parser is not None and not conn.complete:
                failed += 1
            conn.abandon(why)
        return failed

    def idle_count(self) -> int:
        return sum(len(v) for v in self._idle.values())

    def close(self) -> None:
        for idle in list(self._idle.values()):
            for conn in list(idle):
                conn.close()
        self._idle.clear()
