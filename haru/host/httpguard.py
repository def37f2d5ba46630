"""Slow and idle clients cannot hold an HTTP port: what the gateway and the agent's serving port share.

    server = GuardedServer(handler, limits=ClientLimits.from_env(os.environ), handler_cancellation=True)
    body = await read_body(request, limits.body_timeout_s, max_bytes)   # raises BodyTimeout / BodyTooLarge

Three bounds, each from configuration (docs/configuration.md, "Environment variables"):

- **header timeout** (`HARU_CLIENT_HEADER_TIMEOUT_MS`, default 15 s): a connection has this long to
  send a complete request head, when it opens and again after each response. It is aiohttp's
  keep-alive timer, which runs from the connection's start (or the last response) and closes the
  connection if no whole request head arrived by then, however many bytes trickled in (a
  slowloris). An idle keep-alive connection is closed after the same time.
- **body timeout** (`HARU_CLIENT_BODY_TIMEOUT_MS`, default 30 s): once the head is in, the whole
  body must arrive within this; otherwise the answer is a 408 and the connection is closed.
- **idle cap** (`HARU_CLIENT_MAX_IDLE`, default 512): at most this many connections may be waiting
  for a request head at once. A new connection beyond it closes the one that has waited longest,
  so slow clients can never hold every slot: a normal client always gets in.

Also here: `too_deep`, for the JSON bodies msgspec refuses with a RecursionError (a body nested
10,000 deep): both ports answer it with a 400 in OpenAI's error shape instead of a 500.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from haru.core.errors import ConfigError

__all__ = ["ClientLimits", "GuardedServer", "BodyTimeout", "BodyTooLarge", "read_body", "env_int"]

DEFAULT_HEADER_TIMEOUT_MS = 15_000
DEFAULT_BODY_TIMEOUT_MS = 30_000
DEFAULT_MAX_IDLE = 512
LINGER_S = 1.0


@dataclass(frozen=True, slots=True)
class ClientLimits:
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_MS / 1000
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_MS / 1000
    max_idle: int = DEFAULT_MAX_IDLE

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ClientLimits:
        return cls(
            header_timeout_s=env_int(env, "HARU_CLIENT_HEADER_TIMEOUT_MS", DEFAULT_HEADER_TIMEOUT_MS, 1) / 1000,
            body_timeout_s=env_int(env, "HARU_CLIENT_BODY_TIMEOUT_MS", DEFAULT_BODY_TIMEOUT_MS, 1) / 1000,
            max_idle=env_int(env, "HARU_CLIENT_MAX_IDLE", DEFAULT_MAX_IDLE, 1),
        )


def env_int(env: Mapping[str, str], name: str, default: int, minimum: int = 0) -> int:
    """An integer setting from the environment: `default` when unset, a ConfigError naming it when not a
    whole number or below `minimum`."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer; set it to a whole number or unset it") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} is below {minimum}; set a larger value or unset it")
    return value


def _waiting_for_head(handler: web.RequestHandler) -> bool:
    """No request being handled: the connection is new, between requests, or its head is incomplete
    (aiohttp's RequestHandler sets `_request_in_progress` around each request's handler, response
    included, so a long stream is never counted idle)."""
    return not getattr(handler, "_request_in_progress", True) and not getattr(handler, "_force_close", False)


class GuardedServer(web.Server):
    """aiohttp's low-level `web.Server` with the header timeout and the idle cap of `limits`."""

    def __init__(self, handler: Any, *, limits: ClientLimits, **kwargs: Any) -> None:
        # lingering_time: after an answer sent before the body was read whole (a 408, a 413) aiohttp
        # reads and drops what the client still sends before closing, 10 s by default: long enough
        # for a slow body to hold the connection again. One second still lets a fast client that is
        # mid-upload see the answer instead of a reset.
        kwargs.setdefault("lingering_time", LINGER_S)
        super().__init__(handler, keepalive_timeout=limits.header_timeout_s, **kwargs)
        self.limits = limits
        self.idle_closed = 0  # connections closed to stay under the idle cap

    def connection_made(self, handler: web.RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        idle = [h for h in self._connections if h is not handler and _waiting_for_head(h)]
        excess = len(idle) + 1 - self.limits.max_idle
        if excess <= 0:
            return
        # The ones that have waited longest go first (their keep-alive deadline is the earliest).
        idle.sort(key=lambda h: getattr(h, "_next_keepalive_close_time", 0.0))
        for h in idle[:excess]:
            self.idle_closed += 1
            h.force_close()


class BodyTimeout(Exception):
    """The body did not arrive within the body timeout."""


class BodyTooLarge(Exception):
    """The body is over the size limit."""


async def read_body(request: web.BaseRequest, timeout_s: float, max_bytes: int) -> bytes:
    """The whole body, within `timeout_s` and `max_bytes` (checked from Content-Length first, before any
    "100 Continue", then while reading). A body already received is taken without a timer."""
    length = request.content_length
    content = request.content
    if length is not None and length > max_bytes:
        raise BodyTooLarge  # before "100 Continue": a client that asked will not send the body at all
    if length is not None and content.is_eof():
        # all here: no timer to set, nothing to wait for (read_nowait: no coroutine chain)
        if not length:
            return b""
        data = content.read_nowait()
        if len(data) == length:
            return data
        return data + await content.readexactly(length - len(data))  # raises as before on a short body
    try:
        async with asyncio.timeout(timeout_s):
            await continue_if_expected(request)
            if length is not None:
                return await content.readexactly(length) if length else b""
            chunks: list[bytes] = []
            size = 0
            while True:
                chunk = await content.readany()
                if not chunk:
                    return b"".join(chunks)
                size += len(chunk)
                if size > max_bytes:
                    raise BodyTooLarge
                chunks.append(chunk)
    except TimeoutError:
        raise BodyTimeout from None


async def continue_if_expected(request: web.BaseRequest) -> None:
    """Answer `Expect: 100-continue` (curl sends it for bodies over 1 KiB and waits 1 s otherwise).

    aiohttp's router does this for its routes; the low-level server leaves it to the handler.
    """
    if request.version >= (1, 1) and request.headers.get("Expect", "").lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0
