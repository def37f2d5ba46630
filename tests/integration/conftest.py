"""Fixtures shared by the integration tests (the nats-server ones are in tests/conftest.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from datetime import UTC, datetime

import pytest

from haru.core import subjects
from haru.core.events import RouteMoved
from haru.gateway import Gateway, GatewayConfig
from haru.host.tasks import cancel_and_wait
from haru.log.apply import apply
from haru.projections.projector import Projector
from tests.support.agent_harness import AgentProcess, agent_env
from tests.support.cluster import DEPLOY, REPO, start_cluster
from tests.support.control import echo_upstream, layout
from tests.support.gateway import Upstream, running_gateway
from tests.support.llama import llama_binary, tiny_models
from tests.support.log_world import log_kind, world  # noqa: F401 - fixtures: a scenario on either log
from tests.support.wait import wait_until


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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("deploy-cluster"))
    try:
        # The streams, as an operator creates them on a new cluster: the shipped script, as admin.
        done = subprocess.run(
            [
                sys.executable,
                str(DEPLOY / "ensure_streams.py"),
                "--nats-url",
                ",".join(c.urls("admin")),
                "--wait",
                "30",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        # the three streams and the two object stores (adapters, training checkpoints)
        assert done.stdout.count("replicas 3") == 5, done.stdout
        yield c
    finally:
        c.stop()


@pytest.fixture
async def upstreams():
    started: list[Upstream] = []

    async def make(domain: str) -> Upstream:
        up = await Upstream(domain).start()
        started.append(up)
        return up

    try:
        yield make
    finally:
        for up in started:
            await up.stop()


@pytest.fixture
async def gw(event_log):
    async with running_gateway(event_log) as gw:
        yield gw


@pytest.fixture
async def ops(event_log):
    """Fleet `ops` declared (a and b), a active, the real projector running, a gateway in front."""
    runners = []
    ra, url_a = await echo_upstream("a")
    rb, url_b = await echo_upstream("b")
    runners += [ra, rb]
    now = datetime.now(UTC)
    await apply(event_log, layout(url_a, url_b), now)
    await event_log.append(subjects.route("ops"), RouteMoved(at=now, active="a"), expect=0)
    projector = asyncio.create_task(Projector(event_log).run())
    try:
        async with Gateway(GatewayConfig(port=0), event_log) as gw:
            # the route intent and the view arrive apart: the control API answers from the view
            await wait_until(
                lambda: (r := gw.table.get("ops")) is not None and r.active == "a" and r.view is not None,
                10.0,
                interval_s=0.01,
            )
            yield gw, event_log
    finally:
        await cancel_and_wait(projector)
        for r in runners:
            await r.cleanup()


@pytest.fixture(scope="module")
def llama():
    return llama_binary()


@pytest.fixture(scope="module")
def gguf(tmp_path_factory, llama):
    root = tmp_path_factory.mktemp("gguf")
    return tiny_models(root, {"a": 1, "b": 2})
