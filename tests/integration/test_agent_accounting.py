"""'Resident' means accounted for: the agent sums each runtime's process tree on the GPU against its plan,
records a runtime above its planned VRAM with the figures, and shows memory held by processes it did not start.

The runtimes are the simulator, whose allocations are per process on the simulated GPU (as NVML's compute
processes are), so the agent runs the same accounting as on a GPU host.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from haru.agents.sim.gpu_state import GiB, SimGpuState
from haru.core import subjects
from tests.support.agent_harness import is_, wait_event, write_config, write_layout

pytestmark = pytest.mark.timeout(90)


def over(rec, name):
    return next((u for u in rec.event.usage if u.name == name and u.over_plan), None)


async def test_a_runtime_above_its_plan_and_a_foreign_process_are_recorded(tmp_path, nats_server, event_log, agents):
    # m1 declares 4 GiB but its runtime takes 6 GiB (HARU_SIM_VRAM); m2 keeps to its 2 GiB.
    layout = write_layout(
        tmp_path / "layout.json",
        tmp_path,
        models={"m1": {"vram": "4GiB", "HARU_SIM_VRAM": "6GiB"}, "m2": {"vram": "2GiB"}},
    )
    cfg = write_config(tmp_path / "agent-a.json", nats_server.url, tmp_path, domain="a", layout=layout)
    agent = agents(cfg, tmp_path / "agent-a.log")
    gpu_subject = subjects.gpu("f", "a", 0)
    for m in ("m1", "m2"):
        await wait_event(event_log, subjects.model("f", "a", m), is_("model_resident"), agent=agent, timeout=30)
    rec = await wait_event(
        event_log,
        gpu_subject,
        lambda r: (
            r.event.accounted
            and over(r, "m1") is not None
            and {u.name for u in r.event.usage} == {"m1", "m2"}
            and all(u.pids for u in r.event.usage)
        ),
        agent=agent,
        timeout=30,
    )
    m1 = over(rec, "m1")
    assert (m1.used_bytes, m1.planned_bytes, m1.kind) == (6 * GiB, 4 * GiB, "model")
    m2 = next(u for u in rec.event.usage if u.name == "m2")
    assert not m2.over_plan and (m2.used_bytes, m2.planned_bytes) == (2 * GiB, 2 * GiB)
    assert rec.event.foreign == []

    # A neighbour takes 3 GiB on the same GPU: foreign usage with its pid.
    neighbour = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        assert SimGpuState(tmp_path / "sim" / "a", 0).allocate(neighbour.pid, 3 * GiB)
        rec = await wait_event(
            event_log,
            gpu_subject,
            lambda r: any(p.pid == neighbour.pid for p in r.event.foreign),
            agent=agent,
            timeout=30,
        )
        assert [(p.pid, p.used_bytes) for p in rec.event.foreign] == [(neighbour.pid, 3 * GiB)]
        assert over(rec, "m1") is not None  # still recorded while it lasts
    finally:
        neighbour.kill()
        neighbour.wait()
    # it ends: the next observation has no foreign usage
    await wait_event(
        event_log, gpu_subject, lambda r: r.seq > rec.seq and r.event.foreign == [], agent=agent, timeout=30
    )


def test_a_runtimes_tree_includes_its_children_as_proc_reports_them():
    """vLLM's engine core is a child of `vllm serve`: the memory it holds is the runtime's."""
    from haru.agents.gpu import process_tree, read_parents

    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(p.pid, flush=True)\ntime.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        tree = process_tree({parent.pid}, read_parents())
        assert {parent.pid, child} <= tree and len(tree) == 2
    finally:
        import os
        import signal

        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
        parent.stdout.close()
