"""The gateway: an OpenAI-compatible chat proxy whose statuses carry the diagnosis, the control API
and Prometheus metrics, reading the projected views and route intents from NATS.

    from haru.gateway import Gateway, from_env, run_gateway
    async with Gateway(from_env(os.environ, port=0), events) as gw: ...

Modules: routing (pure routing table and status table), truth (pure /residency and /v1/models
bodies), proxy (the chat path), control (the control API), state (the NATS followers), metrics,
config, server (the HTTP server and lifecycle), errors.
"""

from haru.core.openai_errors import ANSWER_STATUS
from haru.gateway.config import GatewayConfig, from_env
from haru.gateway.errors import ApiError, GatewayError, UpstreamError
from haru.gateway.routing import Forward, Refusal, RoutingTable, compile_routes
from haru.gateway.server import Gateway, run_gateway

__all__ = [
    "ANSWER_STATUS",
    "ApiError",
    "Forward",
    "Gateway",
    "GatewayConfig",
    "GatewayError",
    "Refusal",
    "RoutingTable",
    "compile_routes",
    "from_env",
    "run_gateway",
    "UpstreamError",
]
