"""A sleep is proven by what it freed, a wake by what it answers (on the simulator, whose faults make
the failures the real vLLM has shown: a wake that answers other text, an adapter that silently stops
applying, a "sleep" that only pauses the engine and keeps its memory)."""

from __future__ import annotations

import json
import signal

import aiohttp
import pytest

from haru.core import subjects
from haru.core.commands import Command
from haru.log.bus import send
from tests.support.agent_harness import get_json, is_, sim_fault, tag, wait_event, write_config, write_layout

pytestmark = pytest.mark.timeout(90)
MODEL = subjects.model("f", "a", "m1")


async def start_active(tmp_path, nats_server, event_log, agents, adapters=None):
    layout = write_layout(tmp_path / "layout.json", tmp_path)
    if adapters:
        doc = json.loads(layout.read_text())
        for d in doc["domains"]:
            d["slots"][0]["models"][0]["adapters"] = adapters
        layout.write_text(json.dumps(doc))
    cfg = write_config(tmp_path / "agent-a.json", nats_server.url, tmp_path, domain="a", layout=layout)
    agent = agents(cfg, tmp_path / "agent-a.log")
    res = await wait_event(event_log, MODEL, is_("model_resident"), agent=agent)
    return agent, res.event.endpoint


async def completion(endpoint: str, model: str) -> str:
    body = {"model": model, "prompt": "hi", "max_tokens": 8, "temperature": 0, "seed": 0}
    async with aiohttp.ClientSession() as s:
        async with s.post(endpoint + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["choices"][0]["text"]


async def test_a_wake_that_answers_other_text_fails_with_its_own_code_and_the_model_is_reloaded(
    tmp_path, nats_server, event_log, agents
):
    agent, endpoint = await start_active(tmp_path, nats_server, event_log, agents)
    before = await completion(endpoint, "m1")
    pid = (await wait_event(event_log, MODEL, is_("model_loading"))).event.pid
    assert (await send(event_log.bus, "f", "a", "sleep", Command(), timeout=10)).ok
    await sim_fault(endpoint, "corrupt_wake")
    wake = await send(event_log.bus, "f", "a", "wake", Command(op_id="w1"), timeout=20)
    assert not wake.ok and wake.error.code == "wake_answer_changed", wake
    assert "before the sleep" in wake.error.message and "after the wake" in wake.error.message
    # Never resident on the wrong answers: waking -> lost{unhealthy} in those words, then a fresh load.
    history = await event_log.history(MODEL)
    tags = [tag(r) for r in history]
    waking = tags.index("model_waking")
    assert tags[waking + 1] == "model_lost", tags
    lost = history[waking + 1].event
    assert lost.reason == "unhealthy" and lost.detail.startswith("wake_answer_changed:"), lost
    again = await wait_event(
        event_log, MODEL, lambda r: tag(r) == "model_resident" and r.seq > history[waking].seq, agent=agent, timeout=30
    )
    reload = next(
        r.event for r in await event_log.history(MODEL) if r.seq > history[waking + 1].seq and tag(r) == "model_loading"
    )
    assert reload.pid not in (0, pid)
    assert await completion(again.event.endpoint, "m1") == before  # the reloaded runtime answers as before


async def test_an_adapter_a_wake_stopped_applying_fails_the_wake(tmp_path, nats_server, event_log, agents):
    agent, endpoint = await start_active(tmp_path, nats_server, event_log, agents, adapters={"m1-sql": "/loras/sql"})
    base, adapter = await completion(endpoint, "m1"), await completion(endpoint, "m1-sql")
    assert base != adapter  # the adapter's answer is its own
    assert (await send(event_log.bus, "f", "a", "sleep", Command(), timeout=10)).ok
    await sim_fault(endpoint, "drop_adapter")
    wake = await send(event_log.bus, "f", "a", "wake", Command(op_id="w2"), timeout=20)
    assert not wake.ok and wake.error.code == "wake_answer_changed", wake
    assert "m1-sql" in wake.error.message and "'m1:" not in wake.error.message  # the base model still answered right
    lost = await wait_event(event_log, MODEL, is_("model_lost"), agent=agent, timeout=10)
    again = await wait_event(
        event_log, MODEL, lambda r: tag(r) == "model_resident" and r.seq > lost.seq, agent=agent, timeout=30
    )
    assert await completion(again.event.endpoint, "m1-sql") == adapter  # reloaded: the adapter applies again


async def test_a_clean_wake_passes_the_greedy_check(tmp_path, nats_server, event_log, agents):
    agent, endpoint = await start_active(tmp_path, nats_server, event_log, agents, adapters={"m1-sql": "/loras/sql"})
    assert (await send(event_log.bus, "f", "a", "sleep", Command(), timeout=10)).ok
    wake = await send(event_log.bus, "f", "a", "wake", Command(op_id="w3"), timeout=20)
    assert wake.ok, wake
    assert "greedy answers" in wake.data["models"]["m1"]["detail"]
    assert tag(await event_log.last(MODEL)) == "model_resident"


async def test_a_sleep_that_frees_nothing_is_not_recorded_asleep(tmp_path, nats_server, event_log, agents):
    """vLLM on a platform without sleep mode takes POST /sleep, says /is_sleeping true and frees
    nothing (its scheduler is paused). That is no sleep: the agent measures, wakes it again, keeps it
    resident, and does not put it to sleep again."""
    agent, endpoint = await start_active(tmp_path, nats_server, event_log, agents)
    await sim_fault(endpoint, "sleep_frees_nothing")
    reply = await send(event_log.bus, "f", "a", "sleep", Command(op_id="s1"), timeout=10)
    assert not reply.ok and reply.error.code == "sleep_freed_nothing", reply
    assert "paused, not asleep" in reply.error.message
    tags = [tag(r) for r in await event_log.history(MODEL)]
    assert "model_sleeping" not in tags and tags[-1] == "model_resident", tags
    assert (await get_json(endpoint + "/is_sleeping"))[1] == {"is_sleeping": False}  # woken again: it serves
    assert await completion(endpoint, "m1")
    again = await send(event_log.bus, "f", "a", "sleep", Command(op_id="s2"), timeout=10)
    assert again.ok and "no sleep mode" in again.data["models"]["m1"]["detail"], again
    assert (await get_json(endpoint + "/is_sleeping"))[1] == {"is_sleeping": False}  # not asked again


async def test_a_sleep_records_what_measured_it(tmp_path, nats_server, event_log, agents):
    agent, endpoint = await start_active(tmp_path, nats_server, event_log, agents)
    assert (await send(event_log.bus, "f", "a", "sleep", Command(), timeout=10)).ok
    last = await event_log.last(MODEL)
    assert tag(last) == "model_sleeping" and last.event.freed_bytes > 0
    assert last.event.measured_by == "process" and "held" in last.event.detail  # the runtime's own processes


async def test_an_agent_restarted_while_its_runtime_sleeps_still_checks_the_wake(
    tmp_path, nats_server, event_log, agents
):
    """The answers recorded before the sleep are kept with the runtime's identity (its file in the state
    directory), so the agent that adopts it asleep compares the wake's answers too."""
    agent, endpoint = await start_active(tmp_path, nats_server, event_log, agents, adapters={"m1-sql": "/loras/sql"})
    assert (await send(event_log.bus, "f", "a", "sleep", Command(), timeout=10)).ok
    identity = json.loads(next((tmp_path / "state" / "a" / "runtimes").glob("*.json")).read_text())
    assert set(identity["wake_answers"]) == {"m1", "m1-sql"} and all(identity["wake_answers"].values())
    agent.signal(signal.SIGTERM)  # a restart: the runtime keeps sleeping, the next agent adopts it
    assert await agent.wait(30) == 0
    sleeping = await event_log.last(MODEL)
    assert tag(sleeping) == "model_sleeping"
    cfg = tmp_path / "agent-a.json"
    again = agents(cfg, tmp_path / "agent-a2.log")
    adopted = await wait_event(
        event_log, MODEL, lambda r: tag(r) == "model_adopted" and r.seq > sleeping.seq, agent=again, timeout=30
    )
    assert adopted.event.asleep is True and adopted.event.endpoint == endpoint
    await sim_fault(endpoint, "corrupt_wake")
    wake = await send(event_log.bus, "f", "a", "wake", Command(op_id="w4"), timeout=20)
    assert not wake.ok and wake.error.code == "wake_answer_changed", wake
    assert "'m1:" not in wake.error.message and "before the sleep" in wake.error.message
    lost = await wait_event(event_log, MODEL, lambda r: tag(r) == "model_lost" and r.seq > adopted.seq, agent=again)
    assert lost.event.reason == "unhealthy" and lost.event.detail.startswith("wake_answer_changed:"), lost.event


async def test_a_checked_wake_leaves_no_answers_behind(tmp_path, nats_server, event_log, agents):
    agent, endpoint = await start_active(tmp_path, nats_server, event_log, agents)
    assert (await send(event_log.bus, "f", "a", "sleep", Command(), timeout=10)).ok
    path = next((tmp_path / "state" / "a" / "runtimes").glob("*.json"))
    assert "wake_answers" in json.loads(path.read_text())
    wake = await send(event_log.bus, "f", "a", "wake", Command(op_id="w5"), timeout=20)
    assert wake.ok and "recorded before the sleep" in wake.data["models"]["m1"]["detail"], wake
    assert "wake_answers" not in json.loads(path.read_text())  # checked once: the next wake needs the next sleep's


async def test_a_runtime_woken_by_an_agent_that_died_before_the_check_is_checked_on_adoption(
    tmp_path, nats_server, event_log, agents
):
    """The agent sent /wake_up and died before it compared the answers: the runtime is awake, its identity
    file still holds the answers from before the sleep, and the agent that adopts it checks them."""
    agent, endpoint = await start_active(tmp_path, nats_server, event_log, agents)
    assert (await send(event_log.bus, "f", "a", "sleep", Command(), timeout=10)).ok
    agent.signal(signal.SIGTERM)  # the runtime keeps sleeping
    assert await agent.wait(30) == 0
    await sim_fault(endpoint, "corrupt_wake")
    async with aiohttp.ClientSession() as s:  # what the dead agent did last: the wake itself
        async with s.post(endpoint + "/wake_up") as r:
            assert r.status == 200, await r.text()
    last = await event_log.last(MODEL)
    again = agents(tmp_path / "agent-a.json", tmp_path / "agent-a2.log")
    lost = await wait_event(
        event_log, MODEL, lambda r: tag(r) == "model_lost" and r.seq > last.seq, agent=again, timeout=30
    )
    assert lost.event.reason == "unhealthy" and lost.event.detail.startswith("wake_answer_changed:"), lost.event
    # never adopted (nor resident) on the wrong answers: lost, then reloaded from its files
    back = await wait_event(
        event_log, MODEL, lambda r: tag(r) == "model_resident" and r.seq > lost.seq, agent=again, timeout=30
    )
    since = [tag(r) for r in await event_log.history(MODEL) if last.seq < r.seq < back.seq]
    assert "model_adopted" not in since and "model_resident" not in since and "model_loading" in since, since
