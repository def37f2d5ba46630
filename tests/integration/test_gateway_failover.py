"""A failover the clients do not see, through the real gateway (real nats-server, real sockets): held
requests, requests sent once more when their domain died before answering, and streams continued on
another domain and spliced into the same SSE stream. Each test fails without the path it is about:
without the hold the request is a 503 at once, without the retry a 502, without the continuation a
truncated stream.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import aiohttp
import msgspec
import openai
import pytest
from aiohttp import web

from haru.core.residency import Answer, Lost, Sleeping
from haru.core.specs import Policy
from haru.core.views import FleetView, OperationView
from tests.integration.test_gateway import (
    CHAT,
    MODEL,
    Fleet,
    Upstream,
    _get_text,
    intent_of,
    running_gateway,
    sdk,
    upstreams,  # noqa: F401  (a fixture)
    view_of,
    wait_for,
)

FAST = Policy(heartbeat_timeout_ms=500)


def fleet_view(urls: dict[str, str], *, active: str, policy: Policy = FAST, seq: int = 1, wake_ms: int = 400,
               operation: OperationView | None = None, last_operation: OperationView | None = None,
               runtime: str = "vllm", standby_state=None) -> FleetView:
    """Two domains: `active`, whose model was lost to a crash (a cold reload of 30 s, measured), and the
    other a standby asleep whose measured wake is `wake_ms`: the promoter fails over at once."""
    standby_state = standby_state or Sleeping(since=datetime.now(UTC))
    states = {(d, MODEL): standby_state for d in urls if d != active}
    states[(active, MODEL)] = Lost(since=datetime.now(UTC), reason="process_exited")
    view = view_of("default", urls, active=active, models=(MODEL,), seq=seq, residency=states)
    domains = {}
    for name, dv in view.domains.items():
        models = {m: msgspec.structs.replace(mv, wake_ms=wake_ms if name != active else 0, runtime=runtime,
                                             load_ms=30_000)
                  for m, mv in dv.models.items()}
        domains[name] = msgspec.structs.replace(dv, models=models)
    return msgspec.structs.replace(view, domains=domains, policy=policy, operation=operation,
                                   last_operation=last_operation)


LOST = {MODEL: Answer(answer="lost", reason="process_exited")}


@pytest.fixture
async def gw(event_log):
    async with running_gateway(event_log) as gw:
        yield gw


async def post(gw, body: dict, timeout: float = 20) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/chat/completions", json=body,
                          timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status, dict(r.headers), await r.read()


# ------------------------------------------------------------------------------------- holding


async def test_a_request_for_a_lost_model_is_held_and_sent_to_the_new_active(event_log, gw, upstreams):
    a, b = await upstreams("a"), await upstreams("b")
    fleet = Fleet(event_log, gw)
    await fleet.put_view(fleet_view({"a": a.url, "b": b.url}, active="a"))
    await fleet.publish(intent_of("default", "a", a.url, revision=1, answers=LOST, models=(MODEL,)))

    pending = asyncio.create_task(post(gw, {"model": MODEL, "messages": CHAT}))
    await wait_for(lambda: gw.proxy.holds.held.get("default") == 1)
    assert not pending.done()
    await fleet.publish(intent_of("default", "b", b.url, revision=2, models=(MODEL,)))
    status, headers, data = await pending
    assert status == 200 and b"[domain b]" in data
    assert headers["X-Haru-Domain"] == "b" and int(headers["X-Haru-Held-Ms"]) >= 0
    assert gw.proxy.holds.held["default"] == 0
    metrics = await _get_text(gw, "/metrics")
    assert 'haru_gateway_held_total{fleet="default",outcome="released"} 1.0' in metrics


async def test_a_hold_ends_with_todays_answer_when_its_time_is_up(event_log, gw, upstreams):
    a, b = await upstreams("a"), await upstreams("b")
    fleet = Fleet(event_log, gw)
    await fleet.put_view(fleet_view({"a": a.url, "b": b.url}, active="a",
                                    policy=msgspec.structs.replace(FAST, hold_ms=300)))
    await fleet.publish(intent_of("default", "a", a.url, revision=1, answers=LOST, models=(MODEL,)))
    loop = asyncio.get_running_loop()
    started = loop.time()
    status, _, data = await post(gw, {"model": MODEL, "messages": CHAT})
    assert status == 503 and json.loads(data)["error"]["code"] == "model_lost"
    assert loop.time() - started >= 0.3
    metrics = await _get_text(gw, "/metrics")
    assert 'haru_gateway_held_total{fleet="default",outcome="expired"} 1.0' in metrics


async def test_nothing_is_held_without_a_standby_to_fail_over_to(event_log, gw, upstreams):
    a, b = await upstreams("a"), await upstreams("b")
    fleet = Fleet(event_log, gw)
    for view in (
        fleet_view({"a": a.url, "b": b.url}, active="a", policy=msgspec.structs.replace(FAST, auto_failover=False)),
        fleet_view({"a": a.url, "b": b.url}, active="a", seq=2, standby_state=Lost(reason="evicted")),
        fleet_view({"a": a.url, "b": b.url}, active="a", seq=3, policy=msgspec.structs.replace(FAST, hold_max_ms=0)),
    ):
        await fleet.put_view(view)
        if fleet.intent_seq == 0:
            await fleet.publish(intent_of("default", "a", a.url, revision=1, answers=LOST, models=(MODEL,)))
        status, _, data = await post(gw, {"model": MODEL, "messages": CHAT}, timeout=2)
        assert status == 503 and json.loads(data)["error"]["code"] == "model_lost"


async def test_a_hold_ends_at_once_when_the_promotion_aborts(event_log, gw, upstreams):
    a, b = await upstreams("a"), await upstreams("b")
    fleet = Fleet(event_log, gw)
    now = datetime.now(UTC)
    op = OperationView(op_id="op1", kind="promotion", target="b", source="a", requested_at=now)
    await fleet.put_view(fleet_view({"a": a.url, "b": b.url}, active="a", operation=op,
                                    policy=msgspec.structs.replace(FAST, hold_ms=20_000)))
    await fleet.publish(intent_of("default", "a", a.url, revision=1, answers=LOST, models=(MODEL,), operation="op1"))
    pending = asyncio.create_task(post(gw, {"model": MODEL, "messages": CHAT}))
    await wait_for(lambda: gw.proxy.holds.held.get("default") == 1)
    aborted = msgspec.structs.replace(op, state="aborted", error="wake: out of memory", finished_at=datetime.now(UTC))
    await fleet.put_view(fleet_view({"a": a.url, "b": b.url}, active="a", seq=2, last_operation=aborted,
                                    policy=msgspec.structs.replace(FAST, hold_ms=20_000)))
    status, _, data = await asyncio.wait_for(pending, 5)
    assert status == 503 and json.loads(data)["error"]["code"] == "model_lost"


async def test_a_held_request_whose_client_leaves_is_dropped_at_once(event_log, gw, upstreams):
    a, b = await upstreams("a"), await upstreams("b")
    fleet = Fleet(event_log, gw)
    await fleet.put_view(fleet_view({"a": a.url, "b": b.url}, active="a"))
    await fleet.publish(intent_of("default", "a", a.url, revision=1, answers=LOST, models=(MODEL,)))
    pending = asyncio.create_task(post(gw, {"model": MODEL, "messages": CHAT}))
    await wait_for(lambda: gw.proxy.holds.held.get("default") == 1)
    pending.cancel()
    await wait_for(lambda: gw.proxy.holds.held.get("default") == 0)
    await fleet.publish(intent_of("default", "b", b.url, revision=2, models=(MODEL,)))
    await asyncio.sleep(0.2)
    assert b.received == []  # it never reached the new active
    metrics = await _get_text(gw, "/metrics")
    assert 'haru_gateway_held_total{fleet="default",outcome="dropped"} 1.0' in metrics


async def test_requests_beyond_the_hold_cap_are_answered_at_once(event_log, gw, upstreams):
    a, b = await upstreams("a"), await upstreams("b")
    fleet = Fleet(event_log, gw)
    await fleet.put_view(fleet_view({"a": a.url, "b": b.url}, active="a",
                                    policy=msgspec.structs.replace(FAST, hold_max_requests=1)))
    await fleet.publish(intent_of("default", "a", a.url, revision=1, answers=LOST, models=(MODEL,)))
    first = asyncio.create_task(post(gw, {"model": MODEL, "messages": CHAT}))
    await wait_for(lambda: gw.proxy.holds.held.get("default") == 1)
    status, _, _ = await post(gw, {"model": MODEL, "messages": CHAT}, timeout=2)
    assert status == 503
    await fleet.publish(intent_of("default", "b", b.url, revision=2, models=(MODEL,)))
    assert (await first)[0] == 200


# ------------------------------------------------------------------------------------ retrying


async def test_a_request_to_a_dead_domain_is_sent_once_more_to_the_new_active(event_log, gw, upstreams):
    a, b = await upstreams("a"), await upstreams("b")
    fleet = Fleet(event_log, gw)
    await fleet.put_view(fleet_view({"a": a.url, "b": b.url}, active="a"))
    await fleet.publish(intent_of("default", "a", a.url, revision=1, models=(MODEL,)))
    await a.stop()  # the host died: connection refused

    pending = asyncio.create_task(post(gw, {"model": MODEL, "messages": CHAT}))
    await wait_for(lambda: gw.proxy.holds.held.get("default") == 1)
    await fleet.publish(intent_of("default", "b", b.url, revision=2, models=(MODEL,)))
    status, headers, data = await pending
    assert status == 200 and b"[domain b]" in data
    assert headers["X-Haru-Retried"].startswith("a; unreachable")
    assert len(b.received) == 1
    metrics = await _get_text(gw, "/metrics")
    assert 'haru_gateway_retried_total{fleet="default",why="unreachable"} 1.0' in metrics


class GoneUpstream:
    """A serving port whose runtime is gone: 503 model_lost with the runtime-gone mark."""

    def __init__(self) -> None:
        self.received = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> GoneUpstream:
        async def handle(request: web.Request) -> web.Response:
            self.received += 1
            await request.read()
            return web.json_response(
                {"error": {"message": "the model is lost (process_exited)", "type": "server_error", "param": "model",
                           "code": "model_lost"}}, status=503, headers={"X-Haru-Runtime-Gone": "process_exited"})

        app = web.Application()
        app.router.add_post("/v1/chat/completions", handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def test_a_runtime_gone_answer_is_sent_once_more_to_the_new_active(event_log, gw, upstreams):
    gone, b = await GoneUpstream().start(), await upstreams("b")
    try:
        fleet = Fleet(event_log, gw)
        await fleet.put_view(fleet_view({"a": gone.url, "b": b.url}, active="a"))
        await fleet.publish(intent_of("default", "a", gone.url, revision=1, models=(MODEL,)))
        pending = asyncio.create_task(post(gw, {"model": MODEL, "messages": CHAT}))
        await wait_for(lambda: gw.proxy.holds.held.get("default") == 1)
        await fleet.publish(intent_of("default", "b", b.url, revision=2, models=(MODEL,)))
        status, headers, data = await pending
        assert status == 200 and b"[domain b]" in data and headers["X-Haru-Retried"] == "a; runtime_gone"
        assert gone.received == 1
    finally:
        await gone.stop()


async def test_a_retry_is_sent_once_only(event_log, gw, upstreams):
    a, b = await upstreams("a"), await upstreams("b")
    fleet = Fleet(event_log, gw)
    await fleet.put_view(fleet_view({"a": a.url, "b": b.url}, active="a",
                                    policy=msgspec.structs.replace(FAST, hold_ms=300)))
    await fleet.publish(intent_of("default", "a", a.url, revision=1, models=(MODEL,)))
    await a.stop()
    await b.stop()
    # the hold ends with the route unmoved: the one resend goes to a, dead still, and that is the answer
    status, headers, data = await post(gw, {"model": MODEL, "messages": CHAT})
    assert status == 502 and json.loads(data)["error"]["code"] == "upstream_unreachable"
    metrics = await _get_text(gw, "/metrics")
    assert 'haru_gateway_retried_total{fleet="default",why="unreachable"} 1.0' in metrics


# ------------------------------------------------------------------------------ continued streams


class StreamingUpstream:
    """A vLLM-shaped streaming upstream: a role chunk, then `words` one by one. With `die_after`, the
    connection is cut after that many words (the runtime died), and, with `stays_gone`, every later
    request is answered as a serving port answers for a lost runtime. A continuation request (its last
    message an assistant one) is answered with the rest of `words` after what the prefix holds."""

    def __init__(self, domain: str, words: list[str], die_after: int | None = None, stays_gone: bool = True) -> None:
        self.domain = domain
        self.stays_gone = stays_gone
        self.gone = False
        self.words = words
        self.die_after = die_after
        self.bodies: list[dict] = []
        self.runner: web.ServerRunner | None = None
        self.url = ""

    async def start(self) -> StreamingUpstream:
        server = web.Server(self.handle, handler_cancellation=True, access_log=None)
        self.runner = web.ServerRunner(server, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def event(self, delta: dict, finish: str | None = None) -> bytes:
        obj = {"id": f"chatcmpl-{self.domain}", "object": "chat.completion.chunk", "created": 1000 + ord(self.domain),
               "model": MODEL, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        body = json.loads(await request.read())
        self.bodies.append(body)
        if self.gone:  # the serving port of a domain whose runtime died
            return web.json_response(
                {"error": {"message": "the model is lost (process_exited)", "type": "server_error", "param": "model",
                           "code": "model_lost"}}, status=503, headers={"X-Haru-Runtime-Gone": "process_exited"})
        last = body["messages"][-1]
        done = last["content"] if last["role"] == "assistant" else ""
        rest = self.words
        while rest and done.startswith(rest[0]):
            done, rest = done[len(rest[0]):], rest[1:]
        die = self.die_after  # decided when the request came
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(self.event({"role": "assistant", "content": ""}))
        for i, word in enumerate(rest):
            if die is not None and i == die:
                await asyncio.sleep(0.05)
                assert request.transport is not None
                self.gone = self.stays_gone
                request.transport.abort()  # the runtime died mid-generation
                return resp
            await resp.write(self.event({"content": word}))
            await asyncio.sleep(0.01)
        await resp.write(self.event({}, "stop"))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


WORDS = ["Once", " upon", " a", " time", " there", " was", " a", " GPU", "."]


async def _stream_fleet(event_log, gw, a: StreamingUpstream, b: StreamingUpstream, runtime: str = "vllm") -> Fleet:
    fleet = Fleet(event_log, gw)
    await fleet.put_view(fleet_view({"a": a.url, "b": b.url}, active="a", runtime=runtime))
    await fleet.publish(intent_of("default", "a", a.url, revision=1, models=(MODEL,)))
    return fleet


@pytest.mark.parametrize("runtime", ["vllm", "llama_server"])
async def test_a_stream_cut_mid_generation_is_continued_on_the_new_active(event_log, gw, runtime):
    a = await StreamingUpstream("a", WORDS, die_after=4).start()
    b = await StreamingUpstream("b", WORDS).start()
    try:
        fleet = await _stream_fleet(event_log, gw, a, b, runtime)

        async def move_when_cut() -> None:
            await wait_for(lambda: len(a.bodies) == 1)
            await asyncio.sleep(0.2)
            await fleet.publish(intent_of("default", "b", b.url, revision=2, models=(MODEL,)))

        mover = asyncio.create_task(move_when_cut())
        async with sdk(gw) as client:
            stream = await client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, max_tokens=100)
            chunks = [c async for c in stream]
        await mover
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "".join(WORDS)
        assert {c.id for c in chunks} == {"chatcmpl-a"} and {c.created for c in chunks} == {1000 + ord("a")}
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
        assert chunks[-1].choices[0].finish_reason == "stop"
        cont = b.bodies[0]
        assert cont["messages"][-1] == {"role": "assistant", "content": "".join(WORDS[:4])}
        assert len(a.bodies) >= 2  # tried on a (its runtime gone) until the route moved
        assert cont["max_tokens"] == 96
        if runtime == "vllm":
            assert cont["continue_final_message"] is True and cont["add_generation_prompt"] is False
        else:
            assert "continue_final_message" not in cont
        metrics = await _get_text(gw, "/metrics")
        assert 'haru_gateway_stream_resumes_total{fleet="default",outcome="continued"} 1.0' in metrics
    finally:
        await a.stop()
        await b.stop()


async def test_a_stream_is_continued_on_the_same_domain_once_it_answers_again(event_log, gw):
    # the agent restarted: no route move, the same serving URL answers again
    a = await StreamingUpstream("a", WORDS, die_after=3, stays_gone=False).start()
    b = await StreamingUpstream("b", WORDS).start()
    try:
        await _stream_fleet(event_log, gw, a, b)
        async with sdk(gw) as client:
            stream = await client.chat.completions.create(model=MODEL, messages=CHAT, stream=True)
            first = await stream.__anext__()
            a.die_after = None  # what answers next is the restarted runtime
            rest = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in [first, *rest] if c.choices)
        assert text == "".join(WORDS) and len(a.bodies) == 2 and b.bodies == []
    finally:
        await a.stop()
        await b.stop()


@pytest.mark.parametrize("extra", [{"n": 2}, {"logprobs": True}, {"response_format": {"type": "json_object"}},
                                   {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}])
async def test_a_stream_that_cannot_be_continued_faithfully_ends_with_an_error_event(event_log, gw, extra):
    a = await StreamingUpstream("a", WORDS, die_after=2).start()
    b = await StreamingUpstream("b", WORDS).start()
    try:
        await _stream_fleet(event_log, gw, a, b)
        async with sdk(gw) as client:
            stream = await client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **extra)
            with pytest.raises(openai.APIError) as info:
                async for _ in stream:
                    pass
        assert "cannot be continued faithfully" in str(info.value)
        assert b.bodies == []
        metrics = await _get_text(gw, "/metrics")
        assert 'haru_gateway_stream_resumes_total{fleet="default",outcome="error_event"} 1.0' in metrics
    finally:
        await a.stop()
        await b.stop()


async def test_a_cut_with_nowhere_to_continue_ends_with_an_error_event_not_a_silent_cut(event_log, gw):
    a = await StreamingUpstream("a", WORDS, die_after=2).start()
    b = await StreamingUpstream("b", WORDS).start()
    try:
        fleet = Fleet(event_log, gw)
        await fleet.put_view(fleet_view({"a": a.url, "b": b.url}, active="a",
                                        policy=msgspec.structs.replace(FAST, hold_ms=300)))
        await fleet.publish(intent_of("default", "a", a.url, revision=1, models=(MODEL,)))
        await b.stop()

        async def host_dies() -> None:  # after the cut, a refuses connections: nothing can continue it
            await wait_for(lambda: len(a.bodies) == 1)
            await a.stop()

        dying = asyncio.create_task(host_dies())
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/chat/completions",
                              json={"model": MODEL, "messages": CHAT, "stream": True}) as r:
                data = await r.read()
        await dying
        last = data.rstrip(b"\n").split(b"\n\n")[-1]
        assert last.startswith(b"data: {\"error\":"), data
        assert json.loads(last[6:])["error"]["code"] == "stream_interrupted"
    finally:
        await a.stop()
        await b.stop()
