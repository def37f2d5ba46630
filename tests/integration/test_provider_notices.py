"""A cloud's preemption notice read with the provider's own protocol (agents/notices.py), against local
metadata services that are as strict as the real ones (tests/support/fake_metadata.py): AWS's IMDSv2
token, GCP's `Metadata-Flavor` and long polls, Azure's Scheduled Events with their usually empty list."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from haru.agents.notices import (
    AwsNotices,
    AzureNotices,
    GcpNotices,
    aws_instance_action,
    aws_rebalance,
    azure_events,
    gcp_maintenance,
    gcp_preempted,
)
from haru.agents.signals import notice_from_url
from haru.core import subjects
from haru.core.errors import LayoutError
from haru.core.layout import parse_layout
from tests.support.agent_harness import is_, wait_event, write_config, write_layout
from tests.support.fake_metadata import AZURE_VM, FakeMetadata

pytestmark = pytest.mark.timeout(60)


def test_each_provider_answer_is_read_as_the_provider_documents_it():
    assert aws_instance_action(404, "<title>404 - Not Found</title>") == ""
    assert "terminate" in aws_instance_action(200, '{"action": "terminate", "time": "2026-12-06T06:02:00Z"}')
    assert aws_rebalance(404, "") == "" and "rebalance" in aws_rebalance(200, '{"noticeTime": "2026-12-06T06:00:00Z"}')
    assert gcp_preempted(200, "FALSE") == "" and gcp_preempted(200, "TRUE") != ""
    assert gcp_maintenance(200, "NONE") == "" and "TERMINATE" in gcp_maintenance(200, "TERMINATE_ON_HOST_MAINTENANCE")
    empty = '{"DocumentIncarnation": 1, "Events": []}'
    assert azure_events(200, empty, "vm") == ""
    assert notice_from_url(200, empty) != ""  # why Azure needs its own reader: the generic rule calls this a notice
    freeze = json.dumps({"Events": [{"EventType": "Freeze", "Resources": ["vm"], "EventId": "1"}]})
    assert azure_events(200, freeze, "vm") == ""  # a pause the host survives
    other = json.dumps({"Events": [{"EventType": "Preempt", "Resources": ["other-vm"], "EventId": "2"}]})
    assert azure_events(200, other, "vm") == ""  # another VM's eviction
    ours = json.dumps({"Events": [{"EventType": "Preempt", "Resources": ["vm"], "EventId": "3", "NotBefore": "t"}]})
    assert "Preempt 3" in azure_events(200, ours, "vm")
    assert azure_events(400, "", "vm") == azure_events(200, "not json", "vm") == ""


async def test_aws_reads_with_an_imdsv2_token_and_renews_an_expired_one():
    async with FakeMetadata("aws") as md, aiohttp.ClientSession() as s:
        notices = AwsNotices(md.endpoint)
        assert await notices.poll(s, 1.0) == ""
        # A plain GET is refused on this instance, as on any that requires IMDSv2:
        async with s.get(f"{md.endpoint}/latest/meta-data/spot/instance-action") as r:
            assert r.status == 401
        md.expire_tokens()
        md.announce()
        assert "AWS spot instance-action: terminate" in await notices.poll(s, 1.0)
        puts = [p for m, p, _ in md.requests if m == "PUT"]
        assert len(puts) == 2  # the first token, then one more after it expired
        md.withdraw()
        md.announce("rebalance")
        assert "rebalance recommendation" in await notices.poll(s, 1.0)


async def test_aws_without_a_token_api_is_read_the_imdsv1_way():
    async with FakeMetadata("aws", imdsv1=True) as md, aiohttp.ClientSession() as s:
        notices = AwsNotices(md.endpoint)
        assert await notices.poll(s, 1.0) == ""
        md.announce()
        assert "terminate" in await notices.poll(s, 1.0)


async def test_gcp_sends_its_header_and_long_polls_on_the_etag():
    async with FakeMetadata("gcp") as md, aiohttp.ClientSession() as s:
        notices = GcpNotices(md.endpoint)
        assert await notices.poll(s, 4.0) == ""  # the first read of each value, at once
        assert all(h.get("Metadata-Flavor") == "Google" for _, _, h in md.requests)
        poll = asyncio.create_task(notices.poll(s, 20.0))  # now a long poll: it waits for a change
        await asyncio.sleep(0.3)
        assert not poll.done()
        started = time.monotonic()
        md.announce()
        said = await asyncio.wait_for(poll, 10)
        assert "preempted: TRUE" in said and time.monotonic() - started < 5  # the change answered it
        assert any("wait_for_change=true" in p and "last_etag=" in p for _, p, _ in md.requests)
        md.withdraw()
        md.announce("maintenance")
        assert "TERMINATE_ON_HOST_MAINTENANCE" in await notices.poll(s, 4.0)


async def test_azure_counts_only_preempt_and_terminate_events_for_this_vm():
    async with FakeMetadata("azure") as md, aiohttp.ClientSession() as s:
        notices = AzureNotices(md.endpoint)
        assert await notices.poll(s, 1.0) == ""  # 200 with an empty Events list: no notice
        assert notices.vm_name == AZURE_VM
        assert all(h.get("Metadata") == "true" for _, _, h in md.requests)
        md.add_event("Freeze", [AZURE_VM])
        md.add_event("Preempt", ["another-vm"])
        assert await notices.poll(s, 1.0) == ""
        md.announce("Terminate")
        assert "Azure scheduled event Terminate" in await notices.poll(s, 1.0)


def test_a_notice_names_one_of_provider_url_and_command(tmp_path):
    layout = json.loads(write_layout(tmp_path / "layout.json", tmp_path).read_text())
    layout["domains"][0]["preemption_notice"] = {"provider": "aws", "command": ["true"]}
    with pytest.raises(LayoutError, match="exactly one of `provider`, `url` and `command`"):
        parse_layout(json.dumps(layout))
    layout["domains"][0]["preemption_notice"] = {"url": "http://x/notice", "endpoint": "http://127.0.0.1:1"}
    with pytest.raises(LayoutError, match="endpoint goes with `provider`"):
        parse_layout(json.dumps(layout))
    layout["domains"][0]["preemption_notice"] = {"provider": "oracle"}
    with pytest.raises(LayoutError):
        parse_layout(json.dumps(layout))
    layout["domains"][0]["preemption_notice"] = {"provider": "gcp"}
    assert parse_layout(json.dumps(layout)).domains[0].spec.preemption_notice.provider == "gcp"


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
async def test_a_real_agent_records_its_providers_notice(provider, tmp_path, nats_server, event_log, agents):
    async with FakeMetadata(provider) as md:
        layout = write_layout(tmp_path / "layout.json", tmp_path)
        doc = json.loads(layout.read_text())
        doc["domains"][0]["preemption_notice"] = {"provider": provider, "endpoint": md.endpoint, "interval_ms": 300}
        layout.write_text(json.dumps(doc))
        cfg = write_config(tmp_path / "agent-a.json", nats_server.url, tmp_path, domain="a", layout=layout)
        agent = agents(cfg, tmp_path / "agent-a.log")
        await wait_event(event_log, subjects.model("f", "a", "m1"), is_("model_resident"), agent=agent)
        assert md.requests, "the agent never asked the metadata service"
        md.announce()
        rec = await wait_event(
            event_log, subjects.agent("f", "a"), is_("failure_signalled", source="preemption_notice"), agent=agent
        )
        assert rec.event.gpu_index == -1 and provider.upper()[:3] in rec.event.detail.upper()
