"""Which fleets a promoter pass decides for (haru/promoter/service.py `_due`): the ones that changed, and
every fleet once per tick. Before, any change (every heartbeat among them) started a pass over every
fleet, so a promoter's CPU per heartbeat grew with the number of fleets (bench/scale.py)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC

import pytest

from haru.log.memory import MemoryLog
from haru.promoter.service import Promoter

pytestmark = pytest.mark.timeout(30)

FLEETS = [f"f{i:03d}" for i in range(50)]


def promoter() -> Promoter:
    p = Promoter(MemoryLog(writer="promoter:test"), identity="promoter:test", tick_s=0.1)
    for f in FLEETS:
        p._state(f)
    return p


def test_a_heartbeat_between_ticks_is_a_decision_for_its_own_fleet_only():
    p = promoter()
    p._swept = time.monotonic()  # every fleet was just decided for
    p.on_heartbeat("haru.hb.f007.a")
    assert [st.view.fleet for st in p._due()] == ["f007"]
    assert p._due() == []  # and only once


def test_every_fleet_is_decided_for_once_per_tick_changed_or_not():
    p = promoter()
    p._swept = time.monotonic() - 0.2  # a tick ago: what the clock decides (silence, leases) is due everywhere
    assert sorted(st.view.fleet for st in p._due()) == FLEETS
    p.on_heartbeat("haru.hb.f001.b")
    assert [st.view.fleet for st in p._due()] == ["f001"]


def test_a_heartbeat_of_an_unknown_fleet_decides_nothing():
    p = promoter()
    p._swept = time.monotonic()
    p.on_heartbeat("haru.hb.nosuch.a")
    assert p._due() == []


# ------------------------------------------------------------------ appends made after the decision


async def test_an_append_decided_before_another_replicas_record_was_folded_conflicts():
    """A fleet's appends are made in a task, a loop turn after the decision. If another replica's
    record on the same subject is folded in between, the append must conflict (it was decided on a
    view without that record), not pass on top of it: with the expected sequence read when the task
    ran, two promoters sharing 100 fleets started the same step twice (bench/scale.py: 21 and 52
    steps in two runs)."""
    from datetime import datetime

    from haru.core.events import PromotionRequested, StepStarted
    from haru.promoter.decisions import Append

    log = MemoryLog(writer="promoter:test")
    p = Promoter(log, identity="promoter:a", tick_s=0.1)
    subject = "haru.evt.f1.op"
    at = datetime(2026, 12, 2, tzinfo=UTC)
    requested = await log.append(
        subject, PromotionRequested(at=at, op_id="op-1", target="b", by="promoter:b"), expect=0
    )
    rec = await log.last(subject)
    assert rec is not None and rec.seq == requested
    p.on_record(rec)
    st = p.fleets["f1"]
    # the other replica starts the first step; this one has not folded it yet
    theirs = await log.append(
        subject, StepStarted(at=at, op_id="op-1", step="wake", attempt=1, by="promoter:b"), expect=requested
    )
    p._start_making(
        st,
        [
            Append(
                subject=subject,
                event=StepStarted(at=at, op_id="op-1", step="wake", attempt=1),
                why="decided on the view that ends at the request",
            )
        ],
    )
    other = await log.last(subject)
    assert other is not None and other.seq == theirs
    p.on_record(other)  # folded before the task makes the append
    await asyncio.wait_for(asyncio.gather(*p._tasks), 5)
    last = await log.last(subject)
    assert last is not None and last.seq == theirs, "the step was started a second time, on top of the other replica's"
    assert "f1" not in p._making
