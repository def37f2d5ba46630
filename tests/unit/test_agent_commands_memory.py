"""The agent's command service on the in-memory bus: it reaches NATS only through the bus seam
(haru/log/bus.py `Bus.serve`), so the simulated hosts answer every verb on a `MemoryLog` as they do on
JetStream, and a stopped host is an agent gone."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from haru.agents.sim.hosts import MODELS, SimHosts
from haru.core.commands import Command
from haru.core.errors import AgentGone
from haru.log.bus import send
from haru.log.memory import MemoryLog

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


async def _states(bus, fleet: str, domain: str) -> dict[str, str]:
    reply = await send(bus, fleet, domain, "status", timeout=5)
    assert reply.ok, reply
    return {name: m["state"] for name, m in reply.data["models"].items()}


async def _until(check, timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not await check():
            await asyncio.sleep(0.02)


async def test_every_verb_answers_on_the_in_memory_bus_and_a_stopped_host_is_gone():
    log = MemoryLog(writer="test")
    async with SimHosts(log, load_ms=20, wake_ms=20, sleep_ms=10, probe_ms=5) as hosts:
        [fleet] = await hosts.grow(1)

        async def all_resident() -> bool:
            return set((await _states(log.bus, fleet, "b")).values()) == {"resident"}

        await _until(all_resident)
        slept = await send(log.bus, fleet, "b", "sleep", Command(op_id="op-1"), timeout=5)
        assert slept.ok and set(slept.data["models"]) == set(MODELS)
        assert set((await _states(log.bus, fleet, "b")).values()) == {"sleeping"}
        woke = await send(log.bus, fleet, "b", "wake", Command(op_id="op-1"), timeout=5)
        assert woke.ok and all(m["state"] == "resident" for m in woke.data["models"].values())
        probed = await send(log.bus, fleet, "b", "probe", Command(models=["chat-8b"]), timeout=5)
        assert probed.ok and list(probed.data["models"]) == ["chat-8b"]
        unknown = await send(log.bus, fleet, "b", "probe", Command(models=["nope"]), timeout=5)
        assert not unknown.ok and unknown.error.code == "model_not_found"
        bad = await log.bus.request(f"haru.cmd.{fleet}.b.status", b"{not json", timeout=5)
        assert b"invalid_command" in bad.data

        await hosts.host(fleet, "b").stop()
        with pytest.raises(AgentGone):
            await send(log.bus, fleet, "b", "status", timeout=1)
        assert (await send(log.bus, fleet, "a", "status", timeout=5)).ok  # the other domain still answers


def test_the_agent_wires_its_parts_without_lambdas_and_commands_without_nats():
    agent = ast.parse((ROOT / "agents" / "agent.py").read_text())
    lambdas = [n.lineno for n in ast.walk(agent) if isinstance(n, ast.Lambda)]
    assert lambdas == [], f"agents/agent.py builds its parts bottom-up; lambdas at lines {lambdas}"
    commands = ast.parse((ROOT / "agents" / "commands.py").read_text())
    imported = {a.name for n in ast.walk(commands) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(commands) if isinstance(n, ast.ImportFrom)}
    assert not any(m == "nats" or m.startswith("nats.") for m in imported), imported
