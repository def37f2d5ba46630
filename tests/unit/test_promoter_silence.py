"""What a promoter counts as heartbeat silence after its view of the cluster broke (haru/promoter/service.py).

- A log found rewound is folded again from sequence 1 (`_rewound`), keeping the heartbeats heard: they
  are not in the log. Before, the fleets' states were made anew without them, every domain counted as
  silent since the promoter started listening, and its first decision after the fold failed a beating
  fleet over (a second flip after a partition healed, tests/integration/test_regions.py).
- A promoter that no longer hears most of the promoters it knows judges no silence, and measures it
  afresh once it hears them again (`Isolation`).
"""

from __future__ import annotations

import time

import pytest

from haru.core import subjects
from haru.core.events import DomainDeclared, FleetDeclared
from haru.core.specs import DomainSpec, GpuSpec
from haru.log.memory import MemoryLog
from haru.promoter.fleets import first_standbys
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


async def test_a_promoter_that_no_longer_hears_most_promoters_judges_no_silence_and_measures_afresh_after():
    """Region 3 cut from both others, its promoter appending nothing while the cut lasted (so no append
    of its own failed to tell it): the silence it measured then was its own, not the domains'."""
    log = await fleet_log()
    p = Promoter(log, identity="promoter:r3", tick_s=0.1)
    for rec in await log.history(subjects.fleet_events(F)):
        p.on_record(rec)
    st = p.fleets[F]
    now = time.monotonic()
    p.peers.last.update({("promoter", n): now for n in ("promoter:r1", "promoter:r2", "promoter:r3")})
    st.heard.update({"a": now - 5, "b": now - 5})  # beats that stopped reaching us 5 s ago
    assert p.facts(st).silent_ms["b"] >= 5000  # most promoters heard: the silence is evidence

    for n in ("promoter:r1", "promoter:r2"):  # the cut: the two others fall silent as well
        p.peers.last[("promoter", n)] = now - 10
    isolated = p.facts(st)
    assert isolated.silent_ms == {"a": None, "b": None} and isolated.listening_ms == 0

    for n in ("promoter:r1", "promoter:r2"):  # the heal: heard again
        p.peers.last[("promoter", n)] = time.monotonic()
    healed = p.facts(st)
    assert healed.silent_ms == {"a": None, "b": None}, "silence from before the heal judged"
    assert healed.listening_ms < 1000  # measured from the heal, not from before the cut


async def test_the_standbys_are_each_fleets_first_ranked_fit_one_where_the_stream_leaders_follow():
    """`first_standbys`: what `haru promoter --stream-leaders domain=server` keeps the leaders beside."""
    log = await fleet_log()
    p = Promoter(log, identity="promoter:test", tick_s=0.1)
    assert first_standbys(p.fleets) == []  # nothing folded yet
    for rec in await log.history(subjects.fleet_events(F)):
        p.on_record(rec)
    assert first_standbys(p.fleets) == ["b"]  # a active and resident, b asleep and reachable
