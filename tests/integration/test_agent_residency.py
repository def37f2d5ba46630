"""The agent as a real process on the simulator: residency from real signals."""

from __future__ import annotations

import asyncio
import signal

import pytest

from haru.agents.sim.gpu_state import SimGpuState
from haru.core import subjects
from haru.core.commands import Command
from haru.log.bus import send
from tests.support.agent_harness import (
    is_,
    model_tags,
    sim_fault,
    tag,
    wait_event,
    write_config,
    write_layout,
)

pytestmark = pytest.mark.timeout(90)


async def start_resident(tmp_path, nats_server, event_log, agents, *, models=None, domain="a", **layout_kw):
    layout = write_layout(tmp_path / "layout.json", tmp_path, models=models, **layout_kw)
    cfg = write_config(tmp_path / f"agent-{domain}.json", nats_server.url, tmp_path, domain=domain, layout=layout)
    agent = agents(cfg, tmp_path / f"agent-{domain}.log")
    for name in models or {"m1": {}}:
        await wait_event(event_log, subjects.model("f", domain, name), is_("model_resident"), agent=agent)
    return agent


async def test_loads_to_resident_then_sigint_records_stopped(tmp_path, nats_server, event_log, agents):
    agent = await start_resident(tmp_path, nats_server, event_log, agents)
    recs = await event_log.history(subjects.model("f", "a", "m1"))
    loading, resident = recs[0].event, recs[1].event
    assert tag(recs[0]) == "model_loading" and loading.attempt == 1 and loading.pid > 0
    assert tag(recs[1]) == "model_resident" and resident.warmup_ms >= 200  # measured: the sim loads for 200 ms
    started = await event_log.last(subjects.agent("f", "a"))
    assert tag(started) == "agent_started" and started.event.pid == agent.pid

    agent.signal(signal.SIGINT)  # stopping for good unloads (SIGTERM, a restart, keeps them: test_agent_restart)
    assert await agent.wait() == 0
    assert (await model_tags(event_log, "f", "a", "m1"))[-1] == "model_stopped"
    assert tag(await event_log.last(subjects.agent("f", "a"))) == "agent_stopping"
    # every child reaped: the runtime's pid is gone
    import os

    with pytest.raises(ProcessLookupError):
        os.kill(loading.pid, 0)


async def test_runtime_sigkill_is_lost_process_exited_and_restarted(tmp_path, nats_server, event_log, agents):
    agent = await start_resident(tmp_path, nats_server, event_log, agents)
    loading = (await event_log.history(subjects.model("f", "a", "m1")))[0].event
    import os

    os.kill(loading.pid, signal.SIGKILL)
    lost = await wait_event(event_log, subjects.model("f", "a", "m1"), is_("model_lost"), agent=agent)
    assert lost.event.reason == "process_exited" and lost.event.exit_code == -9
    again = await wait_event(event_log, subjects.model("f", "a", "m1"), is_("model_loading", attempt=2), agent=agent)
    assert again.event.pid != loading.pid
    await wait_event(
        event_log,
        subjects.model("f", "a", "m1"),
        lambda r: tag(r) == "model_resident" and r.seq > again.seq,
        agent=agent,
    )


async def test_gpu_detached_and_evicted(tmp_path, nats_server, event_log, agents):
    agent = await start_resident(tmp_path, nats_server, event_log, agents, models={"m1": {}, "m2": {}})
    subj2 = subjects.model("f", "a", "m2")
    # Evicted: the engine drops the model, the process lives and the GPU is there.
    res2 = await wait_event(event_log, subj2, is_("model_resident"))
    await sim_fault(res2.event.endpoint, "evict")
    lost = await wait_event(event_log, subj2, is_("model_lost"), agent=agent)
    assert lost.event.reason == "evicted", lost.event
    # ... and the agent reloads it.
    await wait_event(event_log, subj2, lambda r: tag(r) == "model_resident" and r.seq > lost.seq, agent=agent)

    # Detached: the provider takes the GPU.
    SimGpuState(tmp_path / "sim" / "a", 0).set_present(False)
    lost1 = await wait_event(
        event_log, subjects.model("f", "a", "m1"), is_("model_lost", reason="gpu_detached"), agent=agent
    )
    assert lost1.event.reason == "gpu_detached"
    gpu = await wait_event(event_log, subjects.gpu("f", "a", 0), is_("gpu_observed", present=False), agent=agent)
    assert gpu.event.present is False
    # The provider gives it back: proven, not assumed. The GPU's return is recorded first, then the runtime
    # is reloaded (a real completion makes it resident again), in that order in the log.
    SimGpuState(tmp_path / "sim" / "a", 0).set_present(True)
    back = await wait_event(
        event_log,
        subjects.model("f", "a", "m1"),
        lambda r: tag(r) == "model_resident" and r.seq > lost1.seq,
        agent=agent,
    )
    present = [
        r
        for r in await event_log.history(subjects.gpu("f", "a", 0))
        if tag(r) == "gpu_observed" and r.event.present is True and r.seq > gpu.seq
    ]
    reload = [
        r
        for r in await event_log.history(subjects.model("f", "a", "m1"))
        if tag(r) == "model_loading" and r.event.pid and lost1.seq < r.seq < back.seq
    ]
    assert present and reload and present[0].seq < reload[0].seq < back.seq


async def test_slow_loading_model_stays_loading_with_growing_elapsed(tmp_path, nats_server, event_log, agents):
    layout = write_layout(
        tmp_path / "layout.json", tmp_path, models={"slow": {"load_ms": 600_000}}, policy={"probe_timeout_ms": 500}
    )
    cfg = write_config(tmp_path / "agent.json", nats_server.url, tmp_path, layout=layout)
    agent = agents(cfg, tmp_path / "agent.log")
    subject = subjects.model("f", "a", "slow")
    await wait_event(event_log, subject, is_("model_loading"), agent=agent)
    await asyncio.sleep(0.3)
    reply1 = await send(event_log.bus, "f", "a", "status", Command(), timeout=5)
    first = reply1.data["models"]["slow"]
    assert first["state"] == "loading" and first["since"]
    await asyncio.sleep(3.0)  # well past probe_timeout and several probe intervals
    reply2 = await send(event_log.bus, "f", "a", "status", Command(), timeout=5)
    m = reply2.data["models"]["slow"]
    assert m["state"] == "loading" and m["since"] == first["since"]
    assert m["for_ms"] >= first["for_ms"] + 2500  # the elapsed time grows; nothing times out
    assert await model_tags(event_log, "f", "a", "slow") == ["model_loading"]  # nothing failed on a clock
    assert agent.proc.poll() is None


async def test_hung_runtime_is_unhealthy_and_recovers(tmp_path, nats_server, event_log, agents):
    agent = await start_resident(tmp_path, nats_server, event_log, agents, policy={"probe_timeout_ms": 700})
    subject = subjects.model("f", "a", "m1")
    res = await event_log.last(subject)
    await sim_fault(res.event.endpoint, "hang")
    lost = await wait_event(event_log, subject, is_("model_lost"), agent=agent)
    assert lost.event.reason == "unhealthy"  # alive, GPU present, and no proof it dropped the model
    await sim_fault(res.event.endpoint, "reset")
    back = await wait_event(event_log, subject, lambda r: tag(r) == "model_resident" and r.seq > lost.seq, agent=agent)
    assert back.event.endpoint == res.event.endpoint  # recovered in place: same process, not a restart
    assert [t for t in await model_tags(event_log, "f", "a", "m1")].count("model_loading") == 1


async def test_missing_binary_is_failed_with_what_the_os_said_and_retried(tmp_path, nats_server, event_log, agents):
    layout = write_layout(tmp_path / "layout.json", tmp_path, models={"m1": {}})
    import json as _json

    doc = _json.loads(layout.read_text())
    for d in doc["domains"]:
        d["slots"][0]["models"][0]["binary"] = ["/nonexistent/vllm"]
    layout.write_text(_json.dumps(doc))
    cfg = write_config(tmp_path / "agent.json", nats_server.url, tmp_path, layout=layout)
    agent = agents(cfg, tmp_path / "agent.log")
    subject = subjects.model("f", "a", "m1")
    failed = await wait_event(event_log, subject, is_("model_failed"), agent=agent)
    assert "/nonexistent/vllm" in failed.event.runtime_said
    await wait_event(event_log, subject, is_("model_loading", attempt=2), agent=agent)  # retried with backoff


async def test_truth_is_recorded_late_rather_than_never_across_a_nats_outage(tmp_path, nats_server, agents):
    from haru.log.eventlog import EventLog
    from tests.support import haru

    async with EventLog.connect([nats_server.url], writer="test") as log:
        await log.ensure()
        agent = await start_resident(tmp_path, nats_server, log, agents)
        loading = (await log.history(subjects.model("f", "a", "m1")))[0].event
    await asyncio.to_thread(nats_server.stop_sync)
    import os

    os.kill(loading.pid, signal.SIGKILL)  # happens while nobody can record it
    await asyncio.sleep(1.5)
    await asyncio.to_thread(nats_server.start_sync)
    async with EventLog.connect([nats_server.url], writer="test") as log:
        subject = subjects.model("f", "a", "m1")
        lost = await wait_event(log, subject, is_("model_lost"), agent=agent, timeout=30)
        assert lost.event.reason == "process_exited" and lost.event.exit_code == -9
        await wait_event(
            log, subject, lambda r: tag(r) == "model_resident" and r.seq > lost.seq, agent=agent, timeout=30
        )
    verify = haru("verify", nats_url=nats_server.url)
    assert verify.returncode == 0, verify.stdout + verify.stderr


async def test_nats_unreachable_exits_6(tmp_path, agents):
    from tests.support.ports import lasting_port

    layout = write_layout(tmp_path / "layout.json", tmp_path)
    cfg = write_config(tmp_path / "agent.json", f"nats://127.0.0.1:{lasting_port()}", tmp_path, layout=layout)
    agent = agents(cfg, tmp_path / "agent.log")
    assert await agent.wait(20) == 6
    assert "cannot reach NATS" in agent.output()


async def test_standby_gpu_detached_while_asleep_comes_back_asleep(tmp_path, nats_server, event_log, agents):
    layout = write_layout(tmp_path / "layout.json", tmp_path)
    cfg = write_config(tmp_path / "agent-b.json", nats_server.url, tmp_path, domain="b", layout=layout)
    agent = agents(cfg, tmp_path / "agent-b.log")
    subject = subjects.model("f", "b", "m1")
    await wait_event(event_log, subject, is_("model_sleeping"), agent=agent)
    gpu = SimGpuState(tmp_path / "sim" / "b", 0)
    gpu.set_present(False)
    lost = await wait_event(event_log, subject, is_("model_lost", reason="gpu_detached"), agent=agent)
    gpu.set_present(True)
    back = await wait_event(event_log, subject, lambda r: tag(r) == "model_sleeping" and r.seq > lost.seq, agent=agent)
    tags = [tag(r) for r in await event_log.history(subject) if lost.seq < r.seq <= back.seq]
    assert tags == ["model_loading", "model_resident", "model_sleeping"]
    # the GPU's return is in the log before the reload
    present = [
        r for r in await event_log.history(subjects.gpu("f", "b", 0)) if r.event.present is True and r.seq > lost.seq
    ]
    reload = next(r for r in await event_log.history(subject) if tag(r) == "model_loading" and r.seq > lost.seq)
    assert present and present[0].seq < reload.seq
