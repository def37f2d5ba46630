"""HAProxy through its runtime API (the stats socket): the plan applied at once, no reload.

The backend declares a few server slots that the follower owns, for example

    backend haru_default
        server-template haru 4 127.0.0.1:9 disabled

(slots haru1..haru4). Each domain in the plan keeps one slot while it stays in it: a flip readies the
new active's slot (`set server B/S addr IP port P`, `weight W`, `state ready`) before it puts the old
one's in maintenance (`state maint`), so requests in flight on the old active finish there and every new
one goes to the new active. HAProxy's addresses are IPs: a host name in a serving URL is resolved here.

The runtime API answers each command in words: an empty answer, or "IP changed from ..." for `addr`,
is success; anything else ("No such server.", "Require 'backend/server'.", ...) is the router refusing,
and the plan is not applied.
"""

from __future__ import annotations

import asyncio
import socket

import msgspec

from haru.core.router_plans import Plan, haproxy_assign, haproxy_commands, is_ip
from haru.routers.errors import NotApplied

__all__ = ["HAProxy"]

_OK_PREFIXES = ("IP changed from", "no need to change", "nothing changed", "port changed")


class HAProxy:
    kind = "haproxy"

    def __init__(self, socket_addr: str, backend: str, slots: tuple[str, ...], *, timeout: float = 5.0) -> None:
        self.socket_addr = socket_addr  # a unix socket path, or host:port of a `stats socket ipv4@...`
        self.backend = backend
        self.slots = slots
        self.timeout = timeout
        self.assigned: dict[str, str] = {}  # domain -> slot, kept across plans
        self.notes: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"HAProxy backend {self.backend} (slots {', '.join(self.slots)}) over {self.socket_addr}"

    async def command(self, line: str) -> str:
        """One runtime API command on its own connection; the answer, stripped."""
        try:
            async with asyncio.timeout(self.timeout):
                if self.socket_addr.startswith("/"):
                    reader, writer = await asyncio.open_unix_connection(self.socket_addr)
                else:
                    host, _, port = self.socket_addr.rpartition(":")
                    reader, writer = await asyncio.open_connection(host or "127.0.0.1", int(port))
                try:
                    writer.write(line.encode() + b"\n")
                    await writer.drain()
                    data = await reader.read()
                finally:
                    writer.close()
        except (OSError, TimeoutError) as exc:
            raise NotApplied(
                f"HAProxy's runtime API at {self.socket_addr} did not answer {line!r}: {exc or type(exc).__name__}; "
                "is HAProxy running with `stats socket ... level admin` there?"
            ) from exc
        return data.decode(errors="replace").strip()

    async def _resolved(self, plan: Plan) -> Plan:
        ups = []
        loop = asyncio.get_running_loop()
        for u in plan.upstreams:
            if is_ip(u.host):
                ups.append(u)
                continue
            try:
                infos = await loop.getaddrinfo(u.host, u.port, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise NotApplied(f"cannot resolve {u.host} (domain {u.domain}) for HAProxy: {exc}") from exc
            ups.append(msgspec.structs.replace(u, host=str(infos[0][4][0])))
        return msgspec.structs.replace(plan, upstreams=tuple(ups))

    async def apply(self, plan: Plan, intent: bytes, *, again: bool) -> None:
        plan = await self._resolved(plan)
        assigned, notes = haproxy_assign(plan, self.slots, self.assigned)
        self.notes = tuple(notes)
        for line in haproxy_commands(plan, self.backend, self.slots, assigned):
            answer = await self.command(line)
            if answer and not answer.startswith(_OK_PREFIXES):
                raise NotApplied(f"HAProxy refused {line!r}: {answer.splitlines()[0]}")
        self.assigned = assigned
