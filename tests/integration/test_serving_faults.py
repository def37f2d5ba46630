"""The agent's serving port against hostile clients and failing runtimes (a real agent on the simulator).

- a JSON body nested 10,000 deep is a 400 in OpenAI's shape, not a 500;
- `Authorization: bearer` is accepted whatever the scheme's case;
- while requests flow, a GPU detached or a model evicted never lets the runtime's own 500
  "CUDA error" or 404 "does not exist" reach a client: the serving port answers with residency.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from haru.agents.sim.gpu_state import SimGpuState
from haru.core import subjects
from haru.core.commands import Command
from haru.log.bus import send
from tests.support.agent_harness import agent_env, is_, sim_fault, tag, wait_event, write_config, write_layout

pytestmark = pytest.mark.timeout(120)

# The periodic probe is slow on purpose: the window in which only the serving port can know is wide.
SLOW_PROBE = {"probe_interval_ms": 3000}
CHAT = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


async def start(tmp_path, nats_server, event_log, agents, env=None, policy=SLOW_PROBE):
    layout = write_layout(tmp_path / "layout.json", tmp_path, policy=policy)
    cfg = write_config(tmp_path / "agent-a.json", nats_server.url, tmp_path, domain="a", layout=layout)
    agent = agents(cfg, tmp_path / "agent-a.log", env)
    res = await wait_event(event_log, subjects.model("f", "a", "m1"), is_("model_resident"), agent=agent)
    status = await send(event_log.bus, "f", "a", "status", Command(), timeout=10)
    return agent, res.event.endpoint, status.data["serving_url"]


class Load:
    """Clients sending chat requests back to back; every answer's (status, error code) is kept."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.url = url
        self.clients = clients
        self.answers: list[tuple[int, str, str]] = []
        self.gone: list[tuple[str, str]] = []  # (error code, X-Haru-Runtime-Gone) of each refusal
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _client(self, session: aiohttp.ClientSession) -> None:
        while not self._stop.is_set():
            async with session.post(
                self.url + "/v1/chat/completions", data=CHAT, headers={"Content-Type": "application/json"}
            ) as r:
                body = await r.read()
                code = ""
                if r.status != 200:
                    code = (json.loads(body).get("error") or {}).get("code") or ""
                    self.gone.append((code, r.headers.get("X-Haru-Runtime-Gone", "")))
                self.answers.append((r.status, code, body.decode(errors="replace")[:200]))

    async def __aenter__(self) -> Load:
        self._session = aiohttp.ClientSession()
        self._tasks = [asyncio.create_task(self._client(self._session)) for _ in range(self.clients)]
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._session.close()

    async def wait_answers(self, n: int, timeout: float = 20) -> None:
        async with asyncio.timeout(timeout):
            while len(self.answers) < n:
                await asyncio.sleep(0.02)


async def test_a_detached_gpu_is_answered_as_gpu_detached_never_as_the_runtimes_500(
    tmp_path, nats_server, event_log, agents
):
    _agent, _endpoint, serving = await start(tmp_path, nats_server, event_log, agents)
    async with Load(serving) as load:
        await load.wait_answers(20)
        before = len(load.answers)
        SimGpuState(tmp_path / "sim" / "a", 0).set_present(False)
        lost = await wait_event(event_log, subjects.model("f", "a", "m1"), is_("model_lost", reason="gpu_detached"))
        await load.wait_answers(len(load.answers) + 20)
    after = load.answers[before:]
    assert all(status == 200 or (status, code) == (503, "gpu_detached") for status, code, _ in after), after
    assert (503, "gpu_detached") in [(s, c) for s, c, _ in after]
    assert all("CUDA" not in text for _, _, text in after)
    assert lost.event.reason == "gpu_detached"


async def test_an_evicted_model_is_answered_as_lost_never_as_the_runtimes_404(tmp_path, nats_server, event_log, agents):
    _agent, endpoint, serving = await start(tmp_path, nats_server, event_log, agents)
    subject = subjects.model("f", "a", "m1")
    async with Load(serving) as load:
        await load.wait_answers(20)
        before = len(load.answers)
        await sim_fault(endpoint, "evict")
        lost = await wait_event(event_log, subject, is_("model_lost", reason="evicted"))
        # ... and on through the reload, to resident again
        await wait_event(event_log, subject, lambda r: tag(r) == "model_resident" and r.seq > lost.seq, timeout=30)
        await load.wait_answers(len(load.answers) + 10)
    after = load.answers[before:]
    allowed = {(503, "model_lost"), (503, "model_warming")}
    assert all(status == 200 or (status, code) in allowed for status, code, _ in after), after
    assert (503, "model_lost") in [(s, c) for s, c, _ in after]
    assert after[-1][0] == 200
    # both mark the runtime gone, so the gateway sends the request once more (the runtime never saw it)
    assert {(code, mark) for code, mark in load.gone} <= {("model_lost", "evicted"), ("model_warming", "restarting")}, (
        load.gone
    )


async def test_deep_nesting_and_the_bearer_scheme_in_any_case(tmp_path, nats_server, event_log, agents):
    env = agent_env(HARU_SERVING_TOKEN="s3cret")
    _agent, _endpoint, serving = await start(tmp_path, nats_server, event_log, agents, env=env)
    deep = b'{"model": "m1", "messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    async with aiohttp.ClientSession() as s:
        for scheme in ("Bearer", "bearer", "BEARER"):
            async with s.post(
                serving + "/v1/chat/completions", data=CHAT, headers={"Authorization": f"{scheme} s3cret"}
            ) as r:
                assert r.status == 200, (scheme, await r.text())
        async with s.post(serving + "/v1/chat/completions", data=CHAT, headers={"Authorization": "bearer nope"}) as r:
            assert r.status == 401
        for _ in range(3):  # every time, not only the first
            async with s.post(
                serving + "/v1/chat/completions", data=deep, headers={"Authorization": "Bearer s3cret"}
            ) as r:
                assert r.status == 400
                err = (await r.json())["error"]
                assert err["code"] == "invalid_request" and "nested too deeply" in err["message"]
                assert set(err) == {"message", "type", "param", "code"}


async def test_slow_clients_cannot_hold_the_serving_port(tmp_path, nats_server, event_log, agents):
    from urllib.parse import urlsplit

    from tests.support.gateway import Slowloris

    env = agent_env(HARU_CLIENT_HEADER_TIMEOUT_MS="1000", HARU_CLIENT_MAX_IDLE="4")
    _agent, _endpoint, serving = await start(tmp_path, nats_server, event_log, agents, env=env)
    port = urlsplit(serving).port
    slow = [Slowloris() for _ in range(16)]
    tasks = [asyncio.create_task(s.run(port)) for s in slow]
    async with asyncio.timeout(30):
        while sum(s.closed_at is None for s in slow) > 4:
            await asyncio.sleep(0.05)
    async with aiohttp.ClientSession() as s:
        async with s.post(serving + "/v1/chat/completions", data=CHAT) as r:
            assert r.status == 200
    async with asyncio.timeout(30):
        await asyncio.gather(*tasks)
    assert all(s.closed_at is not None for s in slow)


async def test_a_model_put_to_sleep_under_load_is_answered_asleep_and_marked_for_the_gateway(
    tmp_path, nats_server, event_log, agents
):
    # a demotion of a domain a gateway still routes to (it has yet to see the route move): every request
    # refused from the moment the runtime sleeps, the sleep command still under way included, says so
    # with the mark that makes the gateway send it to the active, never with the runtime's own 503
    policy = {**SLOW_PROBE, "drain_ms": 300}  # the load never lets the drain find the port idle
    _agent, _endpoint, serving = await start(tmp_path, nats_server, event_log, agents, policy=policy)
    async with Load(serving) as load:
        await load.wait_answers(20)
        before = len(load.answers)
        assert (await send(event_log.bus, "f", "a", "sleep", Command(op_id="demote"), timeout=10)).ok
        await load.wait_answers(len(load.answers) + 20)
    after = load.answers[before:]
    assert all(status == 200 or (status, code) == (503, "model_asleep") for status, code, _ in after), after
    assert after[-1][:2] == (503, "model_asleep")
    assert set(load.gone) == {("model_asleep", "asleep")}, load.gone
