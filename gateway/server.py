"""The gateway process: one aiohttp low-level `web.Server` serving the chat proxy and the control API.

    async with Gateway(config, events) as gw:       # binds, follows views/intents, serves
        print(gw.url)
        await stop.wait()

or, as `haru gateway` does it, `await run_gateway(servers, config)` (connects to NATS, serves until
SIGINT/SIGTERM).

Why the low-level server: the router Application with its middleware chain costs measurable CPU
per request at 32 connections (docs/design.md, "Facts the code relies on"); the gateway has a dozen fixed paths, so one
dispatch function with a dict look-up for the chat paths does the same job. Handlers run with
`handler_cancellation`, so a client that disconnects cancels its handler and with it the upstream
request.

Auth: with HARU_API_TOKEN set, every path but /healthz needs `Authorization: Bearer <token>`,
compared with hmac.compare_digest. Without it the gateway binds 127.0.0.1 whatever --host says and
logs a loud warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import signal
import socket

import structlog
from aiohttp import web

from haru.core.openai_errors import error_body
from haru.gateway.canary import Reporter
from haru.gateway.config import GatewayConfig
from haru.gateway.console import Console
from haru.gateway.control import Control
from haru.gateway.errors import ApiError
from haru.gateway.metrics import GatewayMetrics
from haru.gateway.proxy import CHAT_PATHS, Proxy
from haru.gateway.routing import Refusal, RoutingTable
from haru.gateway.state import RouteFollower
from haru.gateway.usage_log import Ledger, UsageWriter
from haru.gateway.weights_api import post_weights
from haru.host.httpguard import GuardedServer
from haru.log.receipts import RegressionCollector
from haru.log.router_reports import RouterReports
from haru.log.seam import Log

log = structlog.get_logger("haru.gateway")

_FLEET_PREFIX = "/v1/fleets/"


def _api_error_response(err: ApiError) -> web.Response:
    headers = {"Content-Type": "application/json"}
    if err.retry_after is not None:
        headers["Retry-After"] = str(err.retry_after)
    if err.status < 500 and err.status != 429:
        headers["x-should-retry"] = "false"
    return web.Response(
        body=error_body(err.status, err.code, err.message, err.param), status=err.status, headers=headers
    )


class Gateway:
    """One gateway: routing table, metrics, upstream session, NATS followers and the HTTP server.

    `events` is a connected `haru.log.eventlog.EventLog` (the caller owns it); None runs the gateway on
    a routing table the caller fills (`gw.table.set_view/set_intent`), with no control API writes.
    """

    def __init__(self, config: GatewayConfig, events: Log | None = None) -> None:
        self.config = config
        self.events = events
        self.table = RoutingTable()
        self.metrics = GatewayMetrics()
        guard = getattr(events, "receipt_guard", None)  # the JetStream log's (an in-memory log never forgets)
        if guard is not None:
            self.metrics.registry.register(RegressionCollector(guard))  # haru_log_regressions_total
        self.proxy = Proxy(config, self.table, self.metrics)
        self.follower = (
            RouteFollower(events, self.table, self.metrics, resync_s=config.resync_ms / 1000)
            if events is not None
            else None
        )
        self.control = Control(
            events, self.table, self.metrics, default_fleet=config.default_fleet, follower=self.follower
        )
        self.control.authorized = self._authorized
        self._expected_auth = config.api_token.encode() if config.api_token else b""
        # The web console (/ui) is fed by the follower's changes: one fan-out for every open console.
        self.console = Console(self.table, events)
        if self.follower is not None:
            self.follower.on_change = self._changed
            heard = self.follower.alive
            self.proxy.holds.promoter_heard = lambda: bool(heard.alive("promoter"))
        self._stack: contextlib.AsyncExitStack | None = None
        self.reporter: Reporter | None = None
        self.usage: UsageWriter | None = None
        self._runner: web.ServerRunner | None = None
        self._server: GuardedServer | None = None
        self.host = config.bind_host()
        self.port = 0
        self._get_routes = {
            "/healthz": self.control.healthz,
            "/metrics": self.control.metrics_text,
            "/residency": self.control.residency,
            "/v1/models": self.control.models,
            "/v1/fleets": self.control.fleets,
        }

    def gateway_id(self) -> str:
        """This gateway's name in its canary reports' subject: its writer id, else host and pid."""
        writer = getattr(self.events, "writer", "") if self.events is not None else ""
        return writer or f"gateway:{socket.gethostname()}:{os.getpid()}"

    def _changed(self, fleet: str) -> None:
        """A fleet's routes changed: held requests look again, open consoles are told."""
        self.proxy.holds.changed(fleet)
        self.console.changed(fleet)

    @property
    def url(self) -> str:
        """A URL that reaches this gateway from this machine (loopback when bound to every address)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(self.host, self.host)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    # ------------------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        cfg = self.config
        if cfg.open:
            asked = f" (asked for {cfg.host!r})" if cfg.host != self.host else ""
            log.warning(
                "gateway.UNAUTHENTICATED",
                message="HARU_API_TOKEN is not set: the gateway is OPEN to anyone who can reach it, so it binds "
                f"{self.host} only{asked}. Set HARU_API_TOKEN to serve beyond this machine.",
            )
        stack = contextlib.AsyncExitStack()
        try:
            await stack.enter_async_context(self.proxy)
            if self.follower is not None:
                await stack.enter_async_context(self.follower)
            if self.events is not None:  # what it measured of weighted domains, for the promoter's canary policy
                self.reporter = Reporter(
                    self.events.bus,
                    self.table,
                    self.proxy.canary,
                    self.gateway_id(),
                    interval_s=cfg.canary_report_ms / 1000,
                )
                await stack.enter_async_context(self.reporter)
                # the tokens it serves, recorded in the log for the accounting (docs/cost.md)
                self.metrics.ledger = Ledger()
                self.usage = UsageWriter(
                    self.events, self.metrics.ledger, self.gateway_id(), interval_s=cfg.usage_flush_ms / 1000
                )
                await stack.enter_async_context(self.usage)
                # the route followers' reports, for the console's routers panel (haru.log.router_reports)
                self.console.routers = RouterReports()
                routers = await self.console.routers.listen(self.events.bus)
                stack.push_async_callback(routers.unsubscribe)
            server = GuardedServer(
                self.dispatch,
                limits=cfg.client_limits,
                handler_cancellation=True,
                access_log=None,
                # a request's head only; the body limit is HARU_CHAT_MAX_BODY_BYTES, enforced by the proxy
                max_field_size=65536,
            )
            runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=5.0)
            await runner.setup()
            stack.push_async_callback(runner.cleanup)
            stack.callback(self.console.close)  # open event streams end before the runner waits for them
            site = web.TCPSite(runner, self.host, cfg.port, backlog=1024, reuse_address=True)
            await site.start()
            self._runner = runner
            self.port = runner.addresses[0][1] if runner.addresses else cfg.port
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        log.info(
            "gateway.listening",
            url=self.url,
            auth=not cfg.open,
            default_fleet=cfg.default_fleet,
            max_body_bytes=cfg.max_body_bytes,
            header_timeout_ms=cfg.header_timeout_ms,
            client_limits=str(cfg.client_limits),
        )
        self._server = server

    async def stop(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    # ------------------------------------------------------------------------------- dispatch

    def _authorized(self, request: web.BaseRequest) -> bool:
        """`Authorization: Bearer <token>`, the scheme in any case (RFC 9110 says it is case-insensitive)."""
        expected = self._expected_auth
        if not expected:
            return True
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected)

    async def dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        method = request.method
        if path == "/healthz":
            return await self.control.healthz(request)
        if path.startswith("/ui") and (page := self.console.static(path)) is not None:
            return page  # the console's own files carry no data: the data behind them needs the token
        if not self._authorized(request):
            return _api_error_response(
                ApiError(
                    401,
                    "invalid_api_key",
                    "missing or wrong bearer token: send `Authorization: Bearer <HARU_API_TOKEN>`",
                )
            )
        if path in CHAT_PATHS:
            if method != "POST":
                return _method_not_allowed(path, "POST")
            return await self.proxy.handle(request, path)
        try:
            return await self._control(request, path, method)
        except ApiError as err:
            return _api_error_response(err)

    async def _control(self, request: web.BaseRequest, path: str, method: str) -> web.StreamResponse:
        handler = self._get_routes.get(path)
        if handler is not None:
            if method not in ("GET", "HEAD"):
                return _method_not_allowed(path, "GET")
            return await handler(request)
        if path.startswith("/ui/"):
            return await self.console.handle(request, path, method)
        if path.startswith(_FLEET_PREFIX):
            parts = path[len(_FLEET_PREFIX) :].split("/")
            fleet = parts[0]
            rest = "/".join(parts[1:])
            if rest == "":
                return await self._only("GET", method, path) or await self.control.fleet_view(request, fleet)
            if rest == "route-intent":
                return await self._only("GET", method, path) or await self.control.route_intent(request, fleet)
            if rest == "history":
                return await self._only("GET", method, path) or await self.control.history(request, fleet)
            if rest == "reconcile":
                return await self._only("POST", method, path) or await self.control.reconcile(request, fleet)
            if rest == "weights":  # traffic weights and canaries (gateway.weights_api)
                return await self._only("POST", method, path) or await post_weights(self.control, request, fleet)
            if rest in ("promote", "demote", "provision", "teardown", "replace"):
                kind = {"promote": "promotion", "demote": "demotion"}.get(rest, rest)
                return await self._only("POST", method, path) or await self.control.operation(request, fleet, kind)
        raise ApiError(404, "not_found", f"no such endpoint: {method} {path}")

    @staticmethod
    async def _only(allowed: str, method: str, path: str) -> web.Response | None:
        if method == allowed or (allowed == "GET" and method == "HEAD"):
            return None
        return _method_not_allowed(path, allowed)


def _method_not_allowed(path: str, allowed: str) -> web.Response:
    refusal = Refusal(405, "method_not_allowed", f"{path} accepts {allowed} only")
    return web.Response(
        body=refusal.body(),
        status=405,
        headers={"Content-Type": "application/json", "Allow": allowed, "x-should-retry": "false"},
    )


async def run_gateway(
    servers: list[str],
    config: GatewayConfig,
    *,
    creds: str | None = None,
    stop: asyncio.Event | None = None,
    ready=None,
) -> None:
    """Connect to NATS, serve until `stop` is set (or SIGINT/SIGTERM when `stop` is None)."""
    from haru.log.eventlog import EventLog

    own_stop = stop is None
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    if own_stop:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
    try:
        async with EventLog.connect(servers, writer=f"gateway:{config.host}:{config.port}", creds=creds) as events:
            async with Gateway(config, events) as gw:
                if ready is not None:
                    ready(gw)
                await stop.wait()
                log.info("gateway.stopping", url=gw.url)
    finally:
        if own_stop:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(sig)
