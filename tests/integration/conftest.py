"""Fixtures shared by the integration tests (the nats-server ones are in tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.support.agent_harness import AgentProcess, agent_env
from tests.support.log_world import log_kind, world  # noqa: F401 - fixtures: a scenario on either log


@pytest.fixture
def agents():
    """Start real `haru agent` processes; every one is killed at the end, pass or fail."""
    started: list[AgentProcess] = []

    def start(config, log_path, env=None):
        a = AgentProcess(config, log_path, env or agent_env())
        started.append(a)
        return a

    yield start
    for a in started:
        a.kill()
