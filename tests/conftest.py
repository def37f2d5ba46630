"""Shared fixtures: a real nats-server per test on a free loopback port, in a temporary store.

Integration tests use `nats_server` (a started `haru.host.natsd.NatsServer`) and `event_log`
(a connected `haru.log.eventlog.EventLog` with the streams ensured).
"""

from __future__ import annotations

import os

import pytest

from haru.host.natsd import NatsServer

pytest_plugins = ["tests.support.hangdump"]

# Tests written before issue 14 kill agents and expect their runtimes to go with them: agents started
# by the suite (directly, through `haru up`, or a gateway fixture) inherit this. The tests of runtimes
# that outlive their agent (tests/integration/test_agent_restart.py) start agents without it.
os.environ.setdefault("HARU_RUNTIMES_DIE_WITH_AGENT", "1")


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "nats")
    server.start_sync()
    try:
        yield server
    finally:
        server.stop_sync()


@pytest.fixture
async def event_log(nats_server):
    from haru.log.eventlog import EventLog

    async with EventLog.connect([nats_server.url], writer="test") as log:
        await log.ensure()
        yield log
