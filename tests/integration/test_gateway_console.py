"""The console's endpoints on a real gateway, projector and nats-server: the event stream delivers
every fleet at once and each change after, many consoles share one fan-out, the token is required for
data but not for the page, and the console API folds operations and tells a model's story."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import aiohttp
import pytest

from haru.core import subjects
from haru.core.events import AgentStarted, FailureSignalled, ModelLoading, ModelResident, PriceDeclared, RouteMoved
from haru.core.prices import Price
from haru.gateway import Gateway, GatewayConfig
from haru.host.tasks import cancel_and_wait
from haru.log.apply import apply
from haru.projections.projector import Projector
from tests.support.control import MODEL, echo_upstream, layout
from tests.support.wait import wait_until

TOKEN = "console-token"


@pytest.fixture
async def fleet(event_log):
    ra, url_a = await echo_upstream("a")
    rb, url_b = await echo_upstream("b")
    now = datetime.now(UTC)
    await apply(event_log, layout(url_a, url_b), now)
    await event_log.append(subjects.route("ops"), RouteMoved(at=now, active="a"), expect=0)
    projector = asyncio.create_task(Projector(event_log).run())
    try:
        async with Gateway(GatewayConfig(host="127.0.0.1", port=0, api_token=TOKEN), event_log) as gw:
            # The route subject may reach the gateway before the projector's view of it: wait for both, since the
            # tests read the view's residency from the first snapshot a console is sent.
            await wait_until(
                lambda: (r := gw.table.get("ops")) is not None and r.active == "a" and r.view is not None,
                10.0,
                interval_s=0.01,
            )
            yield gw, event_log
    finally:
        await cancel_and_wait(projector)
        await ra.cleanup()
        await rb.cleanup()


AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def frames(resp: aiohttp.ClientResponse, wanted, timeout: float = 10.0) -> list[tuple[str, dict]]:
    """Read SSE blocks until `wanted(list)` holds; returns [(event, data)]."""
    got: list[tuple[str, dict]] = []
    buf = b""
    async with asyncio.timeout(timeout):
        while not wanted(got):
            buf += await resp.content.readany()
            while b"\n\n" in buf:
                block, buf = buf.split(b"\n\n", 1)
                event, data = "message", b""
                for line in block.split(b"\n"):
                    if line.startswith(b"event: "):
                        event = line[7:].decode()
                    elif line.startswith(b"data: "):
                        data += line[6:]
                if data:
                    got.append((event, json.loads(data)))
    return got


def residency_of(snapshot: dict, domain: str) -> str:
    return snapshot["view"]["domains"][domain]["models"][MODEL]["residency"]["state"]


async def test_the_stream_sends_every_fleet_then_each_change_to_every_console(fleet):
    gw, log = fleet
    async with aiohttp.ClientSession() as s:
        streams = [await s.get(gw.url + "/ui/events", headers=AUTH) for _ in range(5)]
        try:
            for r in streams:
                assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
                first = await frames(r, lambda g: any(e == "fleet" for e, _ in g))
                assert first[0][0] == "hello" and first[0][1]["flows"]["promotion"][-2:] == [
                    "flip",
                    "settle_old_active",
                ]
                snap = [d for e, d in first if e == "fleet"][0]
                assert snap["fleet"] == "ops" and snap["active"] == "a" and residency_of(snap, "a") == "unknown"
            assert len(gw.console.subscribers) == 5

            now = datetime.now(UTC)
            subject = subjects.model("ops", "a", MODEL)
            seq = await log.append(subject, ModelLoading(at=now, domain="a", model=MODEL), expect=0)
            await log.append(subject, ModelResident(at=now, domain="a", model=MODEL, warmup_ms=7), expect=seq)
            for r in streams:
                got = await frames(r, lambda g: any(e == "fleet" and residency_of(d, "a") == "resident" for e, d in g))
                resident = [d for e, d in got if e == "fleet" and residency_of(d, "a") == "resident"][0]
                assert resident["view"]["domains"]["a"]["models"][MODEL]["residency"]["warmup_ms"] == 7
        finally:
            for r in streams:
                r.close()
    await wait_until(lambda: not gw.console.subscribers, 10.0, interval_s=0.01)  # closed streams leave the fan-out


async def test_the_page_is_public_its_data_needs_the_token(fleet):
    gw, _ = fleet
    async with aiohttp.ClientSession() as s:
        for path, ctype in (("/ui", "text/html"), ("/ui/app.js", "text/javascript"), ("/ui/app.css", "text/css")):
            async with s.get(gw.url + path) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith(ctype), path
                assert "default-src 'self'" in r.headers["Content-Security-Policy"]
        for path in (
            "/ui/events",
            "/ui/api/operations?fleet=ops",
            f"/ui/api/why?fleet=ops&model={MODEL}",
            "/ui/api/verify?fleet=ops",
        ):
            async with s.get(gw.url + path) as r:
                assert r.status == 401, path
                assert (await r.json())["error"]["code"] == "invalid_api_key"
        async with s.get(gw.url + "/ui/api/nope", headers=AUTH) as r:
            assert r.status == 404
        async with s.head(gw.url + "/ui/events", headers=AUTH) as r:
            assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
        async with s.post(gw.url + "/ui/events", headers=AUTH) as r:
            assert r.status == 405
        async with s.get(gw.url + "/ui/api/operations?fleet=No.Such", headers=AUTH) as r:
            body = await r.json()
            assert r.status == 400 and body["error"]["param"] == "fleet"
        async with s.get(gw.url + "/ui/api/why?fleet=ops", headers=AUTH) as r:
            assert r.status == 400 and "model is required" in (await r.json())["error"]["message"]


async def test_operations_why_and_verify(fleet):
    gw, log = fleet
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/fleets/ops/promote", headers=AUTH, json={"domain": "b"}) as r:
            assert r.status == 202
            op_id = (await r.json())["op_id"]
        async with s.get(gw.url + "/ui/api/operations?fleet=ops", headers=AUTH) as r:
            ops = (await r.json())["operations"]
        assert [o["op_id"] for o in ops] == [op_id]
        assert ops[0]["kind"] == "promotion" and ops[0]["target"] == "b" and ops[0]["state"] == "running"

        subject = subjects.model("ops", "a", MODEL)
        now = datetime.now(UTC)
        # The story is causal: the loading names the request as its cause (as an agent's events name
        # the step of the command they answer), so the request is in the model's story.
        request = await log.last(subjects.op("ops"))
        seq = await log.append(subject, ModelLoading(at=now, domain="a", model=MODEL, cause=request.seq), expect=0)
        async with s.get(gw.url + f"/ui/api/why?fleet=ops&model={MODEL}", headers=AUTH) as r:
            story = (await r.json())["events"]
        seqs = [e["seq"] for e in story]
        assert seqs == sorted(seqs, reverse=True) and story[0]["seq"] == seq and story[0]["type"] == "model_loading"
        assert "promotion_requested" in [e["type"] for e in story]
        async with s.get(gw.url + "/ui/api/verify?fleet=ops", headers=AUTH) as r:
            verdict = await r.json()
        assert verdict["ok"] is True and "history intact" in verdict["summary"] and verdict["events"] >= 5


@pytest.mark.timeout(120)
async def test_the_page_says_when_it_is_disconnected_and_reconnects_by_itself(fleet, tmp_path):
    """The second (and last) browser test: the gateway goes away under an open console and comes back."""
    from tests.support.chromium import CHROMIUM, CHROMIUM_ARGS, need_chromium

    need_chromium()
    from playwright.async_api import async_playwright, expect

    gw, log = fleet
    port = gw.port
    # a price for a (b has none): the cost panel draws both, and says b's hours are unpriced
    decl = subjects.decl("ops")
    price = PriceDeclared(at=datetime.now(UTC), domain="a", price=Price(per_hour="2.40", currency="USD"))
    await log.append(decl, price, expect=await log.last_seq_of(decl))
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 800})
            await page.goto(gw.url + f"/ui#token={TOKEN}")
            await expect(page.locator("#conn")).to_have_attribute("data-state", "live", timeout=30_000)
            await expect(page.locator('[data-testid="domain-a"] .badge.active')).to_be_visible(timeout=30_000)
            await page.evaluate("window.__notReloaded = true")
            # the cost panel: a stacked bar a domain (its models have said nothing yet: waking), the money beside
            await expect(page.locator('[data-testid="cost-a"] rect.seg-waking')).to_have_count(1, timeout=30_000)
            await expect(page.locator('[data-testid="cost-money-a"]')).to_contain_text("USD")
            await expect(page.locator('[data-testid="cost-money-b"]')).to_contain_text("unpriced")
            await expect(page.locator('[data-testid="cost-sums"]')).to_contain_text("some hours unpriced")
            await page.locator('[aria-label="cost"]').screenshot(path=str(tmp_path / "cost.png"))

            await gw.stop()  # the gateway goes away: the page says so, with the time
            await expect(page.locator("#conn")).to_have_attribute("data-state", "disconnected", timeout=30_000)
            await expect(page.locator("#conn")).to_contain_text("disconnected since")
            await page.screenshot(path=str(tmp_path / "disconnected.png"))

            # Something changes while it is away; a gateway comes back on the same address.
            now = datetime.now(UTC)
            subject = subjects.model("ops", "a", MODEL)
            seq = await log.append(subject, ModelLoading(at=now, domain="a", model=MODEL), expect=0)
            await log.append(subject, ModelResident(at=now, domain="a", model=MODEL, warmup_ms=3), expect=seq)
            async with Gateway(GatewayConfig(host="127.0.0.1", port=port, api_token=TOKEN), log):
                await expect(page.locator("#conn")).to_have_attribute("data-state", "live", timeout=30_000)
                await expect(page.locator(f'[data-testid="model-a-{MODEL}"]')).to_have_attribute(
                    "data-state", "resident", timeout=30_000
                )
                # a sign the domain is about to go shows on it while it lasts (until its agent starts again)
                agent = subjects.agent("ops", "a")
                signal = FailureSignalled(
                    at=datetime.now(UTC), domain="a", source="preemption_notice", detail="terminate in 120 s"
                )
                seq = await log.append(agent, signal, expect=0)
                badge = page.locator('[data-testid="signal-a"]')
                await expect(badge).to_contain_text("about to go", timeout=30_000)
                await expect(badge).to_contain_text("preemption_notice: terminate in 120 s")
                await expect(page.locator('[data-testid="signal-b"]')).to_have_count(0)
                await log.append(agent, AgentStarted(at=datetime.now(UTC), domain="a", host="gpu-a"), expect=seq)
                await expect(badge).to_have_count(0, timeout=30_000)
            assert await page.evaluate("window.__notReloaded") is True
        finally:
            await browser.close()
