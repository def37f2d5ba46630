"""Asking for traffic weights with bad input, through the control API and the CLI: each answer names
what is wrong and the fix (a real nats-server, the real projector and gateway: test_gateway_control's
`ops` fleet, a active, b declared)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from haru.core import subjects
from haru.core.events import DomainReachable, ModelSleeping
from tests.support import haru
from tests.support.control import MODEL, call

pytestmark = pytest.mark.timeout(120)


async def test_the_control_api_refuses_bad_weights_with_the_fix_and_accepts_good_ones(ops):
    gw, log = ops

    async def post(body) -> tuple[int, dict]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await call(gw, "POST", "/v1/fleets/ops/weights", raw)

    bad = [
        ({"weights": {"z": 10}}, "no domain 'z' in this fleet (declared: a, b)"),
        ({"weights": {"a": 80, "b": 10}}, "weights add up to 90"),
        ({"weights": {"b": 100}}, "promote the other domain (haru promote b)"),
        ({"weights": {"b": -5}}, "between 0 and 100"),
        ({"weights": {"b": 10}, "model": "nope"}, "model 'nope' is not declared on the active domain 'a'"),
        ({}, "no weights given"),
        ({"weights": {"b": 10}, "reset": True}, "not both"),
        ({"weights": {"b": "ten"}}, "Expected `int`, got `str` - at `$.weights[...]`"),
        (b"{nope", "not valid JSON"),
    ]
    for body, says in bad:
        status, got = await post(body)
        assert status == 400, (body, status, got)
        assert says in got["error"]["message"], (body, got)
    status, got = await post({"reset": True})
    assert status == 200 and got["status"] == "noop"
    status, got = await post({"weights": {"b": 10}})  # b's agent was never heard from
    assert status == 409 and got["status"] == "refused" and "has not been heard from yet" in got["message"]
    status, _ = await call(gw, "GET", "/v1/fleets/ops/weights")
    assert status == 405

    now = datetime.now(UTC)
    await log.append(subjects.liveness("ops", "b"), DomainReachable(at=now, domain="b"), expect=0)
    await log.append(subjects.model("ops", "b", MODEL), ModelSleeping(at=now, domain="b", model=MODEL), expect=0)
    status, accepted = await post({"weights": {"b": 10}})
    assert status == 202 and accepted["status"] == "accepted" and accepted["kind"] == "weighting", accepted
    assert "b is woken and probed first" in accepted["message"]
    status, joined = await post({"weights": {"b": 10}})
    assert status == 202 and joined["status"] == "joined" and joined["op_id"] == accepted["op_id"]
    status, conflict = await post({"weights": {"b": 20}})
    assert status == 409 and conflict["status"] == "conflict"


async def test_the_cli_says_what_is_wrong_with_weights(ops, nats_server):
    def route(*args: str):
        return haru("route", "weight", *args, "--fleet", "ops", nats_url=nats_server.url)

    p = route("b=ten")
    assert p.returncode == 2 and "'ten' is not a whole percent; write it like b=10" in p.stderr
    p = route("z=10")
    assert p.returncode == 2 and "no domain 'z' in this fleet" in p.stderr
    p = route("b=60", "a=60")
    assert p.returncode == 2 and "weights add up to 120" in p.stderr
    p = route("b=10")
    assert p.returncode == 1 and "has not been heard from yet" in p.stderr
    p = route("--reset", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["status"] == "noop"
    p = haru("route", "--reset", "--fleet", "ops", nats_url=nats_server.url)
    assert p.returncode == 2 and "go with `haru route weight`" in p.stderr
