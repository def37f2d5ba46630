"""A continued stream's usage tells what the client's request cost, through real cuts, on the simulator
and on a real llama-server (a real vLLM: tests/e2e/test_loop_vllm.py, where the active's agent is
killed mid-stream).

Each runtime is one real process; the gateway reaches it through a relay that breaks off the first
streamed chat completion after a few content events (as a runtime that dies does) and passes everything
else through, so the stream is continued on the same runtime once it answers again. What the client
gets (the official OpenAI SDK, `include_usage`, no retries) is checked against the runtime's own counts:
the prompt's tokens are an uncut request's, and a stream asked for `max_tokens` with `ignore_eos`
ends with exactly that many completion tokens.
"""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest
from aiohttp import web

from haru.agents.runtimes import LlamaServerRuntime
from haru.core.specs import ModelSpec
from tests.support.gateway import MODEL, TwoDomains, get_text, sdk
from tests.support.llama import LLAMA_ARGS
from tests.support.sim_vllm import SimServer
from tests.support.wait import wait_until


class CuttingRelay:
    """Forwards everything to `base`; the first streamed chat completion is cut after `cut_after`
    content events (the connection aborted, as when the runtime dies)."""

    def __init__(self, base: str, cut_after: int) -> None:
        self.base = base
        self.cut_after = cut_after
        self.cut = False
        self.paths: list[str] = []
        self.usages: list[dict] = []
        self.runner: web.ServerRunner | None = None
        self.url = ""
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> CuttingRelay:
        self.session = aiohttp.ClientSession(auto_decompress=False)
        self.runner = web.ServerRunner(web.Server(self.handle, handler_cancellation=True), handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        assert self.session is not None
        body = await request.read()
        self.paths.append(request.path)
        doc = json.loads(body) if body else {}
        cutting = not self.cut and request.path == "/v1/chat/completions" and doc.get("stream")
        async with self.session.post(
            self.base + request.path, data=body, headers={"Content-Type": "application/json"}
        ) as up:
            ctype = up.headers.get("Content-Type", "application/json")
            if not cutting:
                data = await up.read()
                if ctype.startswith("text/event-stream"):  # the runtime's own usage, before the gateway's
                    self.usages += [u for u in map(_usage, data.split(b"\n\n")) if u]
                return web.Response(status=up.status, body=data, headers={"Content-Type": ctype})
            self.cut = True
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": ctype})
            await resp.prepare(request)
            content = 0
            pending = b""
            async for piece in up.content.iter_any():
                pending += piece
                while b"\n\n" in pending:
                    event, pending = pending.split(b"\n\n", 1)
                    await resp.write(event + b"\n\n")
                    content += _has_content(event)
                    if content == self.cut_after:
                        await asyncio.sleep(0.05)
                        assert request.transport is not None
                        request.transport.abort()  # the runtime died mid-generation
                        return resp
            raise AssertionError(f"the stream ended after {content} content events, before the cut")


def _usage(event: bytes) -> dict | None:
    data = event.strip().removeprefix(b"data: ")
    if not data or data == b"[DONE]":
        return None
    return json.loads(data).get("usage")


def _has_content(event: bytes) -> bool:
    data = event.removeprefix(b"data: ")
    if data.strip() == b"[DONE]":
        return False
    choices = json.loads(data).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


@pytest.fixture
async def relays():
    started: list[CuttingRelay] = []

    async def start(base: str, cut_after: int = 10**9) -> CuttingRelay:
        started.append(await CuttingRelay(base, cut_after).start())
        return started[-1]

    try:
        yield start
    finally:
        for r in started:
            await r.stop()


async def through_a_cut(event_log, gw, relays, base: str, runtime: str, request: dict, cut_after: int):  # noqa: F811
    """`request` streamed through the gateway to the runtime at `base`, cut after `cut_after` content
    events and continued: (the SDK's chunks, the relay that cut)."""
    a = await relays(base, cut_after)
    b = await relays(base)
    two = TwoDomains(event_log, gw, a, b)
    await two.route_to_a(runtime=runtime)
    async with sdk(gw) as client:
        extra = {k: v for k, v in request.items() if k not in ("model", "messages")}
        stream = await client.chat.completions.create(
            model=request["model"],
            messages=request["messages"],
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        chunks = [c async for c in stream]
    assert a.cut and a.paths.count("/v1/chat/completions") == 2, a.paths  # cut, then continued on a
    return chunks, a


def tokens_counted(metrics: str, kind: str) -> float:
    found = re.search(rf'haru_gateway_tokens_total{{fleet="default",kind="{kind}",model="{MODEL}"}} (\S+)', metrics)
    if found is None:
        found = re.search(rf'haru_gateway_tokens_total{{fleet="default",model="{MODEL}",kind="{kind}"}} (\S+)', metrics)
    assert found is not None, metrics
    return float(found.group(1))


CHAT = [{"role": "user", "content": "Tell me about the simulated GPU please"}]


async def test_a_continued_stream_on_the_simulator_reports_every_token_the_client_received(
    event_log,
    gw,  # noqa: F811
    relays,
    tmp_path,
):
    sim = await SimServer(tmp_path / "sim", model=MODEL, HARU_SIM_TOKENS_PER_S="200").start()
    try:
        async with aiohttp.ClientSession() as s:  # what the runtime says an uncut request costs
            async with s.post(sim.url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT}) as r:
                uncut = (await r.json())["usage"]
        chunks, a = await through_a_cut(event_log, gw, relays, sim.url, "vllm", {"model": MODEL, "messages": CHAT}, 4)
        before = await get_text(gw, "/metrics")
        async with sdk(gw) as client:  # an uncut JSON answer counts too, from its body's usage
            whole = await client.chat.completions.create(model=MODEL, messages=CHAT)
        after = await get_text(gw, "/metrics")
    finally:
        await sim.stop()
    assert "/tokenize" in a.paths
    received = [c for c in chunks if c.choices and c.choices[0].delta.content]
    text = "".join(c.choices[0].delta.content for c in received)
    assert text == f"[domain a] hello from {MODEL} on the simulated GPU."
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    # the simulator writes a token a chunk: 9 chunks received, 9 tokens (the continuation alone said 5)
    assert (
        (usage.prompt_tokens, usage.completion_tokens)
        == (uncut["prompt_tokens"], len(received))
        == (
            uncut["prompt_tokens"],
            uncut["completion_tokens"],
        )
    )
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # the gateway's counters agree with what the client was told
    assert tokens_counted(before, "completion") == usage.completion_tokens
    assert tokens_counted(before, "prompt") == usage.prompt_tokens
    assert whole.usage is not None
    assert tokens_counted(after, "completion") == usage.completion_tokens + whole.usage.completion_tokens
    assert tokens_counted(after, "prompt") == usage.prompt_tokens + whole.usage.prompt_tokens


@pytest.mark.llama
async def test_a_continued_stream_on_a_real_llama_server_reports_the_whole_requests_usage(
    event_log,
    gw,  # noqa: F811
    relays,
    tmp_path,
    llama,  # noqa: F811
    gguf,  # noqa: F811
):
    spec = ModelSpec(
        name="tiny:chat",
        slot="chat",
        gpu_index=0,
        runtime="llama_server",
        source=str(gguf["a"]),
        binary=[str(llama)],
        args=list(LLAMA_ARGS),
    )
    async with aiohttp.ClientSession() as s:
        rt = LlamaServerRuntime(spec, session=s, log_dir=tmp_path)
        await rt.start()
        try:
            await wait_until(lambda: _healthy(rt), 60, what="llama-server ready")
            request = {"model": MODEL, "messages": CHAT, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
            async with s.post(rt.base_url + "/v1/chat/completions", json={**request, "max_tokens": 1}) as r:
                uncut = (await r.json())["usage"]
            chunks, a = await through_a_cut(
                event_log, gw, relays, rt.base_url, "llama_server", {**request, "max_tokens": 40}, 5
            )
        finally:
            await rt.stop(5)
    assert a.paths.count("/apply-template") == 2 and "/tokenize" in a.paths
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    usage = chunks[-1].usage
    assert usage is not None
    # The runtime's own count of the continuation: its prompt is the original's and the text the client
    # had, as the continuation sees it; what the client received is that text plus what it generated.
    (own,) = a.usages
    assert usage.prompt_tokens == uncut["prompt_tokens"]
    assert usage.completion_tokens == own["prompt_tokens"] - uncut["prompt_tokens"] + own["completion_tokens"]
    # asked for 40 tokens, ignoring the end of text: 40 in all, whatever the cut took
    assert usage.completion_tokens == 40
    metrics = await get_text(gw, "/metrics")
    assert (tokens_counted(metrics, "prompt"), tokens_counted(metrics, "completion")) == (usage.prompt_tokens, 40)


async def _healthy(rt) -> bool:
    return (await rt.health(timeout_s=2)).ok
