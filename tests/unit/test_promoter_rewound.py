"""A promoter that finds the log rewound folds every fleet again (haru/promoter/service.py `_rewound`), and
keeps the heartbeats it heard: they are not in the log. Before, the fleets' states were made anew without
them, every domain counted as silent since the promoter started listening, and its first decision after
the fold failed a beating fleet over (a second flip after a partition healed, tests/integration/test_regions.py)."""

from __future__ import annotations

import pytest

from haru.core import subjects
from haru.core.events import DomainDeclared, FleetDeclared
from haru.core.specs import DomainSpec, GpuSpec
from haru.log.memory import MemoryLog
from haru.promoter.service import Promoter
from tests.support.decider import POLICY, T0, F, healthy_fleet

pytestmark = pytest.mark.timeout(30)


async def fleet_log() -> MemoryLog:
    log = MemoryLog(writer="test")
    events = [(subjects.decl(F), FleetDeclared(at=T0, fleet=F, policy=POLICY))]
    for d in ("a", "b"):
        events.append(
            (
                subjects.decl(F),
                DomainDeclared(at=T0, spec=DomainSpec(name=d, gpus=[GpuSpec(index=0, memory_bytes=24 << 30)])),
            )
        )
    tips: dict[str, int] = {}
    for subject, event in [*events, *healthy_fleet()]:
        tips[subject] = await log.append(subject, event, expect=tips.get(subject, 0))
    return log


async def test_the_heartbeats_heard_are_kept_when_the_log_is_folded_again_after_a_rewind():
    log = await fleet_log()
    p = Promoter(log, identity="promoter:test", tick_s=0.1)
    records = await log.history(subjects.fleet_events(F))
    for rec in records:
        p.on_record(rec)
    for d in ("a", "b"):
        p.on_heartbeat(subjects.heartbeat(F, d))
    assert all(ms is not None and ms < 2000 for ms in p.facts(p.fleets[F]).silent_ms.values())

    p._rewound(records[-1].seq)  # what the follower calls when the log went back behind the fold
    p.on_heartbeat(subjects.heartbeat(F, "a"))  # heard while the fleet is folded again
    for rec in records:
        p.on_record(rec)
    silent = p.facts(p.fleets[F]).silent_ms
    assert set(silent) == {"a", "b"}
    assert all(ms is not None and ms < 2000 for ms in silent.values()), silent
