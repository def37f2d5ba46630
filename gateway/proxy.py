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

import msgspec
import structlog
from aiohttp import web
from aiohttp.http import HttpVersion11
from multidict import CIMultiDict

from haru.core.openai_errors import PAYLOAD_TOO_LARGE, REQUEST_TIMEOUT, UPSTREAM_TIMEOUT, UPSTREAM_UNREACHABLE
from haru.gateway.adapters import with_model
from haru.gateway.canary import CanaryCounts
from haru.gateway.config import GatewayConfig
from haru.gateway.errors import UpstreamError
from haru.gateway.hold import Holds, back_since, heard_again, hold_plan
from haru.gateway.metrics import UNKNOWN_FLEET, UNKNOWN_MODEL, GatewayMetrics
from haru.gateway.responses import Stream, Whole, error_response, pump, response_headers, usage_in
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
    """The domain's serving port answered 502/503 for a runtime that is gone (`why` "runtime_gone"), or
    the domain broke off a whole response while it was read ("unreachable": a connection dropped, or a
    request failed because the view calls the domain unreachable), before any byte reached the client:
    the request may go once more to a live domain (control flow inside the proxy)."""

    def __init__(self, refusal: Refusal, why: str = "runtime_gone") -> None:
        self.refusal = refusal
        self.why = why


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
        judged = [False]  # whether the view called fwd's domain unreachable during the hold

        def moved(f: Forward) -> bool:
            """The route moved, or the model came back where it died (a restart), or the domain it died on
            was heard again after its heartbeats went silent (its serving link may never have broken)."""
            routes = self.table.get(fleet)
            return (
                f.domain != fwd.domain
                or f.revision != fwd.revision
                or back_since(routes, f.domain, f.model, since)
                or heard_again(routes, f.domain, judged)
            )

        heard_again(self.table.get(fleet), fwd.domain, judged)  # stranded: judged unreachable already

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
        counted = model
        if fwd.body_model:  # a LoRA adapter: the runtime is sent the version's name (gateway.adapters), and
            body, counted = with_model(body, fwd.body_model), fwd.body_model  # a canary's errors count per version
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
            self.canary.count(fleet, fwd.domain, counted, "upstream_timeout")
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
            self.canary.count(fleet, fwd.domain, counted, f"upstream_unreachable: {exc}")
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
        self.canary.count(fleet, fwd.domain, counted, f"HTTP {conn.status}" if conn.status >= 500 else "")
        try:
            return await self._respond(request, conn, fwd, started, latency_hist, path, body, extra, retry)
        except _Gone as gone:
            refusal, why = gone.refusal, gone.why
        finally:
            conn.release()  # back to the pool when read whole; otherwise closed, which stops the upstream
        return await self._retry(request, path, body, fwd, why, refusal)

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
        kept, length, sse, defaults = response_headers(conn.headers)
        if extra:
            kept[:0] = extra
        if length is not None and length <= self.buffer_limit and not sse:
            try:
                data = await conn.read()
            except UpstreamError as exc:
                if retry:  # nothing of the response reached the client: once more, to a live domain
                    raise _Gone(self._broken(fwd, exc), why="unreachable") from exc
                return self._broke_off(fwd, exc)
            latency_hist.observe(time.perf_counter() - started)
            self.metrics.request(fwd.fleet, fwd.model, status)
            if status == 200:
                self.metrics.tokens(fwd.fleet, fwd.model, usage_of(data))
            if request.version == HttpVersion11 and 200 <= status and status not in (204, 304):
                return Whole(status, kept, defaults, fwd.domain, data, request.keep_alive)
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
                self.metrics.tokens(fwd.fleet, fwd.model, usage_in(data, sse))
            self.metrics.streams(fwd.fleet)  # the fleet's in-flight series exists, at 0: nothing is left to stream
            return Whole(status, kept, defaults, fwd.domain, data, request.keep_alive, chunked=length is None)

        if conn.error is not None and not conn.chunks:
            # The body was malformed from its first bytes and nothing has gone to the client yet: an
            # honest 502 rather than a 200 that breaks off.
            return self._broke_off(fwd, conn.error)
        # Body bytes came with the head: the head is held back and sent with them, one write instead
        # of two (with none waiting, the head goes at once, as the upstream sent it).
        hold = bool(conn.chunks) or conn.complete
        response: web.StreamResponse
        if request.version == HttpVersion11 and 200 <= status and status not in (204, 304):
            response = Stream(status, kept, defaults, fwd.domain, request.keep_alive, length, hold)
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
                if await pump(request, response, conn, fwd, tap, sse):
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
        # "asleep": the domain was put to sleep (a standby now) while this gateway still routed to it
        why = "asleep" if reason == "asleep" else "runtime_gone"
        raise _Gone(Refusal(conn.status, code, message, None, "model", fwd.domain), why)

    def _broke_off(self, fwd: Forward, exc: BaseException) -> web.Response:
        refusal = self._broken(fwd, exc)
        self.metrics.request(fwd.fleet, fwd.model, refusal.status)
        return error_response(refusal)

    @staticmethod
    def _broken(fwd: Forward, exc: BaseException) -> Refusal:
        status, code = UPSTREAM_UNREACHABLE
        return Refusal(
            status,
            code,
            f"domain {fwd.domain!r} broke off its response for model {fwd.model!r}: {exc}",
            None,
            None,
            fwd.domain,
        )


def _any(fwd: Forward) -> bool:
    return True
