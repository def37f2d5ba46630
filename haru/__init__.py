"""Haru: residency truth and hot failover for self-hosted LLM inference fleets.

The public API, for a program that embeds a part of Haru (the `haru` command is the other way in):

    from haru import RouteWatcher, RouteIntent, Target   # follow a fleet's route intents (a router)
    from haru import Gateway, GatewayConfig              # the gateway in a process of your own
    from haru import EventLog                            # the event log connection both can share
    from haru import HaruError                           # the base of every error Haru raises

    async with RouteWatcher(["nats://10.0.0.5:4222"], "default") as w:
        async for intent in w:                           # a RouteIntent: intent.active is a Target
            route_to(intent.active.serving_url, intent.answers)

docs/projector.md ("Embedding: RouteWatcher") and docs/gateway.md ("Embedding the gateway") say the
rest. Everything else in the package is private: its modules may move between releases.

Each name is imported when it is first used, so `import haru` (and every `import haru.<module>`, which
runs this file first) loads neither NATS nor aiohttp: the pure core stays pure.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from haru.core.errors import HaruError
    from haru.core.views import RouteIntent, Target
    from haru.gateway.config import GatewayConfig
    from haru.gateway.server import Gateway
    from haru.log.eventlog import EventLog
    from haru.log.route import RouteWatcher

# name -> the module that defines it
_HOMES = {
    "EventLog": "haru.log.eventlog",
    "Gateway": "haru.gateway.server",
    "GatewayConfig": "haru.gateway.config",
    "HaruError": "haru.core.errors",
    "RouteIntent": "haru.core.views",
    "RouteWatcher": "haru.log.route",
    "Target": "haru.core.views",
}

__all__ = ["EventLog", "Gateway", "GatewayConfig", "HaruError", "RouteIntent", "RouteWatcher", "Target"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'haru' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
