"""The agent under systemd, through the very signals the unit sends (issue 29).

`systemctl stop haru-agent` sends the unit's `KillSignal` and must stop the runtimes and record it;
`systemctl reload haru-agent` runs the unit's `ExecReload` and must leave the runtimes serving for the
next agent (`Restart=always` starts it), which adopts them. The signals are read from
deploy/systemd/haru-agent.service, so the unit, its docs and this test cannot drift apart.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from haru.host.children import alive as proc_alive
from tests.support.promoter import wait_view
from tests.support.sim_fleet import (
    FLEET,
    MODELS,
    identities,
    residency_tags,
    sim_fleet,
    sim_layout,
    steady,
    wait_adopted,
)

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "haru-agent.service"


def unit_settings() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            out.setdefault(key, value)
    return out


def stop_signal() -> int:
    """What `systemctl stop` sends the main process (KillSignal=, SIGTERM when unset)."""
    return int(getattr(signal, unit_settings().get("KillSignal", "SIGTERM")))


def reload_signal() -> int:
    """What `systemctl reload` sends: ExecReload must be `kill -<SIG> $MAINPID`."""
    argv = unit_settings()["ExecReload"].split()
    assert argv[0].endswith("kill") and argv[-1] == "$MAINPID", argv
    name = argv[1].lstrip("-")
    return int(getattr(signal, name if name.startswith("SIG") else "SIG" + name))


def test_the_unit_makes_stop_and_reload_two_signals_and_restarts_an_agent_that_exits():
    settings = unit_settings()
    assert stop_signal() == signal.SIGINT and reload_signal() == signal.SIGTERM
    assert settings["KillMode"] == "process", "any other mode kills the runtimes whenever the agent exits"
    assert settings["Restart"] == "always", "a reload ends the agent with 0: it must be started again"


@pytest.mark.timeout(150)
async def test_reload_keeps_the_runtimes_and_stop_unloads_them_and_records_it(tmp_path, nats_server, event_log):
    layout = sim_layout(tmp_path / "layout.json", tmp_path)
    async with sim_fleet(tmp_path, nats_server, event_log, layout) as fleet:
        await wait_view(event_log, steady, timeout=60, fleet=FLEET, what="a active and resident, b a standby")
        state = fleet.state_dir("b")
        before = identities(state)
        assert set(before) == set(MODELS)

        # systemctl reload haru-agent: the agent exits 0 and every runtime keeps serving...
        agent = fleet.agents["b"]
        agent.signal(reload_signal())
        assert await agent.wait(60) == 0
        for doc in before.values():
            assert proc_alive(doc["pid"], doc["start"]), doc
        # ...and the agent systemd starts again (Restart=always) adopts them: no reload of weights.
        loads = {m: (await residency_tags(event_log, "b", m)).count("model_loading") for m in MODELS}
        agent = fleet.start("b")
        for m in MODELS:
            await wait_adopted(event_log, "b", m, 1, agent)
        assert {m: (await residency_tags(event_log, "b", m)).count("model_loading") for m in MODELS} == loads
        assert {m: d["pid"] for m, d in identities(state).items()} == {m: d["pid"] for m, d in before.items()}

        # systemctl stop haru-agent: every runtime is stopped, and the log says so.
        since = {m: len(await residency_tags(event_log, "b", m)) for m in MODELS}
        agent.signal(stop_signal())
        assert await agent.wait(120) == 0
        for doc in before.values():
            deadline = asyncio.get_running_loop().time() + 20
            while proc_alive(doc["pid"], doc["start"]):
                assert asyncio.get_running_loop().time() < deadline, f"runtime {doc['model']} still runs after a stop"
                await asyncio.sleep(0.05)
        for m in MODELS:
            assert (await residency_tags(event_log, "b", m))[since[m] :][-1:] == ["model_stopped"], m
        agent_events = [type(r.event).__name__ for r in await event_log.history(f"haru.evt.{FLEET}.b.agent")]
        assert agent_events[-1] == "AgentStopping"
