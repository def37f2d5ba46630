"""One cold load at a time per GPU, in declaration order: the agent as a real process on the simulator,
whose vLLM profiles its memory at start-up as vLLM does (a neighbour starting meanwhile mis-sizes its
KV cache or fails it: agents/sim/vllm.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from haru.agents.load_queue import overlapping_loads
from haru.agents.sim.gpu_state import GiB, SimGpuState
from haru.core import subjects
from tests.support.agent_harness import (
    is_,
    tag,
    wait_event,
    write_config,
    write_layout,
)

pytestmark = pytest.mark.timeout(90)

MODELS = {"m1": {"load_ms": 400}, "m2": {"load_ms": 400}, "m3": {"load_ms": 400}}


def profiles(sim_dir: Path) -> list[dict]:
    path = sim_dir / "profiles.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def resident_all(event_log, agent, domain: str, names) -> None:
    for name in names:
        await wait_event(event_log, subjects.model("f", domain, name), is_("model_resident"), agent=agent, timeout=30)


async def test_the_simulator_mis_sizes_or_fails_two_that_start_together_as_vllm_does(tmp_path):
    """The hazard itself, without the agent: two sim vLLMs started at once on one GPU (the test that
    shows the agent's test below can fail)."""
    sim = tmp_path / "sim"
    SimGpuState(sim, 0).ensure(24 * GiB)
    env = {
        **os.environ,
        "HARU_SIM_DIR": str(sim),
        "HARU_SIM_GPU_INDEX": "0",
        "HARU_SIM_VRAM": "4GiB",
        "HARU_SIM_LOAD_MS": "400",
        "VLLM_SERVER_DEV_MODE": "1",
    }
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "haru.agents.sim.vllm",
            "serve",
            f"sim/{n}",
            "--port",
            "0",
            "--served-model-name",
            n,
            env=env,
            stderr=asyncio.subprocess.DEVNULL,
        )
        for n in ("x1", "x2")
    ]
    try:
        deadline = time.monotonic() + 20
        while len(profiles(sim)) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        seen = profiles(sim)
        assert len(seen) == 2, seen
        # the one whose baseline came first saw the other's allocation arrive (the other may have seen it in
        # its baseline already, as a real vLLM starting a moment later would)
        assert any(p["mis_sized"] or p["error"] for p in seen), seen
        assert any(
            "No available memory for the cache blocks" in p["error"] or "Error in memory profiling" in p["error"]
            for p in seen
        ), seen
    finally:
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
            await p.wait()


async def test_at_boot_one_load_at_a_time_per_gpu_in_declaration_order(tmp_path, nats_server, event_log, agents):
    layout = write_layout(tmp_path / "layout.json", tmp_path, models=MODELS)
    cfg = write_config(tmp_path / "agent-a.json", nats_server.url, tmp_path, domain="a", layout=layout, role="active")
    agent = agents(cfg, tmp_path / "agent-a.log")
    await resident_all(event_log, agent, "a", MODELS)

    seen = profiles(tmp_path / "sim" / "a")
    assert [p["model"] for p in seen] == ["m1", "m2", "m3"]  # declaration order
    assert not [p for p in seen if p["mis_sized"] or p["error"]], seen  # nobody mis-sized, nobody failed
    windows = [(p["model"], (p["gpu_index"],), p["began"], p["ended"]) for p in seen]
    assert overlapping_loads(windows) == []
    # those that waited were shown loading, with what they waited for, before their runtime started
    recs = await event_log.history(subjects.model("f", "a", "m3"))
    first = recs[0].event
    assert tag(recs[0]) == "model_loading" and first.pid == 0 and "its turn on GPU 0" in first.waiting_for
    spawned = next(r.event for r in recs if tag(r) == "model_loading" and r.event.pid)
    assert spawned.waiting_for == ""
    m1 = (await event_log.history(subjects.model("f", "a", "m1")))[0].event
    assert m1.pid > 0 and m1.waiting_for == ""  # the first declared never waits


async def test_after_a_crash_the_reload_waits_for_a_neighbour_loading(tmp_path, nats_server, event_log, agents):
    models = {"m1": {"load_ms": 300}, "m2": {"load_ms": 1500}}
    layout = write_layout(tmp_path / "layout.json", tmp_path, models=models)
    cfg = write_config(tmp_path / "agent-a.json", nats_server.url, tmp_path, domain="a", layout=layout, role="active")
    agent = agents(cfg, tmp_path / "agent-a.log")
    await wait_event(event_log, subjects.model("f", "a", "m1"), is_("model_resident"), agent=agent)
    # m2 profiles for 1.5 s now; m1 crashes meanwhile and must not reload until m2 is done
    await wait_event(
        event_log, subjects.model("f", "a", "m2"), lambda r: tag(r) == "model_loading" and r.event.pid > 0, agent=agent
    )
    m1 = await event_log.history(subjects.model("f", "a", "m1"))
    pid = next(r.event.pid for r in m1 if tag(r) == "model_loading" and r.event.pid)
    os.kill(pid, signal.SIGKILL)
    await wait_event(event_log, subjects.model("f", "a", "m1"), is_("model_resident"), agent=agent, timeout=30)
    await resident_all(event_log, agent, "a", ["m2"])
    # m1's second load may come after m2's, never during it
    await wait_event(
        event_log,
        subjects.model("f", "a", "m1"),
        lambda r: tag(r) == "model_resident" and len(profiles(tmp_path / "sim" / "a")) >= 3,
        agent=agent,
    )
    seen = profiles(tmp_path / "sim" / "a")
    assert not [p for p in seen if p["mis_sized"] or p["error"]], seen
    assert overlapping_loads([(p["model"], (p["gpu_index"],), p["began"], p["ended"]) for p in seen]) == []


async def test_a_standby_loads_and_sleeps_each_model_before_the_next_starts(tmp_path, nats_server, event_log, agents):
    """A standby's sleep frees memory: the next model's profiling must not see it either."""
    layout = write_layout(tmp_path / "layout.json", tmp_path, models=MODELS)
    cfg = write_config(tmp_path / "agent-b.json", nats_server.url, tmp_path, domain="b", layout=layout, role="standby")
    agent = agents(cfg, tmp_path / "agent-b.log")
    for name in MODELS:
        await wait_event(event_log, subjects.model("f", "b", name), is_("model_sleeping"), agent=agent, timeout=30)
    seen = profiles(tmp_path / "sim" / "b")
    assert [p["model"] for p in seen] == ["m1", "m2", "m3"]
    assert not [p for p in seen if p["mis_sized"] or p["error"]], seen
    # m1 slept before m2's profiling began
    slept = {
        name: next(
            r.event.at for r in await event_log.history(subjects.model("f", "b", name)) if tag(r) == "model_sleeping"
        )
        for name in MODELS
    }
    assert slept["m1"].timestamp() <= seen[1]["began"] + 0.05
