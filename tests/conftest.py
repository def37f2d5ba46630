"""Shared fixtures: a real nats-server per test on a free loopback port, in a temporary store.

Integration tests use `nats_server` (a started `haru.host.natsd.NatsServer`) and `event_log`
(a connected `haru.log.eventlog.EventLog` with the streams ensured).
"""

from __future__ import annotations

import pytest

from haru.host.natsd import NatsServer
from tests.support.nvml_fake import build as build_fake_nvml

pytest_plugins = ["tests.support.hangdump"]


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


@pytest.fixture(scope="session")
def fake_nvml_dir(tmp_path_factory):
    """The directory of the compiled fake `libnvidia-ml.so.1` (tests/nvml/fake_nvml.c; cached across sessions)."""
    return build_fake_nvml(tmp_path_factory.mktemp("fake-nvml"))
