"""A promotion on agents whose host has no NVML completes, and the verify_gpu step says what it could not verify.

The agents read their GPUs through NVML (`"gpus": "nvml"`) on this GPU-less box, so every GPU is
present=None; the runtimes are the simulator. Before, every promotion aborted at verify_gpu here.
"""

from __future__ import annotations

import pytest

from haru.agents.gpu import NvmlGpus
from haru.core.events import PromotionRequested, StepCompleted
from haru.core.layout import load_layout
from haru.log.apply import apply
from tests.support.agent_harness import AgentProcess, agent_env, kill_agents, write_config, write_layout
from tests.support.clock import now
from tests.support.failover_sim import FLEET, POLICY, sim, steady
from tests.support.promoter import op_events, promoters, route_moves, wait_view

pytestmark = pytest.mark.timeout(120)


def _nvml_loads() -> bool:
    gpus = NvmlGpus()
    try:
        return gpus.available
    finally:
        gpus.close()


@pytest.mark.skipif(_nvml_loads(), reason="this host has NVML; the test is of a host without it")
async def test_a_promotion_without_nvml_completes_and_says_nvml_was_absent(tmp_path, nats_server, event_log):
    layout_path = write_layout(
        tmp_path / "layout.json", tmp_path, models={"m1": {}}, training={"vram": "8GiB"}, policy=POLICY, fleet=FLEET
    )
    await apply(event_log, load_layout(layout_path), now())
    procs = []
    try:
        for d in ("a", "b"):
            cfg = write_config(
                tmp_path / f"agent-{d}.json",
                nats_server.url,
                tmp_path,
                domain=d,
                layout=layout_path,
                fleet=FLEET,
                gpus="nvml",
            )
            procs.append(AgentProcess(cfg, tmp_path / f"agent-{d}.log", agent_env()))
        async with promoters(nats_server.url):
            await wait_view(event_log, lambda v: steady(v, "a"), timeout=40, fleet=FLEET, what="first route, a active")
            sim(tmp_path, "kill-runtime", "a", "m1")
            await wait_view(event_log, lambda v: steady(v, "b"), timeout=60, fleet=FLEET, what="b active, a standby")
    finally:
        kill_agents(procs)
    assert [m.active for m in await route_moves(event_log, FLEET)] == ["a", "b"]
    ops = await op_events(event_log, FLEET)
    failover = [e.op_id for e in ops if isinstance(e, PromotionRequested) and e.reason != "initial"][0]
    verified = [e for e in ops if isinstance(e, StepCompleted) and e.op_id == failover and e.step == "verify_gpu"]
    assert len(verified) == 1, ops
    assert "NVML absent" in verified[0].detail and "trainer processes gone" in verified[0].detail, verified[0].detail
