"""The control API on a fleet declared with `haru apply`'s code and projected by the real projector:
promote/demote with Haru's codes (request_operation), history newest first, and routing that
follows residency events as the projector folds them."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

from haru.core import subjects
from haru.core.events import ModelLoading, ModelLost, ModelResident
from haru.gateway import Forward, Gateway
from tests.support.control import MODEL, call
from tests.support.wait import wait_until


def code_now(gw: Gateway) -> str:
    """The error code the gateway would answer for MODEL right now ('' = it would forward)."""
    result = gw.table.resolve("ops", MODEL, time.time())
    return "" if isinstance(result, Forward) else result.code


async def chat(gw: Gateway) -> tuple[int, dict]:
    return await call(
        gw,
        "POST",
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": []}).encode(),
        **{"X-Haru-Fleet": "ops"},
    )


async def test_routing_follows_residency_as_the_projector_folds_it(ops):
    gw, log = ops
    status, body = await chat(gw)
    assert status == 503 and body["error"]["code"] == "residency_unknown"  # never probed
    subject = subjects.model("ops", "a", MODEL)
    now = datetime.now(UTC)
    seq = await log.append(subject, ModelLoading(at=now, domain="a", model=MODEL), expect=0)
    await wait_until(lambda: code_now(gw) == "model_warming", 10.0, interval_s=0.01)
    status, body = await chat(gw)
    assert status == 503 and body["error"]["code"] == "model_warming"
    seq = await log.append(subject, ModelResident(at=now, domain="a", model=MODEL, warmup_ms=5), expect=seq)
    await wait_until(lambda: code_now(gw) == "", 10.0, interval_s=0.01)
    status, body = await chat(gw)
    assert status == 200 and body["choices"][0]["message"]["content"] == "[domain a]"
    await log.append(subject, ModelLost(at=now, domain="a", model=MODEL, reason="gpu_detached"), expect=seq)
    await wait_until(lambda: code_now(gw) == "gpu_detached", 10.0, interval_s=0.01)
    status, body = await chat(gw)
    assert status == 503 and "not the operator's doing" in body["error"]["message"]


async def test_promote_and_demote_with_harus_codes(ops):
    gw, _ = ops
    post = lambda path, body: call(gw, "POST", f"/v1/fleets/ops/{path}", json.dumps(body).encode())  # noqa: E731
    status, body = await post("promote", {"domain": "a"})
    assert status == 200 and body["status"] == "noop" and body["target"] == "a"
    status, body = await post("demote", {"targetDomainId": "a"})  # Haru's field name
    assert status == 409 and body["status"] == "refused" and "active" in body["message"]
    status, body = await post("promote", {"domain": "zzz"})
    assert status == 404 and body["status"] == "not_found"
    status, accepted = await post("promote", {"domain": "b"})
    assert status == 202 and accepted["status"] == "accepted" and accepted["op_id"]
    assert accepted["kind"] == "promotion" and accepted["fleet"] == "ops"
    status, joined = await post("promote", {"targetDomainId": "b"})
    assert status == 202 and joined["status"] == "joined" and joined["op_id"] == accepted["op_id"]
    status, conflict = await post("demote", {"domain": "b"})
    assert status == 409 and conflict["status"] == "conflict" and conflict["op_id"] == accepted["op_id"]
    status, body = await post("promote", {})
    assert status == 400 and "`$.domain`" in body["error"]["message"]
    status, body = await call(gw, "POST", "/v1/fleets/ops/promote", b"{nope")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = await post("promote", {"domain": 3})
    assert status == 400 and "Expected `str | null`, got `int` - at `$.domain`" in body["error"]["message"]
    status, body = await call(gw, "GET", "/v1/fleets/ops/promote")
    assert status == 405

    # the request is history now, newest first
    status, hist = await call(gw, "GET", "/v1/fleets/ops/history?limit=2")
    assert status == 200 and hist["count"] == 2
    first = hist["events"][0]
    assert first["type"] == "promotion_requested" and first["payload"]["target"] == "b"
    assert first["payload"]["op_id"] == accepted["op_id"] and first["subject"] == "haru.evt.ops.op"
    assert first["by"].startswith("gateway:")
    assert hist["events"][0]["seq"] > hist["events"][1]["seq"]


async def test_history_filters(ops):
    gw, log = ops
    now = datetime.now(UTC)
    await log.append(subjects.model("ops", "a", MODEL), ModelLoading(at=now, domain="a", model=MODEL), expect=0)
    await log.append(
        subjects.model("ops", "b", MODEL), ModelLoading(at=now, domain="b", model=MODEL, attempt=2), expect=0
    )
    status, hist = await call(gw, "GET", f"/v1/fleets/ops/history?model={MODEL}&domain=b")
    assert status == 200 and [e["type"] for e in hist["events"]] == ["model_loading"]
    assert hist["events"][0]["payload"]["attempt"] == 2 and hist["events"][0]["subject"].endswith("qwen3~2e6~3a27b")
    status, hist = await call(gw, "GET", f"/v1/fleets/ops/history?model={MODEL}")
    assert [e["payload"]["domain"] for e in hist["events"]] == ["b", "a"]
    status, hist = await call(gw, "GET", "/v1/fleets/ops/history?domain=a")
    assert {e["subject"] for e in hist["events"]} == {subjects.model("ops", "a", MODEL)}
    status, hist = await call(gw, "GET", "/v1/fleets/ops/history")
    types = [e["type"] for e in hist["events"]]
    assert types[-1] == "fleet_declared" and "route_moved" in types and "model_declared" in types
    times = [e["time"] for e in hist["events"]]
    assert times == sorted(times, reverse=True)
    assert all(e["misplaced"] is None for e in hist["events"])
    # A residency event naming another domain than its subject: listed, and said to be misplaced.
    await log.append(
        subjects.model("ops", "a", MODEL),
        ModelLoading(at=now, domain="b", model=MODEL),
        expect=await log.last_seq_of(subjects.model("ops", "a", MODEL)),
    )
    status, hist = await call(gw, "GET", "/v1/fleets/ops/history?domain=a&limit=1")
    assert hist["events"][0]["misplaced"] == "its body says domain 'b', its subject says 'a'"
    status, err = await call(gw, "GET", "/v1/fleets/ops/history?limit=0")
    assert status == 400 and err["error"]["param"] == "limit"
    status, err = await call(gw, "GET", "/v1/fleets/ops/history?domain=Nope!")
    assert status == 400
    status, err = await call(gw, "GET", "/v1/fleets/ghost/history")
    assert status == 404 and err["error"]["code"] == "fleet_not_found"


async def test_view_and_intent_come_from_the_projector(ops):
    gw, _ = ops
    status, view = await call(gw, "GET", "/v1/fleets/ops")
    assert status == 200 and view["active"] == "a" and set(view["domains"]) == {"a", "b"}
    status, intent = await call(gw, "GET", "/v1/fleets/ops/route-intent")
    assert status == 200 and intent["active"]["domain"] == "a" and MODEL in intent["answers"]
    status, models = await call(gw, "GET", "/v1/models", **{"X-Haru-Fleet": "ops"})
    assert status == 200 and models["data"][0]["id"] == MODEL
    assert models["data"][0]["haru"]["declared_on"] == ["a", "b"]


async def test_a_fleet_has_a_stable_uuid_accepted_wherever_its_name_is(ops):
    """Haru's API took "slug or UUID": the fleet's UUID is derived from its name (or declared in the
    layout), recorded with its declaration, and every control route takes it."""
    from haru.core.specs import fleet_uuid

    gw, _ = ops
    fid = fleet_uuid("ops")
    status, view = await call(gw, "GET", f"/v1/fleets/{fid}")
    assert status == 200 and view["fleet"] == "ops" and view["uuid"] == fid
    status, intent = await call(gw, "GET", f"/v1/fleets/{fid.upper()}/route-intent")
    assert status == 200 and intent["fleet"] == "ops"
    status, hist = await call(gw, "GET", f"/v1/fleets/{fid}/history?limit=1")
    assert status == 200 and hist["fleet"] == "ops"
    status, models = await call(gw, "GET", "/v1/models", **{"X-Haru-Fleet": fid})
    assert status == 200 and models["data"][0]["id"] == MODEL
    status, listed = await call(gw, "GET", "/v1/fleets")
    assert [f["uuid"] for f in listed["data"] if f["fleet"] == "ops"] == [fid]
    chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    by_name = await call(gw, "POST", "/v1/chat/completions", chat, **{"X-Haru-Fleet": "ops"})
    by_uuid = await call(gw, "POST", "/v1/chat/completions", chat, **{"X-Haru-Fleet": fid})
    assert by_uuid[0] != 404 and by_uuid[0] == by_name[0]  # chat takes the UUID too: the same answer as by name
    assert by_uuid[1].get("error", {}).get("code") == by_name[1].get("error", {}).get("code")
    status, body = await call(gw, "POST", f"/v1/fleets/{fid}/promote", json.dumps({"domain": "a"}).encode())
    assert status == 200, body  # a is already active: Haru's 200 no-op
    status, body = await call(gw, "GET", "/v1/fleets/00000000-0000-4000-8000-000000000000")
    assert status == 404 and body["error"]["code"] == "fleet_not_found"


async def test_reconcile_answers_with_what_the_continuous_promoter_decided(ops):
    gw, log = ops
    status, body = await call(gw, "POST", "/v1/fleets/ops/reconcile")
    assert status == 200, body
    assert body["reconciled_by"] == "promoter" and "ran nothing" in body["note"]
    assert body["active"] == "a" and body["operation"] is None and body["declined"] is None
    from haru.core.events import FailoverDeclined

    seq = await log.append(
        subjects.op("ops"),
        FailoverDeclined(
            at=datetime.now(UTC), domain="a", candidate="b", why="a unreachable; standby b is unreachable"
        ),
        expect=(await log.last(subjects.op("ops"))).seq if await log.last(subjects.op("ops")) else 0,
    )
    # the projector folds it, then the gateway's watch sees the view: slow on a busy box
    await wait_until(
        lambda: (r := gw.table.get("ops")) is not None and r.view is not None and r.view.seq >= seq, 30, interval_s=0.01
    )
    status, body = await call(gw, "POST", "/v1/fleets/ops/reconcile")
    assert status == 200 and body["declined"]["why"].startswith("a unreachable") and body["declined"]["at"]
    status, body = await call(gw, "GET", "/v1/fleets/ops/reconcile")
    assert status == 405
    status, body = await call(gw, "POST", "/v1/fleets/nope/reconcile")
    assert status == 404 and body["error"]["code"] == "fleet_not_found"
