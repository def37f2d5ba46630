"""The agent's heartbeat: `haru.hb.<fleet>.<domain>` every `heartbeat_ms` (core NATS, not history).

`heartbeat_of` builds one from what the agent knows (pure); `Heartbeats` publishes one per interval
through the `publish` it is given, and a publish (or a build) that raises is logged with its traceback
and counted (`LoopErrors["heartbeat"]`), never the end of the heartbeat.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from typing import Any

import msgspec

from haru.agents.loops import LoopErrors, every
from haru.core.commands import Heartbeat

__all__ = ["heartbeat_of", "Heartbeats"]


def heartbeat_of(
    *, fleet: str, domain: str, role: str, models: Mapping[str, str], training: list[str], pid: int, at: datetime
) -> Heartbeat:
    """`models`: model -> residency state; `training`: the slots whose process runs."""
    counts: dict[str, int] = {}
    for s in models.values():
        counts[s] = counts.get(s, 0) + 1
    summary = f"{role}; " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    if training:
        summary += f"; training {', '.join(training)}"
    return Heartbeat(
        fleet=fleet, domain=domain, at=at, summary=summary, models=dict(models), training=list(training), pid=pid
    )


class Heartbeats:
    def __init__(
        self,
        publish: Callable[[bytes], Awaitable[Any]],
        beat: Callable[[], Heartbeat],
        *,
        interval_s: float,
        errors: LoopErrors,
        logger: Any,
    ) -> None:
        self.publish = publish
        self.beat = beat
        self.interval_s = interval_s
        self.errors = errors
        self.logger = logger
        self._encoder = msgspec.json.Encoder()

    async def once(self) -> None:
        await self.publish(self._encoder.encode(self.beat()))

    async def run(self) -> None:
        await every(self.interval_s, self.once, name="heartbeat", errors=self.errors, logger=self.logger)
