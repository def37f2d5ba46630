"""The control API's provisioning requests: POST /v1/fleets/{fleet}/provision|teardown|replace, behind the
API token like every write; dry_run answers with the YAML from the fleet's declarations and requests
nothing; a real request is an operation on the op subject, judged like the CLI's."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import aiohttp
import yaml

from haru.core import subjects
from haru.core.events import ProvisionRequested, TeardownRequested
from haru.core.layout import load_layout
from haru.gateway import Gateway, GatewayConfig
from haru.log.apply import apply
from tests.support.provision import EXAMPLE
from tests.support.wait import wait_until

TOKEN = "s3cret-token"


async def post(gw: Gateway, path: str, body: dict, token: str | None = TOKEN) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + path, data=json.dumps(body), headers=headers) as r:
            return r.status, await r.json(content_type=None)


async def test_provisioning_through_the_control_api(event_log):
    await apply(event_log, load_layout(EXAMPLE), datetime.now(UTC))
    async with Gateway(GatewayConfig(port=0, api_token=TOKEN), event_log) as gw:
        status, body = await post(gw, "/v1/fleets/cloud/provision", {"domain": "a", "dry_run": True}, token=None)
        assert status == 401

        status, body = await post(gw, "/v1/fleets/cloud/provision", {"domain": "a", "dry_run": True})
        assert status == 200, body
        assert body["provider"] == "skypilot" and body["dry_run"] is True
        task = yaml.safe_load(body["submit"].partition("\n")[2])
        assert task["name"] == "haru-cloud-a" and task["resources"]["use_spot"] is True
        status, body = await post(gw, "/v1/fleets/cloud/teardown", {"domain": "b", "dry_run": True})
        assert status == 200 and "sky serve down --yes haru-cloud-b" in body["submit"]
        status, body = await post(gw, "/v1/fleets/cloud/provision", {"domain": "zz", "dry_run": True})
        assert status == 404 and "declared: a, b" in body["error"]["message"]
        assert [r for r in await event_log.history(subjects.op("cloud"))] == []  # dry runs request nothing

        status, body = await post(gw, "/v1/fleets/cloud/provision", {"domain": "a"})
        assert status == 202 and body["status"] == "accepted" and body["kind"] == "provision", body
        status, again = await post(gw, "/v1/fleets/cloud/provision", {"domain": "a"})
        assert status == 202 and again["status"] == "joined" and again["op_id"] == body["op_id"]
        status, other = await post(gw, "/v1/fleets/cloud/teardown", {"domain": "b"})
        assert status == 409 and other["status"] == "conflict"
        (rec,) = await event_log.history(subjects.op("cloud"))
        assert isinstance(rec.event, ProvisionRequested) and rec.event.target == "a"
        assert not isinstance(rec.event, TeardownRequested)


async def test_a_failed_teardown_is_reported_retried_and_finished_by_the_promoter(tmp_path, nats_server, event_log):
    """`sky down` fails once: the operation aborts with the error (the cluster may still be billed), the
    promoter asks for the teardown again after its backoff, and the second one takes the cluster down."""
    from haru.core.events import OperationAborted, OperationCompleted
    from haru.core.layout import parse_layout
    from haru.log.requests import request_operation
    from tests.support.fake_sky import FakeSky
    from tests.support.promoter import op_events, promoters

    doc = json.loads(EXAMPLE.read_text())
    doc["policy"] = {"heartbeat_timeout_ms": 500, "degraded_grace_ms": 500}
    await apply(event_log, parse_layout(doc), datetime.now(UTC))
    fake = FakeSky(tmp_path / "sky")
    fake.add_cluster("haru-cloud-a", "UP", region="us-west-2")
    fake.script(down_script=["fail"])
    async with promoters(nats_server.url, fleets=["cloud"], sky=str(fake.path)):
        first = await request_operation(event_log, "cloud", "teardown", "a", by="test", now=datetime.now(UTC))
        assert first.status == "accepted"

        async def teardowns():
            events = await op_events(event_log, "cloud")
            ends = [e for e in events if isinstance(e, (OperationAborted, OperationCompleted))]
            return events if len(ends) >= 2 else None

        events = await wait_until(teardowns, 30, what="the teardown, then its retry")
    aborted = next(e for e in events if isinstance(e, OperationAborted))
    assert aborted.op_id == first.op_id and "may still be running" in aborted.error
    retry = [e for e in events if isinstance(e, TeardownRequested) and e.op_id != first.op_id]
    assert len(retry) == 1 and retry[0].reason == "teardown_failed" and retry[0].target == "a"
    assert any(isinstance(e, OperationCompleted) and e.op_id == retry[0].op_id for e in events)
    assert fake.state()["clusters"] == {} and fake.commands().count("down") == 2
    # what the cluster cost, as SkyPilot's cost report said it, is on the down step: the accounting's price
    from haru.core.events import ClusterCost, StepCompleted

    (down,) = [e for e in events if isinstance(e, StepCompleted) and e.step == "down" and e.op_id == retry[0].op_id]
    assert down.costs == [ClusterCost(cluster="haru-cloud-a", total="1.25", seconds=3600.0)]
