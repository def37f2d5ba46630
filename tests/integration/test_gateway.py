"""The gateway against real sockets: a real nats-server with views and intents published the way the
projector publishes them, small aiohttp upstreams (deterministic bytes, so a response through the
gateway can be compared byte for byte with one from the upstream directly), and the official
`openai` SDK as the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from datetime import timedelta
from itertools import pairwise

import aiohttp
import msgspec
import openai
import pytest

from haru.core import subjects
from haru.core.residency import Answer, Loading, Lost, NotAdmitted, Resident, Sleeping
from haru.core.specs import Policy
from haru.core.views import DomainView, FleetView, ModelView, RouteIntent, view_encoder
from tests.support.clock import now
from tests.support.gateway import (
    CHAT,
    MODEL,
    OK_JSON,
    SMALL,
    TOKEN,
    Fleet,
    RawUpstream,
    get_json,
    get_text,
    intent_of,
    post_raw,
    running_gateway,
    sdk,
    view_of,
)
from tests.support.wait import wait_until

# ------------------------------------------------------------------------------------ upstream


# ---------------------------------------------------------------------------------- fleet state


@pytest.fixture
async def two_domains(event_log, gw, upstreams):
    """Fleet `default`: domains a (active) and b, both ready, each with its own upstream."""
    a, b = await upstreams("a"), await upstreams("b")
    fleet = Fleet(event_log, gw)
    await fleet.put_view(view_of("default", {"a": a.url, "b": b.url}, active="a", seq=1))
    await fleet.publish(intent_of("default", "a", a.url, revision=1))
    return fleet, a, b


# ------------------------------------------------------------------------------ the SDK, happy


async def test_sdk_chat_goes_to_the_active_domain(gw, two_domains):
    _, a, b = two_domains
    async with sdk(gw) as client:
        reply = await client.chat.completions.create(model=MODEL, messages=CHAT)
    assert reply.choices[0].message.content == "[domain a] hi"
    assert len(a.received) == 1 and not b.received
    path, body, headers = a.received[0]
    assert path == "/v1/chat/completions"
    assert json.loads(body)["model"] == MODEL
    assert "X-Haru-Fleet" not in headers


async def test_sdk_streaming_chunks_arrive_as_produced(gw, two_domains):
    _, a, _ = two_domains
    arrivals: list[float] = []
    texts: list[str] = []
    async with sdk(gw) as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=CHAT, stream=True, extra_body={"chunks": 6, "gap": 0.2}
        )
        async for chunk in stream:
            arrivals.append(time.monotonic())
            texts.append(chunk.choices[0].delta.content or "")
    assert "".join(texts) == "[domain a] tok1 tok2 tok3 tok4 tok5"
    # produced 0.2 s apart (1 s in all): a buffering proxy would deliver them together at the end. The
    # bounds leave room for this process being descheduled a moment (two test workers, two cores).
    spread = arrivals[-1] - arrivals[0]
    assert spread >= 0.5, f"chunks arrived within {spread:.3f} s: buffered"
    gaps = [b - a for a, b in pairwise(arrivals)]
    assert sum(1 for g in gaps if g > 0.05) >= 3, gaps


async def test_sdk_models_list_carries_router_answers(event_log, gw, upstreams):
    up = await upstreams("a")
    fleet = Fleet(event_log, gw)
    since = now() - timedelta(seconds=20)
    await fleet.put_view(view_of("default", {"a": up.url}, active="a", residency={("a", SMALL): Loading(since=since)}))
    await fleet.publish(
        intent_of(
            "default",
            "a",
            up.url,
            revision=1,
            answers={MODEL: Answer(answer="ready"), SMALL: Answer(answer="warming", since=since)},
        )
    )
    async with sdk(gw) as client:
        page = await client.models.list()
    models = {m.id: m for m in page.data}
    assert list(models) == [MODEL, SMALL]
    ready, warming = models[MODEL].model_extra["haru"], models[SMALL].model_extra["haru"]
    assert ready["routable"] is True and ready["answer"]["answer"] == "ready" and ready["active"] == "a"
    assert warming["routable"] is False and warming["status"] == 503 and warming["code"] == "model_warming"
    assert warming["answer"]["for_ms"] >= 20_000


# ---------------------------------------------------------------------- each status, via the SDK


def _answers(kind: Answer) -> dict[str, Answer]:
    return {MODEL: kind, SMALL: Answer(answer="ready")}


@pytest.mark.parametrize(
    "answer, exc_class, status, code, words",
    [
        (Answer(answer="asleep"), openai.InternalServerError, 503, "model_asleep", "asleep"),
        (
            Answer(answer="lost", reason="gpu_detached"),
            openai.InternalServerError,
            503,
            "gpu_detached",
            "not the operator's doing",
        ),
        (
            Answer(answer="lost", reason="evicted", detail="runtime no longer lists the model"),
            openai.InternalServerError,
            503,
            "model_lost",
            "evicted",
        ),
        (
            Answer(answer="not_admitted", short_by_bytes=int(14.8 * 2**30)),
            openai.ConflictError,
            409,
            "model_not_admitted",
            "short by 14.8 GiB",
        ),
        (Answer(answer="unknown"), openai.InternalServerError, 503, "residency_unknown", "unknown"),
    ],
)
async def test_sdk_raises_the_matching_exception_with_our_message(
    gw, two_domains, answer, exc_class, status, code, words
):
    fleet, a, _ = two_domains
    await fleet.publish(intent_of("default", "a", a.url, revision=1, answers=_answers(answer)))
    async with sdk(gw) as client:
        with pytest.raises(exc_class) as info:
            await client.chat.completions.create(model=MODEL, messages=CHAT)
    err = info.value
    assert err.status_code == status
    assert err.code == code
    assert words in err.body["message"] and MODEL in err.body["message"]
    assert err.response.headers["X-Haru-Domain"] == "a"
    assert not a.received, "a refused request must not reach the upstream"
    if code == "model_asleep":
        assert err.response.headers["Retry-After"] == "5"
    if code == "model_not_admitted":
        assert err.response.headers["x-should-retry"] == "false"
        assert err.body["type"] == "conflict_error"


async def test_warming_is_503_with_retry_after_from_how_long(gw, two_domains):
    fleet, a, _ = two_domains
    since = now() - timedelta(seconds=38)
    await fleet.publish(
        intent_of(
            "default", "a", a.url, revision=1, answers=_answers(Answer(answer="warming", since=since, reason="loading"))
        )
    )
    async with sdk(gw) as client:
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model=MODEL, messages=CHAT)
    err = info.value
    assert err.code == "model_warming"
    assert err.response.headers["Retry-After"] == "10"  # a quarter of 38 s, rounded up
    assert "warming" in err.body["message"] and "loading" in err.body["message"]


async def test_not_admitted_is_never_retried_by_the_sdk(gw, two_domains):
    fleet, a, _ = two_domains
    await fleet.publish(
        intent_of(
            "default", "a", a.url, revision=1, answers=_answers(Answer(answer="not_admitted", short_by_bytes=2**30))
        )
    )
    async with sdk(gw, retries=3) as client:
        with pytest.raises(openai.ConflictError):
            await client.chat.completions.create(model=MODEL, messages=CHAT)
    text = await get_text(gw, "/metrics")
    assert f'haru_gateway_requests_total{{fleet="default",model="{MODEL}",status="409"}} 1.0' in text


async def test_sdk_not_found_for_unknown_model_and_fleet(event_log, gw, two_domains):
    async with sdk(gw) as client:
        with pytest.raises(openai.NotFoundError) as info:
            await client.chat.completions.create(model="no-such-model", messages=CHAT)
    assert info.value.code == "model_not_found" and "no-such-model" in info.value.body["message"]
    # OpenAI's type for a 404, as the agent's serving port says it (one table: haru.core.openai_errors)
    assert info.value.body["type"] == "invalid_request_error" and info.value.body["param"] == "model"
    async with sdk(gw, fleet="nowhere") as client:
        with pytest.raises(openai.NotFoundError) as info:
            await client.chat.completions.create(model=MODEL, messages=CHAT)
    assert info.value.code == "fleet_not_found" and "nowhere" in info.value.body["message"]


async def test_model_only_on_the_standby_is_404_saying_where(event_log, gw, upstreams):
    a, b = await upstreams("a"), await upstreams("b")
    fleet = Fleet(event_log, gw)
    view = view_of("default", {"a": a.url, "b": b.url}, active="a")
    extra = ModelView(name="only-b", admitted=True, residency=Resident(since=now()))
    domains = dict(view.domains)
    domains["b"] = DomainView(name="b", serving_url=b.url, models={**view.domains["b"].models, "only-b": extra})
    await fleet.put_view(FleetView(fleet="default", domains=domains, active="a", route_revision=1, seq=1))
    await fleet.publish(intent_of("default", "a", a.url, revision=1))
    async with sdk(gw) as client:
        with pytest.raises(openai.NotFoundError) as info:
            await client.chat.completions.create(model="only-b", messages=CHAT)
    assert "only on domain 'b'" in info.value.body["message"]


async def test_no_active_domain_is_503(event_log, gw, upstreams):
    a = await upstreams("a")
    fleet = Fleet(event_log, gw)
    await fleet.put_view(view_of("default", {"a": a.url}, active=""))
    await fleet.publish(RouteIntent(fleet="default", revision=0, active=None, answers={}))
    async with sdk(gw) as client:
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model=MODEL, messages=CHAT)
    assert info.value.code == "no_active_domain" and "promote" in info.value.body["message"]


async def test_bad_bodies_are_400_naming_the_problem(gw, two_domains):
    async with aiohttp.ClientSession() as s:
        for body, words in [
            (b'{"model": 7, "messages": []}', "Expected `str`, got `int` - at `$.model`"),
            (b'{"messages": []}', "missing required field `model`"),
            (b'{"model": "x", "messages": [', "not valid JSON"),
            (b"[1, 2]", "Expected `object`, got `array`"),
            (b"", "empty"),
        ]:
            async with s.post(
                gw.url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
            ) as r:
                err = (await r.json())["error"]
                assert r.status == 400, body
                assert err["code"] == "invalid_request" and err["type"] == "invalid_request_error"
                assert words in err["message"], (body, err["message"])
    async with sdk(gw) as client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"model": 7})
    assert "`$.model`" in info.value.body["message"] and info.value.body["param"] == "model"


async def test_payload_too_large_by_header_and_while_reading(event_log, upstreams):
    up = await upstreams("a")
    async with running_gateway(event_log, max_body_bytes=1000) as gw:
        fleet = Fleet(event_log, gw)
        await fleet.put_view(view_of("default", {"a": up.url}, active="a"))
        await fleet.publish(intent_of("default", "a", up.url, revision=1))
        big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 2000}]}).encode()
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/chat/completions", data=big) as r:
                assert r.status == 413
                assert (await r.json())["error"]["code"] == "payload_too_large"

            async def chunked():
                for i in range(0, len(big), 100):
                    yield big[i : i + 100]

            async with s.post(gw.url + "/v1/chat/completions", data=chunked()) as r:
                assert r.status == 413
                assert "HARU_CHAT_MAX_BODY_BYTES (1000 bytes)" in (await r.json())["error"]["message"]
            small = json.dumps({"model": MODEL, "messages": CHAT}).encode()
            async with s.post(gw.url + "/v1/chat/completions", data=small) as r:
                assert r.status == 200
        async with sdk(gw) as client:
            with pytest.raises(openai.APIStatusError) as info:
                await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y" * 2000}])
        assert info.value.status_code == 413
        assert not any(len(b) > 1000 for _, b, _ in up.received)


# ------------------------------------------------------------------------------ byte identity


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
async def test_request_and_response_bytes_are_identical_to_direct(gw, two_domains, path):
    _, a, _ = two_domains
    # odd spacing, key order, unicode, vendor extensions: nothing may be re-encoded
    body = (
        '{ "messages":[{"role":"user","content":"h\\u00e9llo ☃"}],  "model" : "'
        + MODEL
        + '", "top_k": 7, "vendor_ext": {"x": [1.50, 2e3]} }'
    ).encode()
    s1, via_gateway, _ = await post_raw(gw.url + path, body)
    s2, direct, _ = await post_raw(a.url + path, body)
    assert s1 == s2 == 200
    assert via_gateway == direct
    assert a.received[0][1] == body and a.received[1][1] == body
    assert a.received[0][0] == path


async def test_sse_bytes_are_identical_to_direct(gw, two_domains):
    _, a, _ = two_domains
    body = json.dumps({"model": MODEL, "messages": CHAT, "stream": True, "chunks": 8}).encode()
    s1, via_gateway, _ = await post_raw(gw.url + "/v1/chat/completions", body)
    s2, direct, _ = await post_raw(a.url + "/v1/chat/completions", body)
    assert s1 == s2 == 200
    assert via_gateway == direct and via_gateway.endswith(b"data: [DONE]\n\n")
    assert a.received[0][1] == body


async def test_upstream_errors_pass_through_untouched(gw, two_domains):
    _, a, _ = two_domains
    body = json.dumps({"model": MODEL, "messages": CHAT, "upstream_status": 422}).encode()
    status, data, _ = await post_raw(gw.url + "/v1/chat/completions", body)
    assert status == 422 and data == b'{"error":{"message":"upstream says no","code":422}}'


# ------------------------------------------------------------------------- routing and failover


async def test_promotion_during_traffic(gw, two_domains):
    fleet, a, b = two_domains
    # a long stream on a, in flight while the pointer moves
    body = json.dumps({"model": MODEL, "messages": CHAT, "stream": True, "chunks": 12, "gap": 0.05}).encode()
    old_stream = asyncio.create_task(post_raw(gw.url + "/v1/chat/completions", body))
    await wait_until(lambda: len(a.received) == 1, 5.0, interval_s=0.005)

    seen: list[str] = []
    stop = asyncio.Event()

    async def traffic() -> None:
        async with aiohttp.ClientSession() as s:
            while not stop.is_set():
                async with s.post(gw.url + "/v1/chat/completions", json={"model": SMALL, "messages": CHAT}) as r:
                    assert r.status == 200
                    seen.append(r.headers["X-Haru-Domain"])

    load = asyncio.create_task(traffic())
    await wait_until(lambda: len(seen) >= 5, 5.0, interval_s=0.005)
    await fleet.publish(intent_of("default", "b", b.url, revision=7))
    # the very next request goes to b
    status, data, _ = await post_raw(
        gw.url + "/v1/chat/completions", json.dumps({"model": MODEL, "messages": CHAT}).encode()
    )
    assert status == 200 and b"[domain b]" in data
    n = len(seen)
    await wait_until(lambda: len(seen) >= n + 5, 5.0, interval_s=0.005)
    stop.set()
    await load
    # once b answered, a never did again
    first_b = seen.index("b")
    assert set(seen[:first_b]) == {"a"} and set(seen[first_b:]) == {"b"}
    # the stream that started on a finished there, whole
    status, data, _ = await old_stream
    assert status == 200
    assert data.count(b"data: ") == 13 and b"[domain a]" in data and data.endswith(b"data: [DONE]\n\n")
    assert a.cancelled == 0
    metrics = await get_text(gw, "/metrics")
    assert 'haru_gateway_route_revision{fleet="default"} 7.0' in metrics


async def test_serve_direct_uses_the_models_own_url(event_log, gw, upstreams):
    a, direct = await upstreams("a"), await upstreams("a-direct")
    fleet = Fleet(event_log, gw)
    await fleet.put_view(view_of("default", {"a": a.url}, active="a"))
    await fleet.publish(
        intent_of(
            "default", "a", a.url, revision=1, serve="direct", model_urls={MODEL: direct.url + "/v1", SMALL: a.url}
        )
    )
    status, data, _ = await post_raw(
        gw.url + "/v1/chat/completions", json.dumps({"model": MODEL, "messages": CHAT}).encode()
    )
    assert status == 200 and b"[domain a-direct]" in data
    assert direct.received[0][0] == "/v1/chat/completions"


async def test_serving_token_replaces_the_clients_credentials(event_log, upstreams):
    up = await upstreams("a")
    async with running_gateway(event_log, api_token=TOKEN, serving_token="serve-tok") as gw:
        fleet = Fleet(event_log, gw)
        await fleet.put_view(view_of("default", {"a": up.url}, active="a"))
        await fleet.publish(intent_of("default", "a", up.url, revision=1))
        async with sdk(gw, token=TOKEN) as client:
            await client.chat.completions.create(model=MODEL, messages=CHAT)
    headers = up.received[0][2]
    assert headers["Authorization"] == "Bearer serve-tok"
    assert TOKEN not in json.dumps(headers)


# -------------------------------------------------------------------------- timeouts, failures


async def test_header_timeout_is_504_and_honored_exactly(event_log, upstreams):
    up = await upstreams("a")
    async with running_gateway(event_log, header_timeout_ms=300) as gw:
        fleet = Fleet(event_log, gw)
        await fleet.put_view(view_of("default", {"a": up.url}, active="a"))
        await fleet.publish(intent_of("default", "a", up.url, revision=1))
        t0 = time.monotonic()
        async with sdk(gw) as client:
            with pytest.raises(openai.InternalServerError) as info:
                await client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"header_delay": 5})
        took = time.monotonic() - t0
        assert info.value.status_code == 504 and info.value.code == "upstream_timeout"
        assert "HARU_CHAT_HEADER_TIMEOUT_MS (300 ms)" in info.value.body["message"]
        assert 0.29 <= took < 4.5  # the bound, not the upstream's 5 s
        # the upstream request was dropped, not left running
        await wait_until(lambda: up.cancelled == 1, 5.0, interval_s=0.005)
        # a quiet stream is not cut: 1 s of silence mid-generation, well past the header timeout
        async with sdk(gw) as client:
            stream = await client.chat.completions.create(
                model=MODEL, messages=CHAT, stream=True, extra_body={"chunks": 3, "pause": 1.0, "pause_at": 1}
            )
            texts = [c.choices[0].delta.content async for c in stream]
        assert texts == ["[domain a]", " tok1", " tok2"]
    async with running_gateway(event_log, header_timeout_ms=3000) as gw:
        # applied by the resync loop
        await wait_until(
            lambda: gw.table.get("default") is not None and gw.table.get("default").intent is not None,
            5.0,
            interval_s=0.005,
        )
        async with sdk(gw) as client:  # headers after 1 s: within a 3 s bound, so served
            reply = await client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"header_delay": 1.0})
        assert reply.choices[0].message.content == "[domain a] hi"


async def test_unreachable_upstream_is_502(event_log, gw, upstreams):
    up = await upstreams("a")
    dead = up.url
    await up.stop()
    fleet = Fleet(event_log, gw)
    await fleet.put_view(view_of("default", {"a": dead}, active="a"))
    await fleet.publish(intent_of("default", "a", dead, revision=1))
    async with sdk(gw) as client:
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model=MODEL, messages=CHAT)
    assert info.value.status_code == 502 and info.value.code == "upstream_unreachable"
    assert "'a'" in info.value.body["message"] and dead in info.value.body["message"]


async def test_client_disconnect_cancels_the_upstream_request(gw, two_domains):
    _, a, _ = two_domains
    body = json.dumps({"model": MODEL, "messages": CHAT, "stream": True, "chunks": 50, "gap": 0.1}).encode()
    async with aiohttp.ClientSession() as s:
        r = await s.post(gw.url + "/v1/chat/completions", data=body)
        first = await r.content.readany()
        assert b"[domain a]" in first
        await wait_until(
            lambda: 'haru_gateway_inflight_streams{fleet="default"} 1.0' in gw.metrics.render().decode(),
            5.0,
            interval_s=0.005,
        )
        r.close()  # drop the connection mid-stream
    await wait_until(lambda: a.cancelled == 1, 3, interval_s=0.005)
    assert a.completed == 0
    await wait_until(
        lambda: 'haru_gateway_inflight_streams{fleet="default"} 0.0' in gw.metrics.render().decode(),
        5.0,
        interval_s=0.005,
    )


async def test_a_waiting_client_that_leaves_cancels_the_upstream(gw, two_domains):
    _, a, _ = two_domains
    body = json.dumps({"model": MODEL, "messages": CHAT, "header_delay": 5}).encode()
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(gw.url + "/v1/chat/completions", data=body))
        await wait_until(lambda: len(a.received) == 1, 5.0, interval_s=0.005)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await wait_until(lambda: a.cancelled == 1, 3, interval_s=0.005)


# ------------------------------------------------------------------------------------- auth


async def test_auth_on_guards_everything_but_healthz(event_log, upstreams):
    up = await upstreams("a")
    async with running_gateway(event_log, api_token=TOKEN, host="0.0.0.0") as gw:
        assert gw.host == "0.0.0.0"  # with a token the requested host is honoured
        fleet = Fleet(event_log, gw)
        await fleet.put_view(view_of("default", {"a": up.url}, active="a"))
        await fleet.publish(intent_of("default", "a", up.url, revision=1))
        url = f"http://127.0.0.1:{gw.port}"
        assert (await get_json(url, "/healthz"))[0] == 200
        for path in ("/v1/models", "/residency", "/metrics", "/v1/fleets/default", "/v1/fleets/default/route-intent"):
            status, body = await get_json(url, path)
            assert status == 401 and body["error"]["code"] == "invalid_api_key", path
            assert (await get_json(url, path, "wrong"))[0] == 401
        assert (await get_json(url, "/v1/fleets/default", TOKEN))[0] == 200
        gw_client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        async with gw_client as client:
            with pytest.raises(openai.AuthenticationError):
                await client.chat.completions.create(model=MODEL, messages=CHAT)
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0) as client:
            reply = await client.chat.completions.create(model=MODEL, messages=CHAT)
        assert reply.choices[0].message.content == "[domain a] hi"
        assert len(up.received) == 1


async def test_auth_off_binds_loopback_whatever_host_says(event_log):
    async with running_gateway(event_log, host="0.0.0.0") as gw:
        assert gw.host == "127.0.0.1"
        status, _ = await get_json(gw.url, "/v1/fleets")
        assert status == 200


# ------------------------------------------------------------------------------ control API


async def test_residency_truth_table(event_log, gw, upstreams):
    a, b = await upstreams("a"), await upstreams("b")
    fleet = Fleet(event_log, gw)
    t = now() - timedelta(seconds=30)
    residency = {
        ("a", SMALL): Lost(reason="gpu_detached", since=t),
        ("b", MODEL): Sleeping(since=t),
        ("b", SMALL): NotAdmitted(short_by_bytes=2**31, since=t),
    }
    await fleet.put_view(view_of("default", {"a": a.url, "b": b.url}, active="a", residency=residency))
    await fleet.publish(
        intent_of(
            "default",
            "a",
            a.url,
            revision=1,
            answers={MODEL: Answer(answer="ready"), SMALL: Answer(answer="lost", reason="gpu_detached")},
        )
    )
    status, table = await get_json(gw.url, "/residency")
    assert status == 200
    f = table["fleets"]["default"]
    assert f["active"] == "a" and f["route_revision"] == 1
    lost = f["domains"]["a"]["models"][SMALL]
    assert lost["residency"]["state"] == "lost" and lost["residency"]["reason"] == "gpu_detached"
    assert lost["residency"]["for_ms"] >= 30_000 and lost["code"] == "gpu_detached" and lost["status"] == 503
    assert f["domains"]["a"]["models"][MODEL]["routable"] is True
    assert f["domains"]["b"]["models"][MODEL]["residency"]["summary"].startswith("sleeping (level 1) for 3")
    assert f["domains"]["b"]["models"][SMALL]["residency"]["summary"] == "not admitted — short by 2.0 GiB"
    assert "routable" not in f["domains"]["b"]["models"][MODEL]  # the standby is not routed to
    status, one = await get_json(gw.url, "/residency?fleet=nope")
    assert status == 404 and one["error"]["code"] == "fleet_not_found"


async def test_fleet_view_and_route_intent_endpoints(event_log, gw, two_domains):
    status, view = await get_json(gw.url, "/v1/fleets/default")
    assert status == 200 and view["fleet"] == "default" and set(view["domains"]) == {"a", "b"}
    status, intent = await get_json(gw.url, "/v1/fleets/default/route-intent")
    assert status == 200 and intent["active"]["domain"] == "a" and intent["revision"] == 1
    status, err = await get_json(gw.url, "/v1/fleets/nope")
    assert status == 404 and err["error"]["code"] == "fleet_not_found"
    status, err = await get_json(gw.url, "/v1/fleets/Bad.Name")
    assert status == 400 and "fleet name" in err["error"]["message"]
    status, err = await get_json(gw.url, "/v1/nothing-here")
    assert status == 404
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/v1/chat/completions") as r:
            assert r.status == 405 and r.headers["Allow"] == "POST"


async def test_metrics_exposition(gw, two_domains):
    async with sdk(gw) as client:
        await client.chat.completions.create(model=MODEL, messages=CHAT)
        stream = await client.chat.completions.create(model=MODEL, messages=CHAT, stream=True)
        async for _ in stream:
            pass
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nope", messages=CHAT)
    text = await get_text(gw, "/metrics")
    assert f'haru_gateway_requests_total{{fleet="default",model="{MODEL}",status="200"}} 2.0' in text
    assert 'haru_gateway_requests_total{fleet="default",model="(unknown)",status="404"} 1.0' in text
    async with sdk(gw, fleet="made-up-fleet") as client:
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model=MODEL, messages=CHAT)
    text = await get_text(gw, "/metrics")
    assert 'haru_gateway_requests_total{fleet="(unknown)",model="(unknown)",status="404"} 1.0' in text
    assert "made-up-fleet" not in text
    assert 'haru_gateway_upstream_ttfb_seconds_count{domain="a",fleet="default"} 2.0' in text
    assert 'haru_gateway_upstream_latency_seconds_count{domain="a",fleet="default"} 2.0' in text
    assert 'haru_gateway_inflight_streams{fleet="default"} 0.0' in text
    assert 'haru_gateway_route_revision{fleet="default"} 1.0' in text


async def test_two_gateways_in_one_process_keep_their_own_metrics(event_log, gw, two_domains):
    async with running_gateway(event_log) as other:
        await wait_until(
            lambda: other.table.get("default") is not None and other.table.get("default").intent is not None,
            5.0,
            interval_s=0.005,
        )
        async with sdk(gw) as client:
            await client.chat.completions.create(model=MODEL, messages=CHAT)
        assert 'status="200"' in gw.metrics.render().decode()
        assert 'status="200"' not in other.metrics.render().decode()


async def test_gateway_started_after_the_projector_sees_current_state(event_log, upstreams):
    up = await upstreams("a")
    await event_log.put_view(
        subjects.view_key("late"), view_encoder.encode(view_of("late", {"a": up.url}, active="a")), last=0
    )
    await event_log.publish_intent("late", view_encoder.encode(intent_of("late", "a", up.url, revision=3)), expect=0)
    async with running_gateway(event_log) as gw:
        await wait_until(
            lambda: gw.table.get("late") is not None and gw.table.get("late").revision == 3, 5.0, interval_s=0.005
        )
        async with sdk(gw, fleet="late") as client:
            reply = await client.chat.completions.create(model=MODEL, messages=CHAT)
        assert reply.choices[0].message.content == "[domain a] hi"
        status, health = await get_json(gw.url, "/healthz")
        assert status == 200 and health["fleets"]["late"] == {"active": "a", "route_revision": 3}
        assert health["nats_connected"] is True


# ------------------------------------------------------------------------ the upstream pool


async def _point_at(event_log, gw, url: str) -> None:
    fleet = Fleet(event_log, gw)
    await fleet.put_view(view_of("default", {"a": url}, active="a"))
    await fleet.publish(intent_of("default", "a", url, revision=1))


async def test_upstream_connections_are_kept_alive_and_reused(event_log, gw, two_domains):
    body = json.dumps({"model": MODEL, "messages": CHAT}).encode()
    for _ in range(5):
        status, _, _ = await post_raw(gw.url + "/v1/chat/completions", body)
        assert status == 200
    sse = json.dumps({"model": MODEL, "messages": CHAT, "stream": True}).encode()
    for _ in range(3):
        status, _, _ = await post_raw(gw.url + "/v1/chat/completions", sse)
        assert status == 200
    assert gw.proxy.pool.opened == 1


async def test_a_kept_alive_connection_closed_by_the_upstream_is_retried_fresh(event_log, gw):
    up = await RawUpstream(lambda n: OK_JSON if n == 1 else None).start()
    try:
        await _point_at(event_log, gw, up.url)
        body = json.dumps({"model": MODEL, "messages": CHAT}).encode()
        for _ in range(3):
            status, data, _ = await post_raw(gw.url + "/v1/chat/completions", body)
            assert (status, data) == (200, b'{"ok":true}')
        assert up.connections == 3 and gw.proxy.pool.opened == 3
    finally:
        await up.stop()


async def test_the_retry_of_a_closed_kept_alive_connection_never_takes_another_idle_one(event_log, gw):
    """An upstream that restarts (an agent draining on SIGTERM) closes every kept-alive connection at
    once: the retry goes on a new connection, not on the next idle one, which is just as dead."""
    up = await RawUpstream(lambda n: OK_JSON if n == 1 else None).start()
    try:
        await _point_at(event_log, gw, up.url)
        body = json.dumps({"model": MODEL, "messages": CHAT}).encode()
        answers = await asyncio.gather(*(post_raw(gw.url + "/v1/chat/completions", body) for _ in range(3)))
        assert [(s, d) for s, d, _ in answers] == [(200, b'{"ok":true}')] * 3
        assert gw.proxy.pool.idle_count() == 3
        status, data, _ = await post_raw(gw.url + "/v1/chat/completions", body)
        assert (status, data) == (200, b'{"ok":true}')
        assert up.connections == 4
    finally:
        await up.stop()


async def _exchange(url: str, requests: list[bytes]) -> list[bytes]:
    """Send each request on one connection and read its whole answer (by Content-Length or chunked)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    answers = []
    try:
        for req in requests:
            writer.write(req)
            head = await reader.readuntil(b"\r\n\r\n")
            lower = head.lower()
            if b"content-length:" in lower:
                i = lower.index(b"content-length:")
                n = int(lower[i + 15 : lower.index(b"\r\n", i)])
                answers.append(head + await reader.readexactly(n))
                continue
            body = b""
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line[:-2], 16)
                body += size_line + await reader.readexactly(size + 2)
                if size == 0:
                    break
            answers.append(head + body)
        answers.append(await asyncio.wait_for(reader.read(), 5) if b"Connection: close" in requests[-1] else b"")
    finally:
        writer.close()
    return answers


def _headers_of(answer: bytes) -> dict[str, str]:
    lines = answer.split(b"\r\n\r\n")[0].decode().split("\r\n")
    return {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}


async def test_whole_responses_go_out_as_aiohttp_would_send_them(event_log, gw):
    """A whole response is serialised by the proxy in one write (issue 20): the same headers as
    web.Response gives (its defaults included), keep-alive kept, `Connection: close` honoured, and an
    HTTP/1.0 client still answered by web.Response."""
    sized = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'
    bare = b"HTTP/1.1 201 Created\r\nX-Up: 1\r\nX-Haru-Domain: forged\r\nContent-Length: 2\r\n\r\nhi"
    sse = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"d\r\ndata: hello\n\n\r\n0\r\n\r\n"
    )
    answers = iter([sized, bare, sse, sized, sized] * 2)
    up = await RawUpstream(lambda n: [next(answers)]).start()
    try:
        await _point_at(event_log, gw, up.url)
        body = json.dumps({"model": MODEL, "messages": CHAT}).encode()

        def req(extra: bytes = b"", version: bytes = b"1.1") -> bytes:
            return (
                b"POST /v1/chat/completions HTTP/"
                + version
                + b"\r\nHost: x\r\nContent-Type: application/json\r\n"
                + extra
                + b"Content-Length: %d\r\n\r\n" % len(body)
                + body
            )

        a, b, c, d, closed = await _exchange(gw.url, [req(), req(), req(), req(b"Connection: close\r\n")])
        ha, hb, hc, hd = (_headers_of(x) for x in (a, b, c, d))
        assert a.startswith(b"HTTP/1.1 200 OK\r\n") and a.endswith(b'\r\n\r\n{"ok":true}')
        assert ha["content-length"] == "11" and ha["content-type"] == "application/json"
        assert ha["x-haru-domain"] == "a" and "date" in ha and "server" in ha and "connection" not in ha
        assert b.startswith(b"HTTP/1.1 201 Created\r\n") and b.endswith(b"\r\n\r\nhi")
        assert hb["content-type"] == "application/octet-stream" and hb["x-up"] == "1" and hb["x-haru-domain"] == "a"
        assert hc["transfer-encoding"] == "chunked" and hc["content-type"] == "text/event-stream"
        assert c.endswith(b"\r\n\r\nd\r\ndata: hello\n\n\r\n0\r\n\r\n")
        assert hd["connection"] == "close" and closed == b""  # and the gateway closed the connection
        (old,) = (await _exchange(gw.url, [req(b"Connection: keep-alive\r\n", b"1.0")]))[:1]
        assert old.startswith(b"HTTP/1.0 200 OK\r\n") and old.endswith(b'{"ok":true}')
        assert _headers_of(old)["connection"] == "keep-alive"
    finally:
        await up.stop()


async def test_until_close_and_large_sized_bodies_stream_through(event_log, upstreams):
    big = b"x" * 5000
    answers = {
        1: [b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n", b"part one, ", b"part two"],
        2: [
            b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: 5000\r\n\r\n",
            big[:2000],
            big[2000:],
        ],
    }
    count = iter(range(1, 100))
    up = await RawUpstream(lambda n: answers.get(next(count))).start()
    try:
        async with running_gateway(event_log, buffer_limit_bytes=1000) as gw:
            await _point_at(event_log, gw, up.url)
            body = json.dumps({"model": MODEL, "messages": CHAT}).encode()
            status, data, _ = await post_raw(gw.url + "/v1/chat/completions", body)
            assert (status, data) == (200, b"part one, part two")
            async with aiohttp.ClientSession() as s:
                async with s.post(gw.url + "/v1/chat/completions", data=body) as r:
                    assert r.headers["Content-Length"] == "5000" and "Transfer-Encoding" not in r.headers
                    assert await r.read() == big
    finally:
        await up.stop()


async def test_an_upstream_that_always_breaks_off_mid_stream_ends_with_an_sse_error_event(event_log, gw):
    # Every try to continue it breaks off the same way: the client gets a final SSE error event in
    # OpenAI's shape and a clean end, never a silent cut, and never half an event (`data: 1` had no end).
    def answer(n):
        return [
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"7\r\ndata: 1\r\n",
            b"garbage that is not a chunk\r\n",
        ]

    up = await RawUpstream(answer).start()
    try:
        fleet = Fleet(event_log, gw)  # a 3 s hold, not the default 30 s: the giving up is what is tested
        view = view_of("default", {"a": up.url}, active="a")
        await fleet.put_view(msgspec.structs.replace(view, policy=Policy(hold_max_ms=3_000)))
        await fleet.publish(intent_of("default", "a", up.url, revision=1))
        body = json.dumps({"model": MODEL, "messages": CHAT, "stream": True}).encode()
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/chat/completions", data=body) as r:
                assert r.status == 200
                data = await r.read()
        assert data.startswith(b'data: {"error":') and data.endswith(b"\n\n"), data
        assert json.loads(data[6:])["error"]["code"] == "stream_interrupted"
        assert up.connections >= 2  # it was tried again before giving up
    finally:
        await up.stop()


async def test_a_malformed_upstream_head_is_502(event_log, gw):
    up = await RawUpstream(lambda n: [b"SSH-2.0-OpenSSH_9.6\r\n\r\n"]).start()
    try:
        await _point_at(event_log, gw, up.url)
        async with sdk(gw) as client:
            with pytest.raises(openai.InternalServerError) as info:
                await client.chat.completions.create(model=MODEL, messages=CHAT)
        assert info.value.status_code == 502 and "malformed response" in info.value.body["message"]
    finally:
        await up.stop()


_H = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
_CH = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    "raw",
    [
        _CH + b"0x5\r\nhello\r\n0\r\n\r\n",  # chunk size is HEXDIG only
        _CH + b"+5\r\nhello\r\n0\r\n\r\n",
        _CH + b" 5\r\nhello\r\n0\r\n\r\n",
        _H + b"Bad Name: x\r\nContent-Length: 2\r\n\r\n{}",  # a header name is a token
        _H + b"Content-Length: 2\r\nContent-Length: 2\r\n\r\n{}",  # one Content-Length
        _H + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",  # not both framings
        _H + b"X-A: a\r\n b\r\nContent-Length: 2\r\n\r\n{}",  # no obs-fold
    ],
    ids=["chunk-0x", "chunk-plus", "chunk-space", "header-space", "two-lengths", "both-framings", "obs-fold"],
)
async def test_an_invalid_upstream_response_is_a_502(event_log, gw, raw):
    """RFC 9112, strictly (issue 20): what llhttp refuses reaches the client as a 502 naming it."""
    up = await RawUpstream(lambda n: [raw]).start()
    try:
        await _point_at(event_log, gw, up.url)
        body = json.dumps({"model": MODEL, "messages": CHAT}).encode()
        status, data, _ = await post_raw(gw.url + "/v1/chat/completions", body)
        assert status == 502, data
        error = json.loads(data)["error"]
        assert error["code"] == "upstream_unreachable" and "malformed response" in error["message"], error
    finally:
        await up.stop()


async def test_expect_100_continue_is_answered(gw, two_domains):
    """curl sends `Expect: 100-continue` for bodies over 1 KiB and waits a second for the go-ahead."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 2000}]}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.5)
        assert interim.startswith(b"HTTP/1.1 100 Continue")
        writer.write(body)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
    finally:
        writer.close()


async def test_a_slow_reader_slows_the_upstream_instead_of_filling_memory(gw, two_domains):
    _, a, _ = two_domains
    body = json.dumps({"model": MODEL, "messages": CHAT, "stream": True, "blob_mib": 96}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        await wait_until(lambda: a.written > 0, 5.0, interval_s=0.005)
        await asyncio.sleep(1.0)  # the client reads nothing meanwhile
        stalled = a.written
        # what is in flight is bounded by socket buffers and the gateway's high-water mark, not 96 MiB
        assert stalled < 48 * 2**20, stalled
        total = 0
        while chunk := await reader.read(2**20):
            total += len(chunk)
            if total > 96 * 2**20:
                break
        assert a.written == 96 * 2**20 and a.completed == 1
    finally:
        writer.close()


@pytest.mark.timeout(90)
async def test_routing_survives_a_nats_restart(event_log, nats_server, gw, two_domains):
    fleet, a, b = two_domains
    nats_server.kill()
    # NATS is gone: requests are still routed from memory, and the view is served stale
    status, data, _ = await post_raw(
        gw.url + "/v1/chat/completions", json.dumps({"model": MODEL, "messages": CHAT}).encode()
    )
    assert status == 200 and b"[domain a]" in data
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/v1/fleets/default") as r:
            assert r.status == 200 and r.headers.get("X-Haru-Stale") == "true"
    from haru.host.natsd import NatsServer

    again = NatsServer(nats_server.store_dir, port=nats_server.port)
    again.start_sync()
    try:
        deadline = time.monotonic() + 30
        while True:  # the test's own client reconnects too
            try:
                await fleet.log.publish_intent(
                    "default",
                    view_encoder.encode(intent_of("default", "b", b.url, revision=9)),
                    expect=fleet.intent_seq,
                )
                break
            except Exception:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
        await wait_until(lambda: gw.table.get("default").active == "b", 10, interval_s=0.005)  # resync: every 2 s
        status, data, _ = await post_raw(
            gw.url + "/v1/chat/completions", json.dumps({"model": MODEL, "messages": CHAT}).encode()
        )
        assert status == 200 and b"[domain b]" in data
    finally:
        again.stop_sync()


async def test_a_watch_that_stops_delivering_is_caught_up_and_restarted(event_log, upstreams):
    a, b = await upstreams("a"), await upstreams("b")
    async with running_gateway(event_log, resync_ms=200) as gw:
        fleet = Fleet(event_log, gw)
        await fleet.put_view(view_of("default", {"a": a.url, "b": b.url}, active="a"))
        await fleet.publish(intent_of("default", "a", a.url, revision=1))
        gw.follower._tasks[1].cancel()  # the intent watch dies quietly, as a stalled consumer would
        await asyncio.sleep(0.05)
        fleet.intent_seq = await event_log.publish_intent(
            "default", view_encoder.encode(intent_of("default", "b", b.url, revision=5)), expect=fleet.intent_seq
        )
        await wait_until(lambda: gw.table.get("default").active == "b", 5.0, interval_s=0.005)
        await wait_until(lambda: gw.follower.restarts == 1, 5.0, interval_s=0.005)  # and the watch restarted
        fleet.intent_seq = await event_log.publish_intent(
            "default", view_encoder.encode(intent_of("default", "a", a.url, revision=6)), expect=fleet.intent_seq
        )
        await wait_until(lambda: gw.table.get("default").active == "a", 5.0, interval_s=0.005)
        assert gw.follower.restarts == 1
