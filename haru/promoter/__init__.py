"""The promoter: operations (promotions, demotions, ...), auto-failover, liveness.

    haru.promoter.decider    pure: the steps table, the transitions table, `decide(view, facts)`
    haru.promoter.liveness   pure: heartbeat silence -> domain_unreachable / domain_reachable
    haru.promoter.service    the shell: follows the log, drives steps over request/reply (`run_promoter`)
    haru.promoter.requests   `request_operation`, `abort_operation`: `haru promote/demote/op abort`, the control API

The shell's names are imported lazily, so importing the pure decider loads no nats or asyncio.
See docs/promoter.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from haru.promoter.decider import KINDS, STEPS, TRANSITIONS, decide, flow
from haru.promoter.decisions import Append, Facts
from haru.promoter.errors import OperationNotFound, PromoterError

if TYPE_CHECKING:
    from haru.promoter.requests import RequestResult, abort_operation, request_operation
    from haru.promoter.service import Promoter, run_promoter

_LAZY = {
    "RequestResult": "haru.promoter.requests",
    "request_operation": "haru.promoter.requests",
    "abort_operation": "haru.promoter.requests",
    "Promoter": "haru.promoter.service",
    "run_promoter": "haru.promoter.service",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'haru.promoter' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "KINDS",
    "STEPS",
    "TRANSITIONS",
    "Append",
    "Facts",
    "OperationNotFound",
    "Promoter",
    "abort_operation",
    "PromoterError",
    "RequestResult",
    "decide",
    "flow",
    "request_operation",
    "run_promoter",
]
