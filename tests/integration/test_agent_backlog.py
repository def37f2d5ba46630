"""An agent cut off from the log keeps observing, buffers what it sees, and appends it in order when the log
is back (agents/appender.py, agents/backlog.py): a real agent on the simulator, a real nats-server stopped
and started again on its store."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from haru.agents.runtime_files import read_identities
from haru.core import subjects
from haru.log.eventlog import EventLog
from tests.support import haru
from tests.support.agent_harness import is_, kill_runtimes, tag, wait_event, write_config, write_layout

pytestmark = pytest.mark.timeout(120)


def lines(agent, event: str) -> list[dict]:
    out = []
    for line in agent.output().splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if doc.get("event") == event:
            out.append(doc)
    return out


async def until(check, timeout: float, what: str, agent) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{agent.output()[-5000:]}")
        await asyncio.sleep(0.1)


def runtime_pids(state_dir) -> set[int]:
    return {int(doc["pid"]) for _p, doc in read_identities(state_dir).values() if doc is not None}


async def test_cut_off_the_agent_keeps_observing_and_appends_in_order_once_back(tmp_path, nats_server, agents):
    subject = subjects.model("f", "a", "m1")
    layout = write_layout(tmp_path / "layout.json", tmp_path)
    cfg = write_config(tmp_path / "agent.json", nats_server.url, tmp_path, layout=layout, backlog=6)
    async with EventLog.connect([nats_server.url], writer="test") as log:
        await log.ensure()
        agent = agents(cfg, tmp_path / "agent.log")
        first = await wait_event(log, subject, is_("model_resident"), agent=agent)
        before = [r.seq for r in await log.history(subject)]
    state_dir = tmp_path / "state" / "a"

    await asyncio.to_thread(nats_server.stop_sync)
    # Three crashes while nobody can record them: each one seen, the runtime restarted, resident again.
    for n in range(3):
        resident = len(lines(agent, "model_resident"))
        pids = runtime_pids(state_dir)
        assert kill_runtimes(state_dir), "no runtime to crash"
        await until(
            lambda resident=resident, pids=pids: (
                len(lines(agent, "model_resident")) > resident and runtime_pids(state_dir) - pids
            ),
            30,
            f"the agent to observe crash {n + 1} and restart the runtime while cut off",
            agent,
        )
    assert lines(agent, "appends buffered: the event log does not acknowledge")
    coalesced = lines(agent, "backlog coalesced: loops of states and older GPU snapshots dropped")
    assert coalesced and coalesced[-1]["dropped"] > 0, agent.output()[-3000:]

    await asyncio.to_thread(nats_server.start_sync)
    await until(lambda: lines(agent, "buffered appends recorded"), 60, "the backlog to be appended", agent)
    async with EventLog.connect([nats_server.url], writer="test") as log:
        after = [r for r in await log.history(subject) if r.seq not in before]
        # three loops of lost/loading/resident, coalesced to the one the subject went through: in order,
        # legal, each event once
        assert [tag(r) for r in after] == ["model_lost", "model_loading", "model_resident"], [tag(r) for r in after]
        assert after[0].event.reason == "process_exited"
        assert after[-1].event.at > after[1].event.at > after[0].event.at > first.event.at
        # the restart cites the loss it answers, by the sequence the loss was stored at
        assert after[1].event.cause == after[0].seq
        # and the agent goes on writing after its backlog, on the same chain
        resident = len(lines(agent, "model_resident"))
        kill_runtimes(state_dir)
        await until(lambda: len(lines(agent, "model_resident")) > resident, 30, "a crash after the backlog", agent)
        await wait_event(log, subject, lambda r: tag(r) == "model_resident" and r.seq > after[-1].seq, agent=agent)
    verify = haru("verify", nats_url=nats_server.url)
    assert verify.returncode == 0, verify.stdout + verify.stderr
