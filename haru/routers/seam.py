"""The one thing a route follower needs of a router: apply a plan, or say why not.

    class RouterTarget(Protocol):
        kind: str
        async def apply(self, plan: Plan, intent: bytes, *, again: bool) -> None   # NotApplied when not

`intent` is the route intent as JSON (what `--exec` hands its command); `again` is True when the plan is
one already applied (a periodic resync, or after NATS came back): a target that can tell the router
already holds it may skip the work. Implementations: haproxy.HAProxy (runtime API), nginx.Nginx (an
upstream file and a graceful reload), envoy.Envoy (file-based EDS), command.Command (--exec).
"""

from __future__ import annotations

from typing import Protocol

from haru.core.router_plans import Plan


class RouterTarget(Protocol):
    kind: str

    def describe(self) -> str:
        """One line: which router, where (for logs and `haru route follow`'s first line)."""
        ...

    async def apply(self, plan: Plan, intent: bytes, *, again: bool) -> None: ...
