"""Runtimes outlive their agent (issue 14): a restarted agent adopts them, and the serving port stays open.

Under a bounded chat load through the gateway (8 concurrent clients), the active domain's agent is
restarted (SIGTERM, and SIGKILL): no request fails, no model loads again, every runtime keeps its pid,
and each restart records `model_adopted`. A runtime that died while no agent watched is recorded `lost`
once and restarted; a pid reused by an unrelated process is never adopted nor signalled.

The runtimes and the serving port holder really outlive the agent (as everywhere: there is no mode
in which they die with it); every test stops them at the end (SIGINT: the agent unloads for good).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import pytest

from haru.core import subjects
from haru.host.children import alive as proc_alive
from haru.host.children import start_time
from tests.support.agent_harness import REPO, AgentProcess, tag
from tests.support.promoter import wait_view
from tests.support.sim_fleet import (
    FLEET,
    MODELS,
    RESTART_HEARTBEAT_TIMEOUT_MS,
    ChatLoad,
    identities,
    outliving_env,
    residency_tags,
    sim_fleet,
    sim_layout,
    steady,
    wait_adopted,
)


@pytest.fixture
async def fleet(tmp_path, nats_server, event_log):
    layout = sim_layout(tmp_path / "layout.json", tmp_path)
    async with sim_fleet(tmp_path, nats_server, event_log, layout) as f:
        await wait_view(event_log, steady, timeout=60, fleet=FLEET, what="a active and resident, b a standby")
        yield f


def bridged_requests(fleet) -> int:
    """Requests the active domain's serving port holder forwarded to a runtime while no agent accepted."""
    from haru.agents.portholder import holder_stats

    return holder_stats(fleet.state_dir("a"))["bridged"]


async def _restart_under_load(
    fleet, event_log, sig: int | list[int], times: int, models: tuple[str, ...] = MODELS
) -> ChatLoad:
    before = identities(fleet.state_dir("a"))
    assert set(before) == set(models)
    loading_before = {m: (await residency_tags(event_log, "a", m)).count("model_loading") for m in models}
    sigs = sig if isinstance(sig, list) else [sig] * times
    async with ChatLoad(fleet.gw.url, models=models) as load:
        await asyncio.sleep(0.5)
        for i in range(1, times + 1):
            old = fleet.agents["a"]
            if sigs[i - 1] == signal.SIGKILL:
                load.killed_at = min(load.killed_at, time.monotonic())
            old.signal(sigs[i - 1])
            await old.wait(60)
            new = fleet.start("a")
            for m in models:
                await wait_adopted(event_log, "a", m, i, new)
            await asyncio.sleep(0.3)
        await asyncio.sleep(0.5)
    after = identities(fleet.state_dir("a"))
    assert {m: d["pid"] for m, d in after.items()} == {m: d["pid"] for m, d in before.items()}, "a runtime was replaced"
    for m, doc in after.items():
        assert proc_alive(doc["pid"], doc["start"])
        tags = await residency_tags(event_log, "a", m)
        assert tags.count("model_loading") == loading_before[m], tags  # no load cycle
        assert "model_lost" not in tags and tags.count("model_adopted") == times, tags
        adopted = [r.event for r in await event_log.history(subjects.model(FLEET, "a", m)) if tag(r) == "model_adopted"]
        assert {e.pid for e in adopted} == {doc["pid"]} and not any(e.asleep for e in adopted)
    view = await wait_view(event_log, lambda v: v.active == "a", timeout=5, fleet=FLEET, what="a still active")
    assert view.active == "a"
    return load


@pytest.mark.timeout(240)
async def test_sigterm_restarts_keep_runtimes_and_fail_no_request(fleet, event_log):
    load = await _restart_under_load(fleet, event_log, signal.SIGTERM, times=5)
    assert load.failed == [] and load.ok > 50, (load.ok, load.failed[:5])
    bridged = bridged_requests(fleet)
    print(f"SIGTERM x5: {load.ok} answered ({bridged} by the port holder's bridge), {len(load.failed)} failed")
    assert bridged > 0  # the gaps between agents were bridged, not waited out in the accept queue
    stops = [r.event for r in await event_log.history(subjects.agent(FLEET, "a")) if tag(r) == "agent_stopping"]
    assert len(stops) == 5


@pytest.mark.timeout(180)
async def test_sigkill_of_the_agent_keeps_runtimes_and_the_next_agent_adopts_them(fleet, event_log):
    load = await _restart_under_load(fleet, event_log, signal.SIGKILL, times=2)
    # A SIGKILL ends the requests the agent was forwarding at that instant (it cannot tell whether the
    # runtime saw them, so they are never resent): at most one per client per kill. Every other request,
    # including all those that arrived while no agent ran, is answered.
    bridged = bridged_requests(fleet)
    print(f"SIGKILL x2: {load.ok} answered ({bridged} by the port holder's bridge), {len(load.failed)} failed")
    assert bridged > 0  # the killed agent's lease closed: the holder bridged without being told
    assert len(load.failed) <= 2 * load.clients and load.ok > 30, (load.ok, load.failed[:5])


async def _new_tags_once_reloaded(event_log, model: str, since: int, agent: AgentProcess) -> list[str]:
    """The residency events after the first `since`, up to the model resident again (the promoter may then
    fail the domain over, the reload after a loss being slower than the standby's probe, and it sleeps)."""
    deadline = time.monotonic() + 30
    while True:
        new = (await residency_tags(event_log, "a", model))[since:]
        if "model_loading" in new and "model_resident" in new[new.index("model_loading") :]:
            return new[: new.index("model_resident", new.index("model_loading")) + 1]
        assert time.monotonic() < deadline, (new, agent.output()[-4000:])
        await asyncio.sleep(0.1)


@pytest.mark.timeout(120)
async def test_a_runtime_that_died_while_no_agent_watched_is_lost_once_and_restarted(fleet, event_log):
    agent = fleet.agents["a"]
    agent.signal(signal.SIGTERM)
    await agent.wait(30)
    since = len(await residency_tags(event_log, "a", "m1"))
    victim = identities(fleet.state_dir("a"))["m1"]
    os.killpg(victim["pid"], signal.SIGKILL)
    while proc_alive(victim["pid"], victim["start"]):
        await asyncio.sleep(0.02)
    new_agent = fleet.start("a")
    await wait_adopted(event_log, "a", "m2", 1, new_agent)
    new = await _new_tags_once_reloaded(event_log, "m1", since, new_agent)
    assert new == ["model_lost", "model_loading", "model_resident"], new  # lost once, then restarted
    lost = [r.event for r in await event_log.history(subjects.model(FLEET, "a", "m1")) if tag(r) == "model_lost"][-1]
    assert lost.reason == "process_exited" and f"pid {victim['pid']}" in lost.detail and "no agent" in lost.detail
    # the reload is a restart (attempt 2): the promoter weighs it against the standby's wake (faster path)
    # and the gateway holds for it, as for a runtime that died under the agent's eyes
    loading = [r.event for r in await event_log.history(subjects.model(FLEET, "a", "m1")) if tag(r) == "model_loading"]
    assert loading[-1].attempt == 2, loading[-1]
    assert identities(fleet.state_dir("a"))["m1"]["pid"] != victim["pid"]
    # m2 was untouched: adopted, never lost nor reloaded (one spawn; a wait for its GPU's turn at the
    # first boot is a `model_loading` without a pid)
    m2 = await event_log.history(subjects.model(FLEET, "a", "m2"))
    assert sum(1 for r in m2 if tag(r) == "model_loading" and r.event.pid) == 1


@pytest.mark.timeout(120)
async def test_a_pid_reused_by_an_unrelated_process_is_not_adopted(fleet, event_log):
    agent = fleet.agents["a"]
    agent.signal(signal.SIGTERM)
    await agent.wait(30)
    since = len(await residency_tags(event_log, "a", "m1"))
    path = fleet.state_dir("a") / "runtimes" / "m1.json"
    doc = json.loads(path.read_text())
    os.killpg(doc["pid"], signal.SIGKILL)
    while proc_alive(doc["pid"], doc["start"]):
        await asyncio.sleep(0.02)
    # An unrelated process now holds the pid the file names (the kernel cannot be made to reuse one on
    # demand: the file is pointed at a live stranger, keeping the runtime's start time).
    stranger = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        path.write_text(json.dumps({**doc, "pid": stranger.pid}))
        new_agent = fleet.start("a")
        await wait_adopted(event_log, "a", "m2", 1, new_agent)
        new = await _new_tags_once_reloaded(event_log, "m1", since, new_agent)
        assert new == ["model_lost", "model_loading", "model_resident"], new
        lost = [r.event for r in await event_log.history(subjects.model(FLEET, "a", "m1")) if tag(r) == "model_lost"]
        assert "belongs to an unrelated process" in lost[-1].detail
        assert stranger.poll() is None and start_time(stranger.pid) is not None  # never signalled
        assert identities(fleet.state_dir("a"))["m1"]["pid"] not in (stranger.pid, doc["pid"])
    finally:
        stranger.kill()
        stranger.wait()


@pytest.mark.timeout(60)
async def test_a_sleeping_standby_runtime_is_adopted_asleep(fleet, event_log):
    agent = fleet.agents["b"]
    before = {m: await residency_tags(event_log, "b", m) for m in MODELS}
    assert all(tags[-1] == "model_sleeping" for tags in before.values()), before
    agent.signal(signal.SIGTERM)
    await agent.wait(30)
    new = fleet.start("b")
    for m in MODELS:
        deadline = time.monotonic() + 30
        while "model_adopted" not in (await residency_tags(event_log, "b", m))[len(before[m]) :]:
            assert time.monotonic() < deadline, new.output()[-3000:]
            await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)  # a probe interval or five: nothing else is recorded
    for m in MODELS:
        recs = (await event_log.history(subjects.model(FLEET, "b", m)))[len(before[m]) :]
        assert [tag(r) for r in recs] == ["model_adopted"], [tag(r) for r in recs]  # no wake, no sleep
        assert recs[0].event.asleep is True


# ----------------------------------------------------------------------------- real llama-servers


@pytest.mark.llama
@pytest.mark.timeout(180)
async def test_real_llama_servers_survive_agent_restarts_under_load(tmp_path, nats_server, event_log):
    from tests.support.llama import llama_binary, llama_model, real_layout, tiny_models

    binary = llama_binary()
    gguf = tiny_models(tmp_path / "gguf", {"a": 1, "b": 2})
    model = "tiny:chat"
    layout = real_layout(
        tmp_path / "layout.json",
        tmp_path,
        {d: [llama_model(model, binary, gguf[d])] for d in ("a", "b")},
        policy={"heartbeat_timeout_ms": RESTART_HEARTBEAT_TIMEOUT_MS},
        fleet=FLEET,
    )
    async with sim_fleet(tmp_path, nats_server, event_log, layout) as f:
        from haru.core.residency import Resident

        await wait_view(
            event_log,
            lambda v: (
                v.active == "a"
                and v.operation is None
                and all(isinstance(v.domains[d].models[model].residency, Resident) for d in ("a", "b"))
            ),
            timeout=60,
            fleet=FLEET,
            what="a active, both llama-servers resident",
        )
        load = await _restart_under_load(
            f, event_log, [signal.SIGTERM, signal.SIGTERM, signal.SIGKILL], 3, models=(model,)
        )
        print(f"real llama-server, SIGTERM x2 + SIGKILL: {load.ok} answered, {len(load.failed)} failed")
        # the two SIGTERMs fail nothing; the SIGKILL may end what was being forwarded at that instant
        assert all(t >= load.killed_at for t, _ in load.failed), load.failed
        assert len(load.failed) <= load.clients and load.ok > 20, (load.ok, load.failed[:5])


@pytest.mark.timeout(120)
async def test_a_restart_on_a_changed_layout_replaces_only_the_changed_model(fleet, event_log, tmp_path):
    """The agent is restarted on a layout where m2's context changed: `haru agent --dry-run` says m1 is
    adopted and m2 replaced; m1 keeps its pid and serves throughout, m2 is stopped and loaded anew."""
    agent = fleet.agents["a"]
    before = identities(fleet.state_dir("a"))
    since = {m: len(await residency_tags(event_log, "a", m)) for m in MODELS}
    doc = json.loads(fleet.layout.read_text())
    for d in doc["domains"]:
        for slot in d["slots"]:
            for model in slot.get("models", []):
                if model["name"] == "m2":
                    model["context_length"] = 4096
    fleet.layout.write_text(json.dumps(doc))
    async with ChatLoad(fleet.gw.url, models=("m1",)) as load:
        await asyncio.sleep(0.3)
        agent.signal(signal.SIGTERM)
        await agent.wait(30)
        dry = subprocess.run(
            [os.sys.executable, "-m", "haru.cli", "agent", "--config", str(agent.config), "--dry-run", "--json"],
            capture_output=True,
            text=True,
            env=outliving_env(),
            cwd=str(REPO),
            timeout=60,
        )
        assert dry.returncode == 0, dry.stderr
        plan = json.loads(dry.stdout)["runtimes"]
        assert plan["m1"][0] == "adopt" and plan["m2"][0] == "replace", plan
        new = fleet.start("a")
        await wait_adopted(event_log, "a", "m1", 1, new)
        tags = await _new_tags_once_reloaded(event_log, "m2", since["m2"], new)
        await asyncio.sleep(0.3)
    assert tags == ["model_stopped", "model_loading", "model_resident"], tags
    assert (await residency_tags(event_log, "a", "m1"))[since["m1"] :] == ["model_adopted"]
    after = identities(fleet.state_dir("a"))
    assert after["m1"]["pid"] == before["m1"]["pid"] and after["m2"]["pid"] != before["m2"]["pid"]
    assert "--max-model-len" in after["m2"]["argv"] and "4096" in after["m2"]["argv"]
    assert load.failed == [] and load.ok > 10, (load.ok, load.failed[:5])
