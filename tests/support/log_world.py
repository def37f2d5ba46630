"""One log for a test, on either implementation: eventsourcing's `make_log` hook (tests/persistence.py's
abstract case), as a parametrized fixture. A scenario written once against `world` runs on JetStream
(`EventLog` on the test's own nats-server) and in memory (`MemoryLog`); the contract suite
(test_log_contract.py), the promoter's saga (test_promoter_saga.py) and the projector's scenarios
(test_projector.py) use it. What only a server shows is written against `event_log` alone.

    async def test_something(world):
        log = world.log                               # the test's own client (haru.log.seam.Log)
        other = await world.client("promoter:1")      # another client of the same log, closed at the end
        await world.append_raw(subject, b"garbage")   # a body stored as it is, unchecked
        await world.drop_link(0.5)                    # the link goes away for 0.5 s and comes back
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from haru.log.eventlog import EventLog
from haru.log.memory import MemoryLog
from haru.log.seam import Log

KINDS = ["memory", "jetstream"]


class LogWorld:
    """The log a scenario runs on (see the module docstring)."""

    def __init__(self, kind: str, event_log: EventLog | None = None, nats_server: Any = None) -> None:
        self.kind = kind
        self.nats_server = nats_server
        self.url: str | None = None if nats_server is None else nats_server.url
        self.log: Log = event_log if event_log is not None else MemoryLog(writer="test")
        self._clients: list[EventLog] = []

    @property
    def memory(self) -> MemoryLog:
        assert isinstance(self.log, MemoryLog), "only the in-memory log has this"
        return self.log

    async def client(self, writer: str) -> Log:
        """Another client of the same log, appending as `writer` (its own connection on JetStream)."""
        if isinstance(self.log, MemoryLog):
            return self.log.connect(writer)
        assert self.url is not None
        log = await EventLog.open([self.url], writer=writer)
        self._clients.append(log)
        return log

    async def append_raw(self, subject: str, data: bytes) -> int:
        """Store `data` on `subject` as it is: no sequence check, no chain (a forged or invalid body)."""
        if isinstance(self.log, MemoryLog):
            return await self.log.append_raw(subject, data)
        assert isinstance(self.log, EventLog)
        return (await self.log.js.publish(subject, data)).seq

    async def drop_link(self, down_s: float) -> None:
        """Take the link to the log away for `down_s` seconds (on JetStream: stop and restart the
        server), then wait until the test's client is connected again."""
        if isinstance(self.log, MemoryLog):
            self.log.drop_link()
            await asyncio.sleep(down_s)
            self.log.restore_link()
            return
        await asyncio.to_thread(self.nats_server.stop_sync)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(self.nats_server.start_sync)
        async with asyncio.timeout(20):
            while not self.log.connected:
                await asyncio.sleep(0.05)

    async def aclose(self) -> None:
        for log in self._clients:
            await log.close()


@pytest.fixture(params=KINDS)
def log_kind(request: pytest.FixtureRequest) -> LogWorld:
    if request.param == "memory":
        return LogWorld("memory")
    return LogWorld("jetstream", request.getfixturevalue("event_log"), request.getfixturevalue("nats_server"))


@pytest.fixture
async def world(log_kind: LogWorld):
    try:
        yield log_kind
    finally:
        await log_kind.aclose()
