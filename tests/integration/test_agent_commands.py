"""Commands over nats.micro, the serving port, one agent per domain, and chains across a SIGKILL."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal

import aiohttp
import pytest

from haru.agents.sim.gpu_state import SimGpuState
from haru.core import subjects
from haru.core.commands import Command
from haru.core.errors import AgentGone
from haru.log.bus import send
from tests.support import haru
from tests.support.agent_harness import (
    agent_env,
    get_json,
    is_,
    kill_runtimes,
    sim_fault,
    tag,
    wait_event,
    write_config,
    write_layout,
)

pytestmark = pytest.mark.timeout(90)


async def start_active(tmp_path, nats_server, event_log, agents, env=None, models=None):
    layout = write_layout(tmp_path / "layout.json", tmp_path, models=models)
    cfg = write_config(tmp_path / "agent-a.json", nats_server.url, tmp_path, domain="a", layout=layout)
    agent = agents(cfg, tmp_path / "agent-a.log", env)
    res = await wait_event(event_log, subjects.model("f", "a", "m1"), is_("model_resident"), agent=agent)
    return agent, cfg, res.event.endpoint


async def test_sleep_wake_round_trip_checked_by_is_sleeping_and_probe(tmp_path, nats_server, event_log, agents):
    agent, _cfg, endpoint = await start_active(tmp_path, nats_server, event_log, agents)
    nc = event_log.bus
    reply = await send(nc, "f", "a", "sleep", Command(op_id="o1"), timeout=10)
    assert reply.ok, reply
    assert (await get_json(endpoint + "/is_sleeping"))[1] == {"is_sleeping": True}
    last = await event_log.last(subjects.model("f", "a", "m1"))
    assert tag(last) == "model_sleeping" and last.event.freed_bytes > 0  # measured on the (sim) GPU
    assert (await send(nc, "f", "a", "sleep", Command(op_id="o1"), timeout=10)).ok  # idempotent
    probe = await send(nc, "f", "a", "probe", Command(), timeout=10)
    assert not probe.ok and probe.error.code == "not_resident"

    wake = await send(nc, "f", "a", "wake", Command(op_id="o2"), timeout=10)
    assert wake.ok, wake
    assert (await get_json(endpoint + "/is_sleeping"))[1] == {"is_sleeping": False}
    tags = [tag(r) for r in await event_log.history(subjects.model("f", "a", "m1"))]
    assert tags[-3:] == ["model_sleeping", "model_waking", "model_resident"]
    again = await send(nc, "f", "a", "wake", Command(op_id="o2"), timeout=10)  # waking an awake server = ok
    assert again.ok and "already awake" in again.data["models"]["m1"]["detail"]
    probe = await send(nc, "f", "a", "probe", Command(models=["m1"]), timeout=10)
    assert probe.ok and probe.data["models"]["m1"]["latency_ms"] >= 0
    status = await send(nc, "f", "a", "status", Command(), timeout=10)
    assert status.ok and status.data["role"] == "active" and status.data["models"]["m1"]["state"] == "resident"
    unknown = await send(nc, "f", "a", "wake", Command(models=["nope"]), timeout=10)
    assert not unknown.ok and unknown.error.code == "model_not_found"


async def test_sleep_on_a_gpu_the_provider_took_is_refused_and_recorded_lost(tmp_path, nats_server, event_log, agents):
    """A failover demotes the old active by asking it to sleep. If its GPU is gone, a runtime may still
    answer /sleep; the truth is that the model is lost, and the reply says why."""
    layout = write_layout(tmp_path / "layout.json", tmp_path, policy={"probe_interval_ms": 60_000})
    cfg = write_config(tmp_path / "agent-a.json", nats_server.url, tmp_path, domain="a", layout=layout)
    agent = agents(cfg, tmp_path / "agent-a.log")
    subject = subjects.model("f", "a", "m1")
    res = await wait_event(event_log, subject, is_("model_resident"), agent=agent)
    SimGpuState(tmp_path / "sim" / "a", 0).set_present(False)  # no probe runs for a minute: only the command sees it
    reply = await send(event_log.bus, "f", "a", "sleep", Command(op_id="demote"), timeout=10)
    assert not reply.ok
    assert reply.error.code == "gpu_detached" and "lost, not asleep" in reply.error.message, reply
    last = await event_log.last(subject)
    assert tag(last) == "model_lost" and last.event.reason == "gpu_detached"
    assert (await get_json(res.event.endpoint + "/is_sleeping"))[1] == {"is_sleeping": False}


async def test_wake_with_oom_reports_out_of_memory(tmp_path, nats_server, event_log, agents):
    agent, _cfg, endpoint = await start_active(tmp_path, nats_server, event_log, agents)
    nc = event_log.bus
    assert (await send(nc, "f", "a", "sleep", Command(), timeout=10)).ok
    await sim_fault(endpoint, "oom_on_wake")
    wake = await send(nc, "f", "a", "wake", Command(op_id="o3"), timeout=10)
    assert not wake.ok
    assert wake.error.code == "out_of_memory" and "out of memory" in wake.error.message.lower()
    assert (await get_json(endpoint + "/is_sleeping"))[1] == {"is_sleeping": True}
    assert tag(await event_log.last(subjects.model("f", "a", "m1"))) == "model_sleeping"  # the truth: still asleep
    retry = await send(nc, "f", "a", "wake", Command(op_id="o3"), timeout=10)
    assert retry.ok, retry


async def test_serving_port_forwards_byte_identically_and_refuses_the_rest(tmp_path, nats_server, event_log, agents):
    env = agent_env(HARU_SERVING_TOKEN="s3cret")
    agent, _cfg, endpoint = await start_active(tmp_path, nats_server, event_log, agents, env=env)
    status = await send(event_log.bus, "f", "a", "status", Command(), timeout=10)
    serving = status.data["serving_url"]
    auth = {"Authorization": "Bearer s3cret"}
    body = json.dumps(
        {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "seed": 7}
    ).encode()
    async with aiohttp.ClientSession() as s:
        async with s.post(
            serving + "/v1/chat/completions", data=body, headers={**auth, "Content-Type": "application/json"}
        ) as r:
            assert r.status == 200
            via = json.loads(await r.read())
        async with s.post(
            endpoint + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        ) as r:
            direct = json.loads(await r.read())
        for d in (via, direct):  # ids and timestamps differ per request; the content must not
            d.pop("id", None), d.pop("created", None)
        assert via == direct and "[domain a]" in json.dumps(via)

        sse = json.loads(body)
        sse["stream"] = True
        sse_body = json.dumps(sse).encode()
        async with s.post(serving + "/v1/chat/completions", data=sse_body, headers=auth) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            chunks = [c async for c in r.content.iter_any()]
        raw = b"".join(chunks)
        assert raw.rstrip().endswith(b"data: [DONE]") and raw.count(b"data: ") >= 3
        async with s.post(endpoint + "/v1/chat/completions", data=sse_body) as r:
            direct_raw = await r.read()

        def normalize(b: bytes) -> list:
            out = []
            for line in b.split(b"\n"):
                if line.startswith(b"data: {"):
                    d = json.loads(line[6:])
                    d.pop("id", None), d.pop("created", None)
                    out.append(d)
                elif line:
                    out.append(line)
            return out

        assert normalize(raw) == normalize(direct_raw)

        # the body reaches the runtime byte-identical: an echo of a body with odd spacing and extensions
        odd = b'{"model":"m1",  "prompt": "x", "max_tokens": 2, "vendor_ext": {"k": [1, 2.50]}}'
        async with s.post(serving + "/v1/completions", data=odd, headers=auth) as r:
            assert r.status == 200

        for method, path in (
            ("POST", "/sleep"),
            ("POST", "/wake_up"),
            ("GET", "/is_sleeping"),
            ("GET", "/health"),
            ("POST", "/_sim/crash"),
            ("GET", "/metrics"),
            ("POST", "/v1/chat/completions/x"),
        ):
            async with s.request(method, serving + path, headers=auth) as r:
                assert r.status == 404, (method, path, r.status)
                assert (await r.json())["error"]["code"] == "not_found"
        async with s.post(serving + "/v1/chat/completions", data=body) as r:
            assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
        async with s.post(serving + "/v1/chat/completions", data=body, headers={"Authorization": "Bearer nope"}) as r:
            assert r.status == 401
        async with s.post(
            serving + "/v1/chat/completions", headers=auth, data=json.dumps({"model": "other", "messages": []}).encode()
        ) as r:
            assert r.status == 404
            # the gateway's answer for the same condition, from the same table (haru.core.openai_errors)
            assert (await r.json())["error"] == {
                "message": "the model `other` does not exist on domain 'a'",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        async with s.post(serving + "/v1/chat/completions", headers=auth, data=b"not json") as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_request"
        async with s.get(serving + "/v1/models", headers=auth) as r:
            models = await r.json()
            assert [m["id"] for m in models["data"]] == ["m1"] and models["data"][0]["residency"] == "resident"
        # the runtime's tokenizer too (the gateway counts a continued stream's tokens with it)
        tokenize = {"model": "m1", "prompt": "hello there"}
        async with s.post(serving + "/tokenize", headers=auth, json=tokenize) as r:
            assert r.status == 200 and (await r.json())["count"] == 2
        async with s.post(serving + "/tokenize", json=tokenize) as r:
            assert r.status == 401
    # the runtime itself is still awake: nobody slept it through the serving port
    assert (await get_json(endpoint + "/is_sleeping"))[1] == {"is_sleeping": False}


async def test_second_agent_for_the_same_domain_is_refused(tmp_path, nats_server, event_log, agents):
    first, cfg, _endpoint = await start_active(tmp_path, nats_server, event_log, agents)
    seq_before = (await event_log.last(subjects.agent("f", "a"))).seq
    second = agents(cfg, tmp_path / "agent-a-2.log")
    assert await second.wait(20) == 4  # ExitStatus.CONFLICT
    assert "another agent already runs domain 'a'" in second.output()
    assert (await event_log.last(subjects.agent("f", "a"))).seq == seq_before  # the refused one wrote nothing
    assert first.proc.poll() is None


def walk_chain(records) -> None:
    prev = ""
    for rec in records:
        assert rec.event.prev == prev, f"{rec.subject} seq {rec.seq}: prev {rec.event.prev!r} != {prev!r}"
        prev = hashlib.sha256(rec.data).hexdigest()


async def test_restart_after_sigkill_continues_every_chain(tmp_path, nats_server, event_log, agents):
    first, cfg, _endpoint = await start_active(tmp_path, nats_server, event_log, agents)
    first.signal(signal.SIGKILL)
    await first.wait(10)
    kill_runtimes(first.state_dir)  # a runtime outlives its agent on purpose: this test wants it gone too
    with pytest.raises(AgentGone):
        await send(event_log.bus, "f", "a", "status", Command(), timeout=2)
    second = agents(cfg, tmp_path / "agent-a-2.log")
    await wait_event(
        event_log,
        subjects.agent("f", "a"),
        lambda r: tag(r) == "agent_started" and r.event.pid == second.pid,
        agent=second,
    )
    model = subjects.model("f", "a", "m1")
    lost = await wait_event(event_log, model, is_("model_lost"), agent=second)
    assert lost.event.reason == "process_exited"  # its runtime died with the first agent
    await wait_event(event_log, model, lambda r: tag(r) == "model_resident" and r.seq > lost.seq, agent=second)
    second.signal(signal.SIGINT)
    assert await second.wait() == 0
    by_subject: dict[str, list] = {}
    for rec in await event_log.history("haru.evt.f.a.>"):
        by_subject.setdefault(rec.subject, []).append(rec)
    assert set(by_subject) >= {subjects.agent("f", "a"), model, subjects.gpu("f", "a", 0)}
    for records in by_subject.values():
        walk_chain(records)
    verify = haru("verify", "--json", nats_url=nats_server.url)  # the project's own verifier agrees
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert [tag(r) for r in by_subject[subjects.agent("f", "a")]] == [
        "agent_started",
        "agent_started",
        "agent_stopping",
    ]


def connections_to(port: int) -> int:
    """Established TCP connections whose remote end is 127.0.0.1:<port> (client sides only)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "01" and int(parts[2].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


async def test_client_disconnect_cancels_upstream(tmp_path, nats_server, event_log, agents):
    agent, _cfg, endpoint = await start_active(
        tmp_path, nats_server, event_log, agents, models={"m1": {"HARU_SIM_TOKENS_PER_S": "5"}}
    )
    port = int(endpoint.rsplit(":", 1)[1])
    status = await send(event_log.bus, "f", "a", "status", Command(), timeout=10)
    serving = status.data["serving_url"]
    body = json.dumps(
        {
            "model": "m1",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 200,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    baseline = connections_to(port)  # the agent's own probe connection, kept alive
    async with aiohttp.ClientSession() as s:
        async with s.post(serving + "/v1/chat/completions", data=body) as r:
            assert r.status == 200
            await r.content.readany()
            during = connections_to(port)
            assert during >= baseline + 1
            r.close()  # the client goes away mid-stream (40 s of tokens left)
    deadline = asyncio.get_running_loop().time() + 5
    while connections_to(port) >= during and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
    assert connections_to(port) < during  # the upstream request was cancelled, its connection closed
    async with aiohttp.ClientSession() as s:  # and the next request is served
        async with s.post(
            serving + "/v1/completions", data=json.dumps({"model": "m1", "prompt": "x", "max_tokens": 1}).encode()
        ) as r:
            assert r.status == 200


async def test_two_agents_started_at_once_exactly_one_wins(tmp_path, nats_server, event_log, agents):
    layout = write_layout(tmp_path / "layout.json", tmp_path)
    cfg = write_config(tmp_path / "agent-a.json", nats_server.url, tmp_path, domain="a", layout=layout)
    one, two = agents(cfg, tmp_path / "one.log"), agents(cfg, tmp_path / "two.log")
    await wait_event(event_log, subjects.model("f", "a", "m1"), is_("model_resident"))
    for _ in range(200):  # the loser may have lost the append race, or found the winner alive: either way it exits
        if one.proc.poll() is not None or two.proc.poll() is not None:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.3)
    codes = [p.proc.poll() for p in (one, two)]
    assert sorted(codes, key=lambda c: c is None) == [4, None], codes  # one refused (CONFLICT), one running
    starts = [r for r in await event_log.history(subjects.agent("f", "a")) if tag(r) == "agent_started"]
    assert len(starts) == 1
    winner = one if one.proc.poll() is None else two
    assert starts[0].event.pid == winner.pid


async def test_heartbeat_micro_discovery_and_gpu_observed_only_on_change(tmp_path, nats_server, event_log, agents):
    from haru.core.commands import heartbeat_decoder

    agent, _cfg, _endpoint = await start_active(tmp_path, nats_server, event_log, agents)
    nc = event_log.nc  # nats.micro discovery: a real-server fact
    sub = await nc.subscribe(subjects.heartbeat("f", "a"))
    msg = await sub.next_msg(timeout=3)
    hb = heartbeat_decoder.decode(msg.data)
    assert hb.fleet == "f" and hb.domain == "a" and hb.pid == agent.pid and hb.models == {"m1": "resident"}
    assert "active" in hb.summary
    await sub.unsubscribe()
    ping = await nc.request("$SRV.PING.haru-agent", b"", timeout=2)
    info = json.loads(ping.data)
    assert info["name"] == "haru-agent" and info["metadata"]["domain"] == "a" and info["metadata"]["fleet"] == "f"
    # the GPU is observed on change only: a steady host writes nothing new over many probe intervals
    await asyncio.sleep(0.6)
    before = len(await event_log.history(subjects.gpu("f", "a", 0)))
    await asyncio.sleep(1.5)
    assert len(await event_log.history(subjects.gpu("f", "a", 0))) == before
