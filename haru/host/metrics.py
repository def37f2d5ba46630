"""The `/metrics` endpoint that the agent, the promoter, the projector and `haru up` share.

    async with MetricsServer([registry], host="127.0.0.1", port=9402, refresh=[collector.refresh]) as m:
        print(m.url)                         # http://127.0.0.1:9402/metrics

Each service builds its own `CollectorRegistry` with collectors that read the service's state when
Prometheus scrapes (nothing is counted on a hot path that a scrape can compute); `refresh` are
async callables awaited (bounded by `refresh_timeout_s`) before each scrape, for figures that need
a round trip, such as the projector's lag behind the stream.

Ports (flag over environment; unset = no metrics endpoint, 0 = a free port, logged):

    haru agent      --metrics-port / HARU_METRICS_PORT   documented default 9401
    haru promoter   --metrics-port / HARU_METRICS_PORT   documented default 9402
    haru projector  --metrics-port / HARU_METRICS_PORT   documented default 9403
    haru up         --metrics-port / HARU_METRICS_PORT   default 9400 (projector + promoter; demo agents
                                                          on free ports, printed and in the ready file)

The endpoint binds 127.0.0.1 unless `--metrics-host` / HARU_METRICS_HOST says otherwise: it has no
authentication (Prometheus convention), so exposing it is the operator's decision.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from haru.core.errors import ConfigError

log = structlog.get_logger("haru.host.metrics")

PORT_ENV = "HARU_METRICS_PORT"
HOST_ENV = "HARU_METRICS_HOST"
DEFAULT_HOST = "127.0.0.1"
DOCUMENTED_PORTS = {"up": 9400, "agent": 9401, "promoter": 9402, "projector": 9403}


def add_metrics_options(parser: argparse.ArgumentParser, *, default_port: int | None = None) -> None:
    """`--metrics-port` and `--metrics-host`, defaulting to HARU_METRICS_PORT / HARU_METRICS_HOST."""
    shown = f"; documented port {DOCUMENTED_PORTS.get(parser.prog.split()[-1], '')}" if default_port is None else ""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help=f"serve Prometheus metrics on this port at /metrics (env {PORT_ENV}; 0 = a free port"
        + (f"; default {default_port})" if default_port is not None else f"; unset = off{shown})"),
    )
    parser.add_argument(
        "--metrics-host", default=None, help=f"address of the metrics endpoint (env {HOST_ENV}; default {DEFAULT_HOST})"
    )


def metrics_address(
    flag_port: int | None,
    flag_host: str | None,
    env: Mapping[str, str],
    *,
    default_port: int | None = None,
) -> tuple[str, int] | None:
    """(host, port) to serve metrics on, or None for no endpoint. Flags win over the environment (`env`: the
    command's, which it reads once and passes here)."""
    port: int | None = flag_port
    if port is None:
        raw = env.get(PORT_ENV, "").strip()
        if raw:
            try:
                port = int(raw)
            except ValueError:
                raise ConfigError(f"{PORT_ENV}={raw!r} is not a port number; set it to 0..65535 or unset it") from None
    if port is None:
        port = default_port
    if port is None:
        return None
    if not 0 <= port <= 65535:
        raise ConfigError(f"metrics port {port} is out of range; choose 0..65535 (0 = a free port)")
    host = flag_host or env.get(HOST_ENV, "").strip() or DEFAULT_HOST
    return host, port


class MetricsServer:
    """A tiny aiohttp server: GET /metrics renders `registries` (after the `refresh` callables)."""

    def __init__(
        self,
        registries: list[CollectorRegistry],
        *,
        host: str = DEFAULT_HOST,
        port: int = 0,
        refresh: list[Callable[[], Awaitable[None]]] | None = None,
        refresh_timeout_s: float = 2.0,
        sources: list[tuple[str, Callable[[], Awaitable[bytes]]]] | None = None,
    ) -> None:
        self.registries = list(registries)
        self.sources = list(sources or [])  # (name, fetch): other processes' exposition text, appended
        self.host = host
        self.port = port
        self.refresh = list(refresh or [])
        self.refresh_timeout_s = refresh_timeout_s
        self._runner: web.ServerRunner | None = None

    @property
    def url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(self.host, self.host)
        return f"http://{host}:{self.port}/metrics"

    async def __aenter__(self) -> MetricsServer:
        server = web.Server(self._handle, access_log=None)
        runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise ConfigError(
                f"cannot serve metrics on {self.host}:{self.port}: {exc.strerror or exc}; "
                f"choose another port with --metrics-port or {PORT_ENV}"
            ) from None
        self._runner = runner
        if runner.addresses:
            self.port = runner.addresses[0][1]
        log.info("metrics.listening", url=self.url)
        return self

    async def __aexit__(self, *exc: object) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.path != "/metrics":
            return web.Response(status=404, text=f"no such endpoint: {request.path} (metrics are at /metrics)\n")
        if request.method not in ("GET", "HEAD"):
            return web.Response(status=405, text="/metrics accepts GET only\n", headers={"Allow": "GET"})
        await self.render_ready()
        body = b"".join(generate_latest(r) for r in self.registries) + await self._gathered()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _gathered(self) -> bytes:
        """The `sources`' text, fetched together; one that fails is left out of this scrape and logged."""
        if not self.sources:
            return b""
        names = [name for name, _ in self.sources]
        texts = await asyncio.gather(*(fetch() for _, fetch in self.sources), return_exceptions=True)
        out = []
        for name, text in zip(names, texts, strict=True):
            if isinstance(text, BaseException):
                log.warning("metrics.source_failed", source=name, error=repr(text))
            elif text:
                out.append(text if text.endswith(b"\n") else text + b"\n")
        return b"".join(out)

    async def render_ready(self) -> None:
        for refresh in self.refresh:
            try:
                async with asyncio.timeout(self.refresh_timeout_s):
                    await refresh()
            except Exception as exc:  # noqa: BLE001 - a scrape still answers, with the last figures
                log.warning("metrics.refresh_failed", error=repr(exc))


@contextlib.asynccontextmanager
async def maybe_serve(
    registries: list[CollectorRegistry],
    address: tuple[str, int] | None,
    refresh: list[Callable[[], Awaitable[None]]] | None = None,
) -> AsyncIterator[MetricsServer | None]:
    """Serve `registries` at `address`, or nothing when `address` is None (yields the server or None)."""
    if address is None:
        yield None
        return
    async with MetricsServer(registries, host=address[0], port=address[1], refresh=refresh) as server:
        yield server
