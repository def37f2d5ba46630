"""The agent answers commands from its first heartbeat: a command that comes while it boots (adopting its
runtimes, reading its tips) waits for the boot to end instead of finding nobody subscribed, which the
promoter would take for an agent gone and abort its step on (a returning standby's demotion did)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from haru.agents.commands import CommandService
from haru.agents.ports import Identity
from haru.core.errors import AgentGone
from haru.log.bus import send
from haru.log.memory import MemoryLog

pytestmark = pytest.mark.timeout(30)


class _Status:
    def data(self) -> dict[str, Any]:
        return {"role": "standby", "models": {"m": {"state": "resident"}}}


def _service(log: MemoryLog) -> CommandService:
    unused: Any = object()  # the verbs below never reach them
    return CommandService(
        log.bus,
        Identity(fleet="f", domain="a", host="h", pid=1),
        models=unused,
        training=unused,
        role=unused,
        live=unused,
        status=_Status(),  # type: ignore[arg-type]
    )


async def test_a_command_sent_while_the_agent_boots_is_answered_once_it_has_booted():
    log = MemoryLog(writer="test")
    service = _service(log)
    await service.start(booting=True)
    try:
        asked = asyncio.create_task(send(log.bus, "f", "a", "status", timeout=10))
        await asyncio.sleep(0.3)
        assert not asked.done(), "answered before the agent finished booting"
        service.ready.set()
        reply = await asyncio.wait_for(asked, 5)
        assert reply.ok and reply.data["role"] == "standby", reply
    finally:
        await service.stop()


async def test_an_agent_that_stops_while_booting_leaves_nothing_waiting():
    log = MemoryLog(writer="test")
    service = _service(log)
    await service.start(booting=True)
    asked = asyncio.create_task(send(log.bus, "f", "a", "status", timeout=2))
    await asyncio.sleep(0.3)
    await service.stop()  # the answer that waited for the boot is cancelled with the service: no task is left
    assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and t is not asked]
    with pytest.raises(AgentGone):
        await asked


async def test_a_service_started_booted_answers_at_once():
    log = MemoryLog(writer="test")
    service = _service(log)
    await service.start()
    try:
        reply = await send(log.bus, "f", "a", "status", timeout=5)
        assert reply.ok, reply
    finally:
        await service.stop()
