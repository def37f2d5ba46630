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

from haru.core.residency import Answer, Loading, Lost, Resident
from haru.core.views import OperationView
from haru.host import alive
from haru.host.tasks import cancel_and_wait
from tests.support.gateway import (
    CHAT,
    FAST,
    MODEL,
    RawUpstream,
    TwoDomains,
    get_text,
    intent_of,
    sdk,
)
from tests.support.wait import wait_until

LOST = {MODEL: Answer(answer="lost", reason="process_exited")}


@pytest.fixture
async def two(event_log, gw, upstreams):
    return TwoDomains(event_log, gw, await upstreams("a"), await upstreams("b"))


@pytest.fixture
async def servers():
    """Starts upstreams of a test's own kind (`await servers(StreamingUpstream(...))`), stopped after it."""
    started = []

    async def start(server):
        started.append(await server.start())
        return started[-1]

    try:
        yield start
    finally:
        for server in started:
            await server.stop()


async def post(gw, body: dict, timeout: float = 20) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(
            gw.url + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as r:
            return r.status, dict(r.headers), await r.read()


# ------------------------------------------------------------------------------------- holding


async def test_a_request_for_a_lost_model_is_held_and_sent_to_the_new_active(gw, two):
    await two.route_to_a(answers=LOST)

    pending = asyncio.create_task(post(gw, {"model": MODEL, "messages": CHAT}))
    await wait_until(lambda: gw.proxy.holds.held.get("default") == 1, 5.0, interval_s=0.005)
    assert not pending.done()
    await two.move_to_b()
    status, headers, data = await pending
    assert status == 200 and b"[domain b]" in data
    assert headers["X-Haru-Domain"] == "b" and int(headers["X-Haru-Held-Ms"]) >= 0
    assert gw.proxy.holds.held["default"] == 0
    metrics = await get_text(gw, "/metrics")
    assert 'haru_gateway_held_total{fleet="default",outcome="released"} 1.0' in metrics


async def test_a_model_the_active_reloads_sooner_than_a_failover_is_waited_for_in_place(gw, two):
    # a reloads in 300 ms (measured), b would wake in 40 s: no failover; the request waits for a's reload
    quick = dict(wake_ms=40_000, reload_ms=300)
    await two.route_to_a(answers=LOST, **quick)
    pending = asyncio.create_task(post(gw, {"model": MODEL, "messages": CHAT}))
    await wait_until(lambda: gw.proxy.holds.held.get("default") == 1, 5.0, interval_s=0.005)
    await two.view(seq=2, active_state=Resident(since=datetime.now(UTC)), **quick)  # back: the view first
    assert not pending.done()
    await two.fleet.publish(intent_of("default", "a", two.a.url, revision=1, models=(MODEL,)))  # then the intent
    status, headers, data = await pending
    assert status == 200 and b"[domain a]" in data and int(headers["X-Haru-Held-Ms"]) >= 0
    assert two.b.received == []


async def test_a_hold_ends_with_todays_answer_when_its_time_is_up(gw, two):
    await two.route_to_a(answers=LOST, policy=msgspec.structs.replace(FAST, hold_ms=300))
    loop = asyncio.get_running_loop()
    started = loop.time()
    status, _, data = await post(gw, {"model": MODEL, "messages": CHAT})
    assert status == 503 and json.loads(data)["error"]["code"] == "model_lost"
    assert loop.time() - started >= 0.3
    metrics = await get_text(gw, "/metrics")
    assert 'haru_gateway_held_total{fleet="default",outcome="expired"} 1.0' in metrics


async def test_a_hold_waits_past_its_estimate_while_a_promoter_is_heard(gw, two, event_log):
    # the estimate is b's 400 ms wake and a 1 s margin; the route moves at 2.5 s (the log was electing a
    # leader, say): a promoter beating on the bus keeps the request waiting for it
    beating = asyncio.create_task(alive.beat(event_log.bus, "promoter", "promoter-test", interval=0.3))
    try:
        await wait_until(lambda: gw.follower.alive.alive("promoter"), 5.0)
        await two.route_to_a(answers=LOST)
        pending = asyncio.create_task(post(gw, {"model": MODEL, "messages": CHAT}))
        await wait_until(lambda: gw.proxy.holds.held.get("default") == 1, 5.0, interval_s=0.005)
        await asyncio.sleep(2.5)
        assert not pending.done()
        await two.move_to_b()
        status, headers, data = await pending
    finally:
        await cancel_and_wait(beating)
    assert status == 200 and b"[domain b]" in data and int(headers["X-Haru-Held-Ms"]) >= 2_500


async def test_nothing_is_held_without_a_standby_to_fail_over_to(gw, two):
    await two.route_to_a(answers=LOST, policy=msgspec.structs.replace(FAST, auto_failover=False))
    for view in (
        {},
        dict(seq=2, standby_state=Lost(reason="evicted")),
        dict(seq=3, policy=msgspec.structs.replace(FAST, hold_max_ms=0)),
    ):
        if view:
            await two.view(**view)
        status, _, data = await post(gw, {"model": MODEL, "messages": CHAT}, timeout=2)
        assert status == 503 and json.loads(data)["error"]["code"] == "model_lost"


async def test_a_hold_ends_at_once_when_the_promotion_aborts(gw, two):
    now = datetime.now(UTC)
    op = OperationView(op_id="op1", kind="promotion", target="b", source="a", requested_at=now)
    await two.route_to_a(
        answers=LOST, intent_op="op1", operation=op, policy=msgspec.structs.replace(FAST, hold_ms=20_000)
    )
    pending = asyncio.create_task(post(gw, {"model": MODEL, "messages": CHAT}))
    await wait_until(lambda: gw.proxy.holds.held.get("default") == 1, 5.0, interval_s=0.005)
    aborted = msgspec.structs.replace(op, state="aborted", error="wake: out of memory", finished_at=datetime.now(UTC))
    await two.view(seq=2, last_operation=aborted, policy=msgspec.structs.replace(FAST, hold_ms=20_000))
    status, _, data = await asyncio.wait_for(pending, 5)
    assert status == 503 and json.loads(data)["error"]["code"] == "model_lost"


async def test_a_held_request_whose_client_leaves_is_dropped_at_once(gw, two):
    await two.route_to_a(answers=LOST)
    pending = asyncio.create_task(post(gw, {"model": MODEL, "messages": CHAT}))
    await wait_until(lambda: gw.proxy.holds.held.get("default") == 1, 5.0, interval_s=0.005)
    pending.cancel()
    await wait_until(lambda: gw.proxy.holds.held.get("default") == 0, 5.0, interval_s=0.005)
    await two.move_to_b()
    await asyncio.sleep(0.2)
    assert two.b.received == []  # it never reached the new active
    metrics = await get_text(gw, "/metrics")
    assert 'haru_gateway_held_total{fleet="default",outcome="dropped"} 1.0' in metrics


async def test_requests_beyond_the_hold_cap_are_answered_at_once(gw, two):
    await two.route_to_a(answers=LOST, policy=msgspec.structs.replace(FAST, hold_max_requests=1))
    first = asyncio.create_task(post(gw, {"model": MODEL, "messages": CHAT}))
    await wait_until(lambda: gw.proxy.holds.held.get("default") == 1, 5.0, interval_s=0.005)
    status, _, _ = await post(gw, {"model": MODEL, "messages": CHAT}, timeout=2)
    assert status == 503
    await two.move_to_b()
    assert (await first)[0] == 200


# ------------------------------------------------------------------------------------ retrying


async def test_a_request_to_a_dead_domain_is_sent_once_more_to_the_new_active(gw, two):
    await two.route_to_a()
    await two.a.stop()  # the host died: connection refused

    pending = asyncio.create_task(post(gw, {"model": MODEL, "messages": CHAT}))
    await wait_until(lambda: gw.proxy.holds.held.get("default") == 1, 5.0, interval_s=0.005)
    await two.move_to_b()
    status, headers, data = await pending
    assert status == 200 and b"[domain b]" in data
    assert headers["X-Haru-Retried"].startswith("a; unreachable")
    assert len(two.b.received) == 1
    metrics = await get_text(gw, "/metrics")
    assert 'haru_gateway_retried_total{fleet="default",why="unreachable"} 1.0' in metrics


class GoneUpstream:
    """A serving port whose runtime is gone: 503 model_lost with the runtime-gone mark."""

    def __init__(self, code: str = "model_lost", mark: str = "process_exited") -> None:
        self.code, self.mark = code, mark  # the refusal's code and its runtime-gone mark
        self.received = 0
        self.back = False  # True: the runtime was restarted and answers again
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> GoneUpstream:
        async def handle(request: web.Request) -> web.Response:
            self.received += 1
            await request.read()
            if self.back:
                return web.json_response(
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "created": 1,
                        "model": MODEL,
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": "stop",
                                "message": {"role": "assistant", "content": "[domain a] back"},
                            }
                        ],
                    }
                )
            return web.json_response(
                {
                    "error": {
                        "message": f"the model is not serving here ({self.mark})",
                        "type": "server_error",
                        "param": "model",
                        "code": self.code,
                    }
                },
                status=503,
                headers={"X-Haru-Runtime-Gone": self.mark},
            )

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


async def test_a_runtime_gone_answer_is_sent_once_more_to_the_new_active(event_log, gw, upstreams, servers):
    two = TwoDomains(event_log, gw, await servers(GoneUpstream()), await upstreams("b"))
    await two.route_to_a()
    pending = asyncio.create_task(post(gw, {"model": MODEL, "messages": CHAT}))
    await wait_until(lambda: gw.proxy.holds.held.get("default") == 1, 5.0, interval_s=0.005)
    await two.move_to_b()
    status, headers, data = await pending
    assert status == 200 and b"[domain b]" in data and headers["X-Haru-Retried"] == "a; runtime_gone"
    assert two.a.received == 1


async def test_an_asleep_answer_from_a_domain_put_to_sleep_is_sent_once_more_to_the_new_active(
    event_log, gw, upstreams, servers
):
    # the old active was demoted (asleep) before this gateway saw the route move away from it
    two = TwoDomains(event_log, gw, await servers(GoneUpstream("model_asleep", "asleep")), await upstreams("b"))
    await two.route_to_a()
    pending = asyncio.create_task(post(gw, {"model": MODEL, "messages": CHAT}))
    await wait_until(lambda: gw.proxy.holds.held.get("default") == 1, 5.0, interval_s=0.005)
    await two.move_to_b()
    status, headers, data = await pending
    assert status == 200 and b"[domain b]" in data and headers["X-Haru-Retried"] == "a; asleep"
    assert two.a.received == 1


async def test_a_request_whose_runtime_died_goes_once_more_where_it_is_back_without_a_route_move(
    event_log, gw, upstreams, servers
):
    # the agent restarted a's runtime: the route never moves; the retry waits for the model to be resident
    # there again, not for its whole hold (20 s here)
    two = TwoDomains(event_log, gw, await servers(GoneUpstream()), await upstreams("b"))
    slow = dict(policy=msgspec.structs.replace(FAST, hold_ms=20_000))
    await two.route_to_a(active_state=Resident(since=datetime(2026, 1, 1, tzinfo=UTC)), **slow)
    pending = asyncio.create_task(post(gw, {"model": MODEL, "messages": CHAT}, timeout=5))
    await wait_until(lambda: gw.proxy.holds.held.get("default") == 1, 5.0, interval_s=0.005)
    two.a.back = True
    await two.view(seq=2, active_state=Resident(since=datetime.now(UTC)), **slow)
    status, headers, data = await pending
    assert status == 200 and b"[domain a] back" in data and headers["X-Haru-Retried"] == "a; runtime_gone"
    assert two.a.received == 2 and two.b.received == []


async def test_a_request_whose_runtime_died_waits_for_the_reload_when_the_standby_stops_being_ready(
    event_log, gw, upstreams, servers
):
    # b was ready when a's runtime died (the hold waits for a failover, or for a's reload), then b is not
    # (it reloads too): no failover is coming, but a's restart is (reload measured at 300 ms), so the
    # request still waits, and goes to a once its model is resident there again
    two = TwoDomains(event_log, gw, await servers(GoneUpstream()), await upstreams("b"))
    await two.route_to_a(active_state=Resident(since=datetime(2026, 1, 1, tzinfo=UTC)), reload_ms=300)
    pending = asyncio.create_task(post(gw, {"model": MODEL, "messages": CHAT}, timeout=10))
    await wait_until(lambda: gw.proxy.holds.held.get("default") == 1, 5.0, interval_s=0.005)
    await two.view(
        seq=2,
        reload_ms=300,
        active_state=Loading(since=datetime.now(UTC), attempt=2),
        standby_state=Loading(since=datetime.now(UTC)),
    )
    await asyncio.sleep(0.3)
    assert not pending.done() and gw.proxy.holds.held.get("default") == 1  # still held: a reloads in place
    two.a.back = True
    await two.view(
        seq=3,
        reload_ms=300,
        active_state=Resident(since=datetime.now(UTC)),
        standby_state=Loading(since=datetime.now(UTC)),
    )
    status, headers, data = await pending
    assert status == 200 and b"[domain a] back" in data and headers["X-Haru-Retried"] == "a; runtime_gone"
    assert two.a.received == 2 and two.b.received == []


async def test_a_retry_is_sent_once_only(gw, two):
    await two.route_to_a(policy=msgspec.structs.replace(FAST, hold_ms=300))
    await two.a.stop()
    await two.b.stop()
    # the hold ends with the route unmoved: the one resend goes to a, dead still, and that is the answer
    status, headers, data = await post(gw, {"model": MODEL, "messages": CHAT})
    assert status == 502 and json.loads(data)["error"]["code"] == "upstream_unreachable"
    metrics = await get_text(gw, "/metrics")
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
        obj = {
            "id": f"chatcmpl-{self.domain}",
            "object": "chat.completion.chunk",
            "created": 1000 + ord(self.domain),
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.path != "/v1/chat/completions":  # no tokenizer endpoint: the usage is then approximate
            return web.json_response({"error": {"message": "Not Found", "code": 404}}, status=404)
        body = json.loads(await request.read())
        self.bodies.append(body)
        if self.gone:  # the serving port of a domain whose runtime died
            return web.json_response(
                {
                    "error": {
                        "message": f"the model is not serving here ({self.mark})",
                        "type": "server_error",
                        "param": "model",
                        "code": self.code,
                    }
                },
                status=503,
                headers={"X-Haru-Runtime-Gone": self.mark},
            )
        last = body["messages"][-1]
        done = last["content"] if last["role"] == "assistant" else ""
        rest = self.words
        while rest and done.startswith(rest[0]):
            done, rest = done[len(rest[0]) :], rest[1:]
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


async def _stream_fleet(
    event_log, gw, servers, a: StreamingUpstream, b: StreamingUpstream, runtime: str = "vllm", **view
) -> TwoDomains:
    """a and b started (stopped after the test), the route to a."""
    two = TwoDomains(event_log, gw, await servers(a), await servers(b))
    await two.route_to_a(runtime=runtime, **view)
    return two


@pytest.mark.parametrize("runtime", ["vllm", "llama_server"])
async def test_a_stream_cut_mid_generation_is_continued_on_the_new_active(event_log, gw, servers, runtime):
    a, b = StreamingUpstream("a", WORDS, die_after=4), StreamingUpstream("b", WORDS)
    two = await _stream_fleet(event_log, gw, servers, a, b, runtime)

    async def move_when_cut() -> None:
        await wait_until(lambda: len(a.bodies) == 1, 5.0, interval_s=0.005)
        await asyncio.sleep(0.2)
        await two.move_to_b()

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
    metrics = await get_text(gw, "/metrics")
    assert 'haru_gateway_stream_resumes_total{fleet="default",outcome="continued"} 1.0' in metrics


async def test_a_stream_is_continued_on_the_same_domain_once_it_answers_again(event_log, gw, servers):
    # the agent restarted: no route move, the same serving URL answers again
    a, b = StreamingUpstream("a", WORDS, die_after=3, stays_gone=False), StreamingUpstream("b", WORDS)
    await _stream_fleet(event_log, gw, servers, a, b)
    async with sdk(gw) as client:
        stream = await client.chat.completions.create(model=MODEL, messages=CHAT, stream=True)
        first = await stream.__anext__()
        a.die_after = None  # what answers next is the restarted runtime
        rest = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in [first, *rest] if c.choices)
    assert text == "".join(WORDS) and len(a.bodies) == 2 and b.bodies == []


@pytest.mark.parametrize(
    "extra",
    [
        {"n": 2},
        {"logprobs": True},
        {"response_format": {"type": "json_object"}},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    ],
)
async def test_a_stream_that_cannot_be_continued_faithfully_ends_with_an_error_event(event_log, gw, servers, extra):
    a, b = StreamingUpstream("a", WORDS, die_after=2), StreamingUpstream("b", WORDS)
    await _stream_fleet(event_log, gw, servers, a, b)
    async with sdk(gw) as client:
        stream = await client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **extra)
        with pytest.raises(openai.APIError) as info:
            async for _ in stream:
                pass
    assert "cannot be continued faithfully" in str(info.value)
    assert b.bodies == []
    metrics = await get_text(gw, "/metrics")
    assert 'haru_gateway_stream_resumes_total{fleet="default",outcome="error_event"} 1.0' in metrics


async def test_a_cut_with_nowhere_to_continue_ends_with_an_error_event_not_a_silent_cut(event_log, gw, servers):
    a, b = StreamingUpstream("a", WORDS, die_after=2), StreamingUpstream("b", WORDS)
    await _stream_fleet(event_log, gw, servers, a, b, policy=msgspec.structs.replace(FAST, hold_ms=300))
    await b.stop()

    async def host_dies() -> None:  # after the cut, a refuses connections: nothing can continue it
        await wait_until(lambda: len(a.bodies) == 1, 5.0, interval_s=0.005)
        await a.stop()

    dying = asyncio.create_task(host_dies())
    async with aiohttp.ClientSession() as s:
        async with s.post(
            gw.url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "stream": True}
        ) as r:
            data = await r.read()
    await dying
    last = data.rstrip(b"\n").split(b"\n\n")[-1]
    assert last.startswith(b'data: {"error":'), data
    assert json.loads(last[6:])["error"]["code"] == "stream_interrupted"


async def test_a_whole_response_broken_off_before_any_byte_reached_the_client_is_sent_once_more(
    event_log, gw, upstreams, servers
):
    """The head came, then the domain dropped the connection mid-body (its host died, or the gateway failed
    what was in flight to a domain the view calls unreachable): nothing reached the client yet, so the
    request goes once more, to the new active, rather than ending as a 502."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 400\r\nConnection: close\r\n\r\n"
    a = await servers(RawUpstream(lambda n: [head, b'{"id": "half of it'] if n == 1 else None))
    two = TwoDomains(event_log, gw, a, await upstreams("b"))
    await two.route_to_a()
    pending = asyncio.create_task(post(gw, {"model": MODEL, "messages": CHAT}))
    await wait_until(lambda: gw.proxy.holds.held.get("default") == 1, 5.0, interval_s=0.005)
    await two.move_to_b()
    status, headers, data = await pending
    assert status == 200 and b"[domain b]" in data, data
    assert headers["X-Haru-Retried"].startswith("a; unreachable")
