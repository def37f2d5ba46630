"""EventLog.subject_counts: the subjects holding events, with their counts (one stream-info request)."""

from __future__ import annotations

from datetime import UTC, datetime

import haru.log.js_events as js_events
from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.specs import Policy


async def _fill(log) -> None:
    now = datetime.now(UTC)
    for fleet in ("default", "edge"):
        seq = await log.append(sj.decl(fleet), ev.FleetDeclared(at=now, fleet=fleet, policy=Policy()), expect=0)
        if fleet == "default":
            await log.append(sj.decl(fleet), ev.PolicyChanged(at=now, policy=Policy()), expect=seq)
    await log.append(sj.model("default", "a", "m"), ev.ModelWaking(at=now, domain="a", model="m"), expect=0)


async def test_subjects_with_counts(event_log) -> None:
    assert await event_log.subject_counts("haru.evt.*.decl") == {}
    await _fill(event_log)
    assert await event_log.subject_counts("haru.evt.*.decl") == {sj.decl("default"): 2, sj.decl("edge"): 1}
    assert await event_log.subject_counts() == {
        sj.decl("default"): 2,
        sj.decl("edge"): 1,
        sj.model("default", "a", "m"): 1,
    }
    assert await event_log.subject_counts("haru.evt.lab.>") == {}


async def test_a_full_page_is_counted_from_the_messages(event_log, monkeypatch) -> None:
    await _fill(event_log)
    listed = await event_log.subject_counts()
    monkeypatch.setattr(js_events, "_SUBJECTS_PAGE", 2)  # the server's answer now looks truncated
    assert await event_log.subject_counts() == listed
    assert await event_log.subject_counts("haru.evt.*.decl") == {sj.decl("default"): 2, sj.decl("edge"): 1}
