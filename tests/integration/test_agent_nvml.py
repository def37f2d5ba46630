"""A real agent reading its GPU through NVML (the fake library, loaded by pynvml): presence, detach and
per-process accounting end to end, on the code path of a GPU host. The runtimes are the simulator."""

from __future__ import annotations

import subprocess
import sys

import pytest

from haru.core import subjects
from tests.support.agent_harness import is_, wait_event, write_config, write_layout
from tests.support.nvml_fake import env_with, write_state

GiB = 1024**3
pytestmark = pytest.mark.timeout(90)


async def test_an_agent_on_nvml_accounts_runtimes_and_foreign_usage_and_sees_a_detach(
    tmp_path, nats_server, event_log, agents, fake_nvml_dir
):
    state = tmp_path / "nvml-state"
    gpu = f"gpu 0 {{}} {24 * GiB} {{}} NVIDIA L4"
    write_state(state, [gpu.format("present", 0)])
    layout = write_layout(tmp_path / "layout.json", tmp_path, models={"m1": {"vram": "4GiB"}})
    cfg = write_config(tmp_path / "agent-a.json", nats_server.url, tmp_path, domain="a", layout=layout, gpus="nvml")
    agent = agents(cfg, tmp_path / "agent-a.log", env_with(fake_nvml_dir, state))
    gpu_subject = subjects.gpu("f", "a", 0)
    loading = await wait_event(event_log, subjects.model("f", "a", "m1"), is_("model_loading"), agent=agent, timeout=30)
    await wait_event(
        event_log,
        gpu_subject,
        lambda r: r.event.present is True and r.event.name == "NVIDIA L4",
        agent=agent,
        timeout=30,
    )
    runtime_pid = loading.event.pid
    neighbour = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        # the runtime holds 6 GiB against its 4 GiB plan; a process Haru did not start holds 3 GiB
        write_state(
            state,
            [
                gpu.format("present", 9 * GiB),
                f"proc 0 -1 {runtime_pid} {6 * GiB}",
                f"proc 0 -1 {neighbour.pid} {3 * GiB}",
            ],
        )
        rec = await wait_event(
            event_log,
            gpu_subject,
            lambda r: r.event.accounted and bool(r.event.foreign) and any(u.over_plan for u in r.event.usage),
            agent=agent,
            timeout=30,
        )
        (m1,) = rec.event.usage
        assert (m1.name, m1.pids, m1.used_bytes, m1.planned_bytes, m1.over_plan) == (
            "m1",
            [runtime_pid],
            6 * GiB,
            4 * GiB,
            True,
        )
        assert [(p.pid, p.used_bytes) for p in rec.event.foreign] == [(neighbour.pid, 3 * GiB)]
        assert rec.event.memory_used_bytes == 9 * GiB
    finally:
        neighbour.kill()
        neighbour.wait()
    # the provider takes the GPU: NVML_ERROR_GPU_IS_LOST is recorded as present=False
    write_state(state, [gpu.format("lost", 0)])
    await wait_event(event_log, gpu_subject, lambda r: r.event.present is False, agent=agent, timeout=30)
