"""Planned flips drain: the old active's agent lets the requests it is answering finish before its
runtimes are put to sleep (a real agent on the simulator, a real nats-server)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from haru.core import subjects
from haru.core.commands import Command
from haru.log.bus import send
from tests.support.agent_harness import is_, wait_event, write_config, write_layout

pytestmark = pytest.mark.timeout(120)


async def _agent(tmp_path, nats_server, event_log, agents, drain_ms: int):
    # 20 tokens/s: a 16-token stream takes ~0.8 s
    layout = write_layout(
        tmp_path / "layout.json",
        tmp_path,
        policy={"drain_ms": drain_ms},
        models={"m1": {"HARU_SIM_TOKENS_PER_S": "20"}},
    )
    cfg = write_config(tmp_path / "agent-a.json", nats_server.url, tmp_path, domain="a", layout=layout)
    agent = agents(cfg, tmp_path / "agent-a.log")
    await wait_event(event_log, subjects.model("f", "a", "m1"), is_("model_resident"), agent=agent)
    status = await send(event_log.bus, "f", "a", "status", Command(), timeout=10)
    return status.data["serving_url"]


async def _stream(url: str, tokens: int = 16) -> tuple[bytes, float]:
    body = {
        "model": "m1",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": tokens,
        "ignore_eos": True,
    }
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            data = await r.read()
    return data, time.monotonic()


async def test_sleep_lets_the_requests_in_flight_finish_first(tmp_path, nats_server, event_log, agents):
    url = await _agent(tmp_path, nats_server, event_log, agents, drain_ms=20_000)
    stream = asyncio.create_task(_stream(url))
    await asyncio.sleep(0.3)  # under way
    reply = await send(event_log.bus, "f", "a", "sleep", Command(level=1), timeout=30)
    slept_at = time.monotonic()
    data, ended_at = await stream
    assert reply.ok, reply
    assert data.endswith(b"data: [DONE]\n\n") and data.count(b'"content":"') >= 16
    assert ended_at <= slept_at  # the sleep answered only once the stream had ended


async def test_the_drain_is_bounded_by_policy(tmp_path, nats_server, event_log, agents):
    url = await _agent(tmp_path, nats_server, event_log, agents, drain_ms=100)
    stream = asyncio.create_task(_stream(url, tokens=200))  # ~10 s at 20 tokens/s
    await asyncio.sleep(0.3)
    started = time.monotonic()
    reply = await send(event_log.bus, "f", "a", "sleep", Command(level=1), timeout=30)
    # the sleep did not wait for the stream's ~10 s (a generous bound: a loaded box is slow, not 50x slow)
    assert reply.ok and time.monotonic() - started < 5
    stream.cancel()
