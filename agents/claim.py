"""Claiming the domain: one agent per domain, and what the agent says as it starts and stops.

    haru.evt.<fleet>.<domain>.agent     agent_started / agent_stopping

`agent_started` is appended with the subject's expected last sequence, after checking that no live
agent answers the domain's commands or heartbeats; a loser is refused (`AgentRefused`). Every later
append on the agent subject extends the chain the claim began (`Claim.seq`).
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime
from typing import Any

import msgspec

from haru.agents.cause import VERSION
from haru.agents.errors import AgentRefused
from haru.agents.host_ram import read_host_ram
from haru.core import subjects
from haru.core.commands import heartbeat_decoder
from haru.core.errors import Conflict, NoResponders, RequestTimeout
from haru.core.events import AgentStarted, AgentStopping, FailureSignalled
from haru.log.bus import Bus, Msg
from haru.log.seam import EventStore

__all__ = ["Claim"]


def _now() -> datetime:
    return datetime.now(UTC)


class Claim:
    def __init__(
        self,
        log: EventStore,
        bus: Bus,
        *,
        fleet: str,
        domain: str,
        host: str,
        pid: int,
        heartbeat_ms: int,
        logger: Any,
    ) -> None:
        """`log`: where the claim is appended; `bus`: where a live agent of the domain would answer."""
        self.log = log
        self.bus = bus
        self.fleet = fleet
        self.domain = domain
        self.host = host
        self.pid = pid
        self.heartbeat_ms = heartbeat_ms
        self.logger = logger
        self.subject = subjects.agent(fleet, domain)
        self.seq = 0  # the agent subject's last sequence this agent wrote; 0 = not claimed

    async def take(self, serving_url: str) -> int:
        """Append agent_started with the expected sequence; refuse if another agent runs this domain."""
        rec = await self.log.last(self.subject)
        expect = rec.seq if rec is not None else 0
        if rec is not None and isinstance(rec.event, AgentStarted):
            who = f"{rec.event.host or '?'} pid {rec.event.pid}"
            if await self.someone_answers():
                raise AgentRefused(
                    f"another agent already runs domain {self.domain!r} of fleet {self.fleet!r} ({who}): it answers "
                    f"{subjects.commands(self.fleet, self.domain)}.* and heartbeats; stop it first (two writers would "
                    f"corrupt one history)"
                )
        ram_total, ram_available = read_host_ram()  # agents/host_ram.py: /proc/meminfo, for `haru status`
        event = AgentStarted(
            at=_now(),
            domain=self.domain,
            host=self.host,
            pid=self.pid,
            version=VERSION,
            serving_url=serving_url,
            host_ram_total_bytes=ram_total,
            host_ram_available_bytes=ram_available,
        )
        try:
            self.seq = await self.log.append(self.subject, event, expect=expect)
        except Conflict as exc:
            raise AgentRefused(
                f"another agent started for domain {self.domain!r} of fleet {self.fleet!r} at the same moment and won "
                f"(the agent subject moved to sequence {exc.current}); stop one of them"
            ) from exc
        return self.seq

    def tip(self) -> int:
        """The agent subject's last sequence this agent wrote (0: not claimed): what its events cite."""
        return self.seq

    async def record_signal(self, event: FailureSignalled) -> None:
        """A sign this domain is about to go (agents/signals.py), on the chain the claim began."""
        self.seq = await self.log.append(self.subject, event, expect=self.seq)

    async def release(self, reason: str) -> None:
        """Append agent_stopping on the chain this agent's claim began."""
        self.seq = await self.log.append(
            self.subject, AgentStopping(at=_now(), domain=self.domain, reason=reason), expect=self.seq
        )

    async def someone_answers(self) -> bool:
        """Whether a live agent holds the domain: it answers `status`, or heartbeats (another pid)."""
        bus = self.bus
        try:
            await bus.request(subjects.command(self.fleet, self.domain, "status"), b"{}", timeout=1.0)
            return True
        except NoResponders:
            pass
        except RequestTimeout:
            return True  # subscribed but slow: someone is there
        seen = asyncio.Event()

        def on_hb(msg: Msg) -> None:
            try:
                hb = heartbeat_decoder.decode(msg.data)
            except msgspec.DecodeError:
                return
            if hb.pid != self.pid:
                seen.set()

        sub = await bus.subscribe(subjects.heartbeat(self.fleet, self.domain), on_hb)
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                async with asyncio.timeout(1.5 * self.heartbeat_ms / 1000):
                    await seen.wait()
        finally:
            await sub.unsubscribe()
        return seen.is_set()
