"""A canary end to end: real agents (subprocesses) on the simulator, a real nats-server, the promoter,
the projector and the gateway (in this process, on real sockets).

`haru route weight`'s request wakes and probes the sleeping standby and the promoter records the split;
the gateway sends b its share; b's runtime then fails its requests (the simulator's `fail_probe`), the
gateway reports the errors on its canary subject, and the promoter rolls the canary back, recording
the error rate as its evidence. The agents' own probes are slowed so the gateway's figures decide.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter

import aiohttp
import pytest

from haru.core import subjects
from haru.core.events import WeightsSet
from haru.core.layout import load_layout
from haru.core.residency import Resident
from haru.host.tasks import cancel_and_wait
from haru.log.apply import apply
from haru.log.requests import request_weights
from haru.projections.projector import Projector
from tests.support.agent_harness import AgentProcess, agent_env, kill_agents, sim_fault, write_config, write_layout
from tests.support.clock import now
from tests.support.failover_sim import steady
from tests.support.gateway import running_gateway
from tests.support.ports import lasting_port
from tests.support.promoter import promoters, wait_view
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(120)
FLEET = "f"
POLICY = {
    "heartbeat_timeout_ms": 6000,
    "degraded_grace_ms": 300,
    "command_timeout_ms": 10000,
    "training_grace_ms": 500,
    "probe_interval_ms": 60000,  # the agents' probes would see the fault too: the gateway's figures decide here
    "canary_min_requests": 10,
    "canary_max_error_rate": 0.2,
    "canary_window_ms": 60000,
}


@contextlib.asynccontextmanager
async def fleet(tmp_path, nats_server, event_log):
    layout = write_layout(
        tmp_path / "layout.json",
        tmp_path,
        models={"m1": {}, "m2": {"vram": "2GiB"}},
        training={"vram": "8GiB"},
        policy=POLICY,
        fleet=FLEET,
    )
    doc = json.loads(layout.read_text())
    for d in doc["domains"]:  # a serving URL the gateway can reach: the agent serves on its port
        d["serving_url"] = f"http://127.0.0.1:{lasting_port()}"
    layout.write_text(json.dumps(doc))
    await apply(event_log, load_layout(layout), now())
    procs = []
    projector = asyncio.create_task(Projector(event_log).run())
    try:
        for d in ("a", "b"):
            cfg = write_config(
                tmp_path / f"agent-{d}.json", nats_server.url, tmp_path, domain=d, layout=layout, fleet=FLEET
            )
            procs.append(AgentProcess(cfg, tmp_path / f"agent-{d}.log", agent_env()))
        async with promoters(nats_server.url):
            await wait_view(event_log, lambda v: steady(v, "a"), timeout=40, fleet=FLEET, what="first route, a active")
            async with running_gateway(event_log, default_fleet=FLEET, canary_report_ms=200) as gw:
                yield gw
    finally:
        kill_agents(procs)
        await cancel_and_wait(projector)


async def send(gw, model: str, n: int) -> Counter:
    got: Counter = Counter()
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            async with session.post(
                gw.url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
            ) as r:
                await r.read()
                got[(r.status, r.headers.get("X-Haru-Domain", ""))] += 1
    return got


async def _endpoint(log, domain: str, model: str) -> str:
    for rec in reversed(await log.history(subjects.model(FLEET, domain, model))):
        if getattr(rec.event, "endpoint", ""):
            return rec.event.endpoint
    raise AssertionError(f"no endpoint recorded for {domain}/{model}")


async def test_a_failing_canary_is_rolled_back_with_its_evidence(tmp_path, nats_server, event_log):
    async with fleet(tmp_path, nats_server, event_log) as gw:
        result = await request_weights(event_log, FLEET, {"b": 50}, by="cli:test", now=now())
        assert result.status == "accepted", result.message
        view = await wait_view(
            event_log,
            lambda v: v.weights == {"a": 50, "b": 50} and v.operation is None,
            timeout=40,
            fleet=FLEET,
            what="the split recorded",
        )
        op = view.last_operation
        assert op is not None and op.kind == "weighting" and op.state == "completed"
        assert [s.step for s in op.steps] == ["stop_training", "verify_gpu", "wake", "probe", "weigh"]
        assert all(isinstance(m.residency, Resident) for m in view.domains["b"].models.values())
        # the gateway follows the intent: both domains answer
        await wait_until(
            lambda: (
                (r := gw.table.get(FLEET)) is not None
                and r.intent is not None
                and r.intent.weights == {"a": 50, "b": 50}
                and "b" in r.intent.weighted
            ),
            5.0,
            interval_s=0.005,
        )
        healthy = await send(gw, "m1", 40)
        assert set(healthy) == {(200, "a"), (200, "b")} and abs(healthy[(200, "b")] - 20) <= 2, healthy

        await sim_fault(await _endpoint(event_log, "b", "m1"), "fail_probe")
        failing = await send(gw, "m1", 40)
        # b's 20 good answers count since the split was set, so its rate passes 20% at the 6th error (6 of
        # 26); the rollback may land while these 40 run, after which they all go to a.
        assert failing[(500, "b")] >= 6 and set(failing) <= {(500, "b"), (200, "a")}, failing
        view = await wait_view(
            event_log,
            lambda v: (
                v.weights == {} and v.weights_change is not None and v.weights_change.reason == "canary_rolled_back"
            ),
            timeout=30,
            fleet=FLEET,
            what="the canary rolled back",
        )
        change = view.weights_change
        assert change is not None and change.domain == "b" and change.errors >= 6
        assert "error rate" in change.detail and "canary_max_error_rate 20.0%" in change.detail, change.detail
        assert change.by.startswith("promoter:")
        sets = [r.event for r in await event_log.history(subjects.weights(FLEET))]
        assert [(type(e), e.reason) for e in sets] == [(WeightsSet, "manual"), (WeightsSet, "canary_rolled_back")]
        await wait_until(
            lambda: (r := gw.table.get(FLEET)) is not None and r.intent is not None and not r.intent.weights,
            5.0,
            interval_s=0.005,
        )
        after = await send(gw, "m1", 20)
        assert after == Counter({(200, "a"): 20}), after
        # no longer a canary: the awake standby is put back to sleep (and given training)
        await wait_view(
            event_log,
            lambda v: (
                v.last_operation is not None and v.last_operation.kind == "demotion" and v.last_operation.target == "b"
            ),
            timeout=30,
            fleet=FLEET,
            what="b demoted after the rollback",
        )
