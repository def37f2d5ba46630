"""The agent's one way to append to the event log: with the subject's expected sequence, retried while
the log is unreachable (the truth is recorded late rather than never; bounded only once the agent is
stopping), and continued from the subject's tip after a conflict (nobody else writes this domain's
subjects: the claim made sure, so a conflict is a stale tip of the agent's own)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from haru.core.errors import Conflict, LogUnavailable
from haru.core.events import Event
from haru.log.seam import EventStore

__all__ = ["Appender", "Append"]

# append(subject, event, expected last sequence) -> the event's sequence
Append = Callable[[str, Event, int], Awaitable[int]]


class Appender:
    def __init__(self, log: EventStore, *, stopping: Callable[[], bool], logger: Any) -> None:
        self.log = log
        self.stopping = stopping
        self.logger = logger

    async def __call__(self, subject: str, event: Event, expect: int) -> int:
        tries = 0
        while True:
            tries += 1
            try:
                return await self._once(subject, event, expect)
            except LogUnavailable as exc:
                if self.stopping() and tries >= 3:
                    raise
                self.logger.warning("event log unavailable; retrying the append", subject=subject, error=str(exc))
                await asyncio.sleep(min(0.5 * tries, 5.0))

    async def _once(self, subject: str, event: Event, expect: int) -> int:
        try:
            return await self.log.append(subject, event, expect=expect)
        except Conflict as exc:
            self.logger.error(
                "subject moved under the agent; continuing from its tip",
                subject=subject,
                expected=expect,
                current=exc.current,
            )
            return await self.log.append(subject, event, expect=await self.log.last_seq_of(subject))
