"""Traffic weights through the real gateway: route intents published on a real nats-server, chat
requests on real sockets to simulated upstreams, the split counted by what each upstream received;
and the gateway's canary reports on haru.canary.<fleet>.<gateway>."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import aiohttp
import pytest
from aiohttp import web

from haru.core import subjects
from haru.core.residency import Answer
from haru.core.views import RouteIntent, Target, Weighted
from haru.core.weights import report_decoder
from tests.support.gateway import MODEL, SMALL, Fleet, Upstream, intent_of, running_gateway, view_of
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(120)
N = 2000


def split_intent(urls: dict[str, str], *, weights=None, model_weights=None, revision: int = 2) -> RouteIntent:
    ready = {m: Answer(answer="ready") for m in (MODEL, SMALL)}
    base = intent_of("default", "a", urls["a"], revision=revision)
    weighted = {
        d: Weighted(target=Target(domain=d, serving_url=u, reachable=True), answers=ready)
        for d, u in urls.items()
        if d != "a"
    }
    return RouteIntent(
        fleet="default",
        revision=revision,
        active=base.active,
        answers=base.answers,
        weights=weights or {},
        model_weights=model_weights or {},
        weighted=weighted,
    )


async def send(gw, model: str, n: int, *, concurrency: int = 16) -> Counter:
    """n chat requests through the gateway; the domain that answered each (X-Haru-Domain), counted."""
    got: Counter = Counter()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                async with session.post(
                    gw.url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
                ) as r:
                    await r.read()
                    got[(r.status, r.headers.get("X-Haru-Domain", ""))] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return got


def within_5_percent(counts: dict[str, int], weights: dict[str, int], n: int) -> None:
    for d, w in weights.items():
        share = 100 * counts.get(d, 0) / n
        print(f"{d}: {counts.get(d, 0)} of {n} = {share:.2f}% (weight {w}%)")
        assert abs(share - w) <= 5, (d, share, w)


async def test_2000_requests_follow_the_fleet_weights_within_5_percent(event_log, gw, upstreams):
    ups = {d: await upstreams(d) for d in ("a", "b")}
    urls = {d: u.url for d, u in ups.items()}
    fleet = Fleet(event_log, gw)
    await fleet.put_view(view_of("default", urls, active="a", seq=1))
    await fleet.publish(split_intent(urls, weights={"a": 70, "b": 30}))
    got = await send(gw, MODEL, N)
    assert set(got) <= {(200, "a"), (200, "b")}, got
    received = {d: len(u.received) for d, u in ups.items()}
    within_5_percent(received, {"a": 70, "b": 30}, N)
    assert received == {"a": 1400, "b": 600}  # smooth weighted round robin: exact over whole cycles


async def test_three_domains_and_a_model_split_within_5_percent(event_log, gw, upstreams):
    ups = {d: await upstreams(d) for d in ("a", "b", "c")}
    urls = {d: u.url for d, u in ups.items()}
    fleet = Fleet(event_log, gw)
    await fleet.put_view(view_of("default", urls, active="a", seq=1))
    split = {"a": 60, "b": 30, "c": 10}
    await fleet.publish(split_intent(urls, model_weights={MODEL: split}))
    got = await send(gw, MODEL, N)
    within_5_percent({d: got[(200, d)] for d in split}, split, N)
    other = await send(gw, SMALL, 50)
    assert other == Counter({(200, "a"): 50})  # the split is MODEL's alone


async def test_a_share_on_a_domain_that_is_not_ready_stays_with_the_active(event_log, gw, upstreams):
    ups = {d: await upstreams(d) for d in ("a", "b")}
    urls = {d: u.url for d, u in ups.items()}
    fleet = Fleet(event_log, gw)
    await fleet.put_view(view_of("default", urls, active="a", seq=1))
    ri = split_intent(urls, weights={"a": 50, "b": 50})
    asleep = {m: Answer(answer="asleep") for m in (MODEL, SMALL)}
    ri = RouteIntent(
        fleet=ri.fleet,
        revision=ri.revision,
        active=ri.active,
        answers=ri.answers,
        weights=ri.weights,
        weighted={"b": Weighted(target=ri.weighted["b"].target, answers=asleep)},
    )
    await fleet.publish(ri)
    assert await send(gw, MODEL, 40) == Counter({(200, "a"): 40})


class Failing(Upstream):
    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        await request.read()
        return web.Response(body=b'{"error":{"message":"boom"}}', status=500, content_type="application/json")


async def test_the_gateway_reports_what_it_measured_of_a_split_fleet_on_its_own_subject(event_log, upstreams):
    a = await upstreams("a")
    b = await Failing("b").start()
    reports: list[tuple[str, bytes]] = []
    sub = await event_log.bus.subscribe(subjects.ALL_CANARY_REPORTS, lambda m: reports.append((m.subject, m.data)))
    try:
        async with running_gateway(event_log, canary_report_ms=100) as gw:
            urls = {"a": a.url, "b": b.url}
            fleet = Fleet(event_log, gw)
            await fleet.put_view(view_of("default", urls, active="a", seq=1))
            await fleet.publish(split_intent(urls, weights={"a": 80, "b": 20}))
            got = await send(gw, MODEL, 100, concurrency=4)
            assert got == Counter({(200, "a"): 80, (500, "b"): 20})
            await wait_until(
                lambda: sum(c.requests for _, d in reports for c in report_decoder.decode(d).counts) >= 100,
                5,
                interval_s=0.005,
            )
            subject = reports[0][0]
            assert subject == subjects.canary_report("default", gw.gateway_id())
            counts = [c for _, d in reports for c in report_decoder.decode(d).counts]
            by_domain = {
                d: (sum(c.requests for c in counts if c.domain == d), sum(c.errors for c in counts if c.domain == d))
                for d in ("a", "b")
            }
            assert by_domain == {"a": (80, 0), "b": (20, 20)}
            assert any(c.last_error == "HTTP 500" for c in counts if c.domain == "b")
            # back to the default: nothing more is reported
            await fleet.publish(intent_of("default", "a", a.url, revision=3))
            await send(gw, MODEL, 10, concurrency=2)
            before = len(reports)
            await asyncio.sleep(0.4)
            assert len(reports) == before
    finally:
        await sub.unsubscribe()
        await b.stop()
