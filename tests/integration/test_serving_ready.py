"""The serving port's readiness path, for a load balancer in front of a domain's hosts (SkyServe's
readiness probe sends no header): unauthenticated, 200 only while the host is a fit member of its
domain (the active with its models resident, a standby with its models asleep or resident), 503
otherwise, and nothing but that in the body. Everything else on the port still needs the token."""

from __future__ import annotations

import json

import aiohttp
import pytest

from haru.agents.serving import READY_PATH, ready_for_balancer
from haru.agents.sim.gpu_state import SimGpuState
from haru.core import subjects
from haru.core.commands import Command
from haru.log.bus import send
from tests.support.agent_harness import is_, wait_event, write_config, write_layout

pytestmark = pytest.mark.timeout(90)
TOKEN = "serving-s3cret"


def test_ready_means_a_fit_member_of_the_domain():
    assert ready_for_balancer("active", ["resident", "resident"])
    assert not ready_for_balancer("active", ["resident", "sleeping"])  # the active serves every model
    assert ready_for_balancer("standby", ["sleeping", "resident"])  # a standby that can take over
    for state in ("loading", "waking", "lost", "failed", "unknown", "pulling"):
        assert not ready_for_balancer("active", ["resident", state]), state
        assert not ready_for_balancer("standby", ["sleeping", state]), state
    assert ready_for_balancer("active", ["resident", "not_admitted", "stopped"])  # not meant to run here
    assert not ready_for_balancer("active", ["not_admitted"]) and not ready_for_balancer("standby", [])


async def _ready(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.get(url + READY_PATH) as r:  # no Authorization, as SkyServe
        return r.status, json.loads(await r.read())


async def test_the_ready_path_answers_without_the_token_and_follows_residency(tmp_path, nats_server, event_log, agents):
    layout = write_layout(tmp_path / "layout.json", tmp_path)
    urls = {}
    for d in ("a", "b"):
        cfg = write_config(tmp_path / f"agent-{d}.json", nats_server.url, tmp_path, domain=d, layout=layout)
        agent = agents(cfg, tmp_path / f"agent-{d}.log", {"HARU_SERVING_TOKEN": TOKEN})
        await wait_event(event_log, subjects.model("f", d, "m1"), is_("model_resident"), agent=agent)
        urls[d] = (await send(event_log.bus, "f", d, "status", Command(), timeout=10)).data["serving_url"]
    await wait_event(event_log, subjects.model("f", "b", "m1"), is_("model_sleeping"))  # the standby sleeps

    assert await _ready(urls["a"]) == (200, {"ready": True})  # the active, resident
    assert await _ready(urls["b"]) == (200, {"ready": True})  # a standby asleep: fit, must not be torn down
    async with aiohttp.ClientSession() as s, s.get(urls["a"] + "/v1/models") as r:
        assert r.status == 401  # the rest of the port still needs the token

    SimGpuState(tmp_path / "sim" / "a", 0).set_present(False)  # the provider took a's GPU
    await wait_event(event_log, subjects.model("f", "a", "m1"), is_("model_lost", reason="gpu_detached"))
    assert await _ready(urls["a"]) == (503, {"ready": False})
