"""Seeing it coming, on a real agent: a provider's preemption notice (the domain's declared command)
and the simulated GPU's critical XID and ECC faults become `failure_signalled` on the agent subject,
once each; a layout that declares a notice wrongly is refused with the fix."""

from __future__ import annotations

import json

import pytest

from haru.agents.signals import notice_from_command, notice_from_url, signs
from haru.agents.sim.gpu_state import SimGpuState
from haru.core import subjects
from haru.core.errors import LayoutError
from haru.core.layout import parse_layout
from tests.support.agent_harness import is_, wait_event, write_config, write_layout

pytestmark = pytest.mark.timeout(120)


async def test_a_preemption_notice_and_gpu_faults_are_recorded_once_each(tmp_path, nats_server, event_log, agents):
    layout = write_layout(tmp_path / "layout.json", tmp_path)
    doc = json.loads(layout.read_text())
    notice = tmp_path / "notice"
    doc["domains"][0]["preemption_notice"] = {"command": ["cat", str(notice)], "interval_ms": 200}
    layout.write_text(json.dumps(doc))
    cfg = write_config(tmp_path / "agent-a.json", nats_server.url, tmp_path, domain="a", layout=layout)
    agent = agents(cfg, tmp_path / "agent-a.log")
    await wait_event(event_log, subjects.model("f", "a", "m1"), is_("model_resident"), agent=agent)

    notice.write_text("terminate at 2026-12-01T22:00:00Z\n")  # `cat` succeeds from now on: a notice
    rec = await wait_event(
        event_log, subjects.agent("f", "a"), is_("failure_signalled", source="preemption_notice"), agent=agent
    )
    assert rec.event.detail == "terminate at 2026-12-01T22:00:00Z" and rec.event.gpu_index == -1

    SimGpuState(tmp_path / "sim" / "a", 0).set_signs(xid=79)
    rec = await wait_event(event_log, subjects.agent("f", "a"), is_("failure_signalled", source="gpu_xid"), agent=agent)
    assert rec.event.gpu_index == 0 and "XID 79" in rec.event.detail
    SimGpuState(tmp_path / "sim" / "a", 0).set_signs(ecc_uncorrected=2)
    rec = await wait_event(event_log, subjects.agent("f", "a"), is_("failure_signalled", source="gpu_ecc"), agent=agent)
    assert "2 uncorrected" in rec.event.detail

    history = await event_log.history(subjects.agent("f", "a"))
    signalled = [r.event.source for r in history if type(r.event).__struct_config__.tag == "failure_signalled"]
    assert sorted(signalled) == ["gpu_ecc", "gpu_xid", "preemption_notice"]  # once each, not once a poll


def test_what_counts_as_a_notice():
    assert notice_from_url(200, "terminate") == "terminate"
    assert notice_from_url(404, "<html>not found</html>") == ""  # AWS before a notice
    assert notice_from_url(200, "FALSE") == notice_from_url(200, " ") == ""  # GCP before a notice
    assert notice_from_url(200, "TRUE") == "TRUE"
    assert notice_from_command(0, "preempted\n") == "preempted"
    assert notice_from_command(1, "preempted") == notice_from_command(0, "") == ""
    assert signs(0, 0, False) == []
    assert [s for s, _ in signs(48, 1, True)] == ["gpu_xid", "gpu_ecc", "gpu_ecc"]


def test_a_notice_needs_exactly_one_of_url_and_command(tmp_path):
    layout = json.loads(write_layout(tmp_path / "layout.json", tmp_path).read_text())
    layout["domains"][0]["preemption_notice"] = {"url": "http://x/notice", "command": ["true"]}
    with pytest.raises(LayoutError, match="exactly one of `provider`, `url` and `command`"):
        parse_layout(json.dumps(layout))
    layout["domains"][0]["preemption_notice"] = {"url": "http://169.254.169.254/latest/meta-data/spot/instance-action"}
    parsed = parse_layout(json.dumps(layout))
    assert parsed.domains[0].spec.preemption_notice.url.endswith("instance-action")
