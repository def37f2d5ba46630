"""The gateway's configuration: command-line values over environment variables over defaults.

HARU_API_TOKEN               bearer token for everything but /healthz; unset = bind 127.0.0.1 only
HARU_SERVING_TOKEN           bearer token the gateway presents to serving URLs (agents, runtimes)
HARU_DEFAULT_FLEET           fleet for requests without X-Haru-Fleet (default "default")
HARU_CHAT_MAX_BODY_BYTES     largest request body (default 33554432 = 32 MiB); beyond it: 413
HARU_CHAT_HEADER_TIMEOUT_MS  bound on the time to the upstream's response headers (default 30000),
                             honored exactly; a streaming body is never cut for going quiet
HARU_CLIENT_HEADER_TIMEOUT_MS  a client's time to send a whole request head, and a kept-alive
                             connection's idle time (default 15000); then it is closed
HARU_CLIENT_BODY_TIMEOUT_MS  a client's time to send the whole body once the head is in (default
                             30000); then a 408 and the connection is closed
HARU_CLIENT_MAX_IDLE         connections waiting for a request head at once (default 512); a new
                             one beyond it closes the one that waited longest (haru/host/httpguard.py)
HARU_GATEWAY_HOST / PORT     where to listen (default 0.0.0.0 with a token, 127.0.0.1 without; 8700;
                             the port falls back to $PORT)
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from haru.host.httpguard import DEFAULT_BODY_TIMEOUT_MS, DEFAULT_MAX_IDLE, ClientLimits, env_int
from haru.host.httpguard import DEFAULT_HEADER_TIMEOUT_MS as DEFAULT_CLIENT_HEADER_TIMEOUT_MS

DEFAULT_PORT = 8700
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_HEADER_TIMEOUT_MS = 30_000
LOOPBACK = "127.0.0.1"
_LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: str = LOOPBACK
    port: int = DEFAULT_PORT
    api_token: str = ""
    serving_token: str = ""
    default_fleet: str = "default"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout_ms: int = DEFAULT_HEADER_TIMEOUT_MS
    connector_limit: int = 4096  # concurrent upstream connections (the session is shared)
    # Largest upstream response (with Content-Length) returned as one buffered body; larger
    # or unsized ones (SSE) are streamed chunk by chunk.
    buffer_limit_bytes: int = 4 * 1024 * 1024
    # How often the followers check the log for what their watches may have missed (state.py).
    resync_ms: int = 2_000
    # How often it reports what it measured of weighted domains (gateway.canary), HARU_CANARY_REPORT_MS.
    canary_report_ms: int = 1_000
    # How often it records the tokens it served in the log (gateway.usage_log), HARU_USAGE_FLUSH_MS.
    usage_flush_ms: int = 10_000
    # Slow and idle clients (haru/host/httpguard.py)
    client_header_timeout_ms: int = DEFAULT_CLIENT_HEADER_TIMEOUT_MS
    client_body_timeout_ms: int = DEFAULT_BODY_TIMEOUT_MS
    client_max_idle: int = DEFAULT_MAX_IDLE

    @property
    def client_limits(self) -> ClientLimits:
        return ClientLimits(
            self.client_header_timeout_ms / 1000, self.client_body_timeout_ms / 1000, self.client_max_idle
        )

    @property
    def open(self) -> bool:
        """No API token: development mode, loopback only."""
        return not self.api_token

    def bind_host(self) -> str:
        """Where to listen: without a token, always loopback, whatever was asked."""
        if self.open and self.host not in _LOOPBACK_NAMES:
            return LOOPBACK
        return self.host


def from_env(
    env: Mapping[str, str],
    *,
    host: str | None = None,
    port: int | None = None,
    **overrides: object,
) -> GatewayConfig:
    """The configuration from environment variables, with explicit values (CLI flags) on top."""
    token = env.get("HARU_API_TOKEN", "")
    if host is None:
        host = env.get("HARU_GATEWAY_HOST") or ("0.0.0.0" if token else LOOPBACK)
    if port is None:
        # PORT is the fallback (Haru's server listened on $PORT): HARU_GATEWAY_PORT wins when both are set.
        port = env_int(env, "HARU_GATEWAY_PORT", env_int(env, "PORT", DEFAULT_PORT))
    values: dict[str, object] = dict(
        host=host,
        port=port,
        api_token=token,
        serving_token=env.get("HARU_SERVING_TOKEN", ""),
        default_fleet=env.get("HARU_DEFAULT_FLEET") or "default",
        max_body_bytes=env_int(env, "HARU_CHAT_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES, 1),
        header_timeout_ms=env_int(env, "HARU_CHAT_HEADER_TIMEOUT_MS", DEFAULT_HEADER_TIMEOUT_MS, 1),
        client_header_timeout_ms=env_int(env, "HARU_CLIENT_HEADER_TIMEOUT_MS", DEFAULT_CLIENT_HEADER_TIMEOUT_MS, 1),
        client_body_timeout_ms=env_int(env, "HARU_CLIENT_BODY_TIMEOUT_MS", DEFAULT_BODY_TIMEOUT_MS, 1),
        client_max_idle=env_int(env, "HARU_CLIENT_MAX_IDLE", DEFAULT_MAX_IDLE, 1),
        canary_report_ms=env_int(env, "HARU_CANARY_REPORT_MS", 1_000, 50),
        usage_flush_ms=env_int(env, "HARU_USAGE_FLUSH_MS", 10_000, 50),
    )
    values.update({k: v for k, v in overrides.items() if v is not None})
    return GatewayConfig(**values)  # type: ignore[arg-type]
