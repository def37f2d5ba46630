"""A real llama-server (llama.cpp, built from a pinned source release) under the agent, the promoter
and the gateway, serving tiny GGUF models written by the test (nothing is downloaded).

CI runs these (`.ci/run` builds or reuses the binary and sets HARU_REQUIRE_LLAMA=1: a missing binary
fails them); elsewhere they are skipped until `python -m haru.agents.runtimes.llama_build` has run once.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from datetime import UTC, datetime, timedelta

import aiohttp
import pytest

from haru.agents.runtimes import LlamaServerRuntime
from haru.agents.runtimes.tiny_model import corrupt_copy, write_tiny_model
from haru.core import subjects
from haru.core.specs import ModelSpec
from tests.support.agent_harness import is_, model_tags, tag, wait_event, write_config
from tests.support.llama import LLAMA_ARGS, llama_model, real_fleet, real_layout
from tests.support.promoter import wait_view
from tests.support.wait import wait_until

pytestmark = [pytest.mark.llama, pytest.mark.timeout(150)]
FLEET = "default"
MODEL = "tiny:chat"


def one_domain(tmp_path, llama, gguf_path, name=MODEL, **policy):
    """Domains a and b declared (a fleet has two); the tests run a's agent alone, pinned active."""
    return real_layout(
        tmp_path / "layout.json",
        tmp_path,
        {d: [llama_model(name, llama, gguf_path)] for d in ("a", "b")},
        policy=policy,
        fleet=FLEET,
    )


def start_agent(agents, tmp_path, nats_server, layout, domain="a"):
    cfg = write_config(
        tmp_path / f"agent-{domain}.json",
        nats_server.url,
        tmp_path,
        domain=domain,
        layout=layout,
        fleet=FLEET,
        role="active",
    )
    return agents(cfg, tmp_path / f"agent-{domain}.log")


# ------------------------------------------------------------------------------- loading, health


async def test_llama_servers_own_health_says_loading_then_ok(tmp_path, llama, gguf):
    """The runtime adapter against the real /health: no answer, 503 "Loading model", then 200.

    The 503 window (listener up, model not yet loaded) is a few milliseconds for a 600 KB model, so
    the server is started up to three times to catch it; every answer seen must be one of the three.
    """
    spec = ModelSpec(
        name=MODEL,
        slot="chat",
        gpu_index=0,
        runtime="llama_server",
        source=str(gguf["a"]),
        binary=[str(llama)],
        args=list(LLAMA_ARGS),
    )
    loading_seen = 0
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            seen: list[tuple[int, str]] = []
            rt = LlamaServerRuntime(spec, session=session, log_dir=tmp_path)
            await rt.start()
            try:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    h = await rt.health(timeout_s=2)
                    seen.append((h.status, h.detail))
                    if h.ok:
                        break
                    await asyncio.sleep(0.001)
                assert seen[-1][0] == 200, seen[-3:]
                for status, detail in seen[:-1]:
                    assert status in (0, 503), (status, detail)
                    if status == 503:
                        assert json.loads(detail)["error"]["message"] == "Loading model"
                        loading_seen += 1
                assert await rt.list_models() == [MODEL]  # --alias is the model id
                assert await rt.probe_completion(timeout_s=10) >= 0
                print(
                    f"health answers before ready: {[s for s, _ in seen[:-1]].count(503)} x 503, "
                    f"{[s for s, _ in seen[:-1]].count(0)} x no answer"
                )
            finally:
                await rt.stop(5)
            if loading_seen:
                break
    assert loading_seen, "llama-server never answered 503 Loading model while loading"


async def test_loading_then_resident_under_the_agent(tmp_path, nats_server, event_log, agents, llama, gguf):
    agent = start_agent(agents, tmp_path, nats_server, one_domain(tmp_path, llama, gguf["a"]))
    subject = subjects.model(FLEET, "a", MODEL)
    res = await wait_event(event_log, subject, is_("model_resident"), agent=agent, timeout=60)
    history = await event_log.history(subject)
    assert [tag(r) for r in history] == ["model_loading", "model_resident"]
    loading = history[0].event
    assert loading.pid > 0 and res.event.endpoint == loading.endpoint and res.event.warmup_ms > 0
    async with aiohttp.ClientSession() as s:
        async with s.get(res.event.endpoint + "/health") as r:
            assert (r.status, await r.json()) == (200, {"status": "ok"})


# ------------------------------------------------------------------------------ kill -9, restart


async def test_kill_9_is_lost_process_exited_then_restarted_with_backoff(
    tmp_path, nats_server, event_log, agents, llama, gguf
):
    backoff_ms = 1500
    layout = one_domain(tmp_path, llama, gguf["a"], restart_backoff_ms=backoff_ms, restart_backoff_max_ms=6000)
    agent = start_agent(agents, tmp_path, nats_server, layout)
    subject = subjects.model(FLEET, "a", MODEL)
    first = await wait_event(event_log, subject, is_("model_resident"), agent=agent, timeout=60)
    pid = (await wait_event(event_log, subject, is_("model_loading"))).event.pid
    killed_at = datetime.now(UTC)
    os.kill(pid, signal.SIGKILL)
    lost = await wait_event(event_log, subject, is_("model_lost"), agent=agent, timeout=20)
    assert lost.event.reason == "process_exited" and lost.event.exit_code == -9, lost.event
    assert lost.seq == first.seq + 1  # nothing in between: the exit itself was seen, not a failed probe
    print(f"kill -9 -> model_lost observed {(lost.event.at - killed_at).total_seconds() * 1000:.1f} ms later")
    again = await wait_event(
        event_log, subject, lambda r: tag(r) == "model_resident" and r.seq > lost.seq, agent=agent, timeout=60
    )
    reload = next(r for r in await event_log.history(subject) if r.seq > lost.seq)
    assert tag(reload) == "model_loading" and reload.event.attempt == 2 and reload.event.pid not in (0, pid)
    assert reload.event.at - lost.event.at >= timedelta(milliseconds=backoff_ms)
    assert again.event.endpoint == reload.event.endpoint


# ------------------------------------------------------------------------------- a corrupt GGUF


async def test_a_truncated_gguf_is_failed_in_llama_servers_words_and_not_restarted_in_a_tight_loop(
    tmp_path, nats_server, event_log, agents, llama, gguf
):
    bad = corrupt_copy(gguf["a"], tmp_path / "truncated.gguf")
    layout = one_domain(tmp_path, llama, bad, restart_backoff_ms=1000, restart_backoff_max_ms=8000)
    agent = start_agent(agents, tmp_path, nats_server, layout)
    subject = subjects.model(FLEET, "a", MODEL)
    failed = await wait_event(event_log, subject, is_("model_failed"), agent=agent, timeout=60)
    said = failed.event.runtime_said
    print("runtime_said:", said)
    assert said.startswith("exited with code 1 while loading:"), said
    assert "error loading model" in said or "failed to load model" in said, said  # llama.cpp's own words
    # Retried with a doubling backoff (1 s, 2 s, 4 s, ...): over 6 s at most 3 more attempts.
    window_start = time.monotonic()
    await asyncio.sleep(6)
    tags = await model_tags(event_log, FLEET, "a", MODEL)
    attempts = tags.count("model_loading")
    assert set(tags) == {"model_loading", "model_failed"}, tags
    assert 2 <= attempts <= 4, (attempts, time.monotonic() - window_start, tags)
    # The operator fixes the file: the next attempt loads it.
    write_tiny_model(bad, seed=1)
    await wait_event(event_log, subject, is_("model_resident"), agent=agent, timeout=60)


# ------------------------------------------------------------------ through the gateway, failover

# temperature 0 and a seed: the same text every time; cache_prompt false: usage does not depend on
# what the request before left in llama-server's prompt cache (`cached_tokens`).
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hello there"}],
    "max_tokens": 12,
    "temperature": 0,
    "seed": 7,
    "cache_prompt": False,
}
# What llama-server makes up per request: its id, the second it answered, its own timings. So a proxied
# answer is compared with a direct one field by field without those; everything else (the generated
# text, usage, finish reasons, chunk boundaries and order of the stream) must be the same.
VOLATILE = ("id", "created", "timings", "system_fingerprint")


_VOLATILE_BYTES = re.compile(rb'"(id|created|system_fingerprint)":("[^"]*"|\d+)|"timings":\{[^{}]*\}')


def masked(raw: bytes) -> bytes:
    """The response bytes with the values llama-server makes up per request replaced by a mark."""
    return _VOLATILE_BYTES.sub(lambda m: m.group(0).split(b":", 1)[0] + b":*", raw)


def stable(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k not in VOLATILE}


async def chat_json(session: aiohttp.ClientSession, base: str, raw: list | None = None) -> tuple[int, dict, str]:
    async with session.post(base + "/v1/chat/completions", json=CHAT) as r:
        body = await r.read()
        if raw is not None:
            raw.append(body)
        return r.status, json.loads(body), r.headers.get("Content-Type", "")


async def chat_sse(session: aiohttp.ClientSession, base: str, raws: list | None = None) -> tuple[int, list, str]:
    events = []
    async with session.post(base + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        ctype = r.headers.get("Content-Type", "")
        raw = await r.read()
    if raws is not None:
        raws.append(raw)
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else stable(json.loads(data)))
    return r.status, events, ctype


def endpoint_of(view, domain: str, model: str = MODEL) -> str:
    return view.domains[domain].models[model].residency.endpoint


def steady(view, active: str) -> bool:
    from haru.core.residency import Resident

    standby = "b" if active == "a" else "a"
    return (
        view.active == active
        and view.operation is None
        and view.domains[standby].eligible
        and all(isinstance(m.residency, Resident) for d in (active, standby) for m in view.domains[d].models.values())
    )


@pytest.fixture
async def two_domains(tmp_path, nats_server, event_log, llama, gguf):
    """Domains a and b, one llama-server each (different seeds: a's answers differ from b's)."""
    layout = real_layout(
        tmp_path / "layout.json",
        tmp_path,
        {"a": [llama_model(MODEL, llama, gguf["a"])], "b": [llama_model(MODEL, llama, gguf["b"])]},
        policy={"degraded_grace_ms": 500, "restart_backoff_ms": 3000},
        fleet=FLEET,
    )
    async with real_fleet(tmp_path, nats_server, event_log, layout) as gw:
        view = await wait_view(
            event_log, lambda v: steady(v, "a"), timeout=60, fleet=FLEET, what="a active, b a resident standby"
        )
        yield gw, view


async def test_chat_and_sse_through_the_gateway_are_llama_servers_own(two_domains):
    gw, view = two_domains
    direct = endpoint_of(view, "a")
    async with aiohttp.ClientSession() as s:
        raw: list[bytes] = []
        status, proxied, ctype = await chat_json(s, gw.url, raw)
        d_status, straight, d_ctype = await chat_json(s, direct, raw)
        assert (status, ctype) == (d_status, d_ctype) == (200, d_ctype) and d_ctype.startswith("application/json")
        assert proxied["object"] == "chat.completion" and proxied["choices"][0]["message"]["content"]
        assert stable(proxied) == stable(straight)
        assert masked(raw[0]) == masked(raw[1]) and raw[0] != masked(raw[0])  # same bytes but the made-up values
        status, proxied_sse, ctype = await chat_sse(s, gw.url, raw)
        d_status, straight_sse, d_ctype = await chat_sse(s, direct, raw)
        assert (status, d_status) == (200, 200) and ctype == d_ctype and ctype.startswith("text/event-stream")
        assert proxied_sse[-1] == "[DONE]" and len(proxied_sse) > 3
        assert proxied_sse == straight_sse
        assert masked(raw[2]) == masked(raw[3])
        # the text streamed is the text answered whole
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in proxied_sse[:-1] if c.get("choices"))
        assert text == proxied["choices"][0]["message"]["content"]


async def test_failover_between_two_domains_of_real_llama_servers(two_domains, event_log):
    gw, view = two_domains
    async with aiohttp.ClientSession() as s:
        _, on_a, _ = await chat_json(s, gw.url)
        _, from_b, _ = await chat_json(s, endpoint_of(view, "b"))
        assert on_a["choices"][0]["message"]["content"] != from_b["choices"][0]["message"]["content"]
        # The active domain's agent dies (SIGKILL; its llama-server dies with it): heartbeats stop.
        gw.agents[0].kill()
        await wait_view(
            event_log, lambda v: v.active == "b" and v.operation is None, timeout=60, fleet=FLEET, what="b promoted"
        )

        async def answered_by_b():
            status, doc, _ = await chat_json(s, gw.url)
            return status == 200 and stable(doc) == stable(from_b)

        await wait_until(answered_by_b, 20, interval_s=0.2, what="chat answered by b's llama-server")
    ops = [r.event for r in await event_log.history(subjects.op(FLEET))]
    promotions = [e for e in ops if type(e).__name__ == "PromotionRequested"]
    assert [p.reason for p in promotions] == ["initial", "domain_unreachable"]
    assert not any(type(e).__name__ == "DemotionRequested" for e in ops)  # b was a resident standby throughout


# A fleet of real llama-servers left alone (issue 12's endless standby_awake demotions) is
# tests/e2e/test_up_demo_real.py: `haru up --demo --real`, two domains of two llama-servers each and a
# standby training slot, 30 s alone.
