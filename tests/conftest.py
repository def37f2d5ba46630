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


# The order the workers take the test files in (pyproject.toml runs `--dist loadfile --no-loadscope-reorder`,
# so xdist hands files out in this order, whole): the files that run a real vLLM first, then those that run a
# real llama-server, then the rest as collected. Those few files are each minutes long; started last (xdist's
# own order is the files with the most tests first, which puts a one-test file like the adapter loop at the
# very end) they ran alone for the last three minutes of the suite while the other workers idled.
_HEAVY = {"vllm": 2, "llama": 1}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    weight: dict[str, int] = {}
    for item in items:
        heavy = max((_HEAVY.get(mark.name, 0) for mark in item.iter_markers()), default=0)
        weight[item.path.as_posix()] = max(weight.get(item.path.as_posix(), 0), heavy)
    first_seen = {path: i for i, path in reversed(list(enumerate(item.path.as_posix() for item in items)))}
    items.sort(key=lambda item: (-weight[item.path.as_posix()], first_seen[item.path.as_posix()]))
