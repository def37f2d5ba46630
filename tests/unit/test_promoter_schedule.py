"""Which fleets a promoter pass decides for (haru/promoter/service.py `_due`): the ones that changed, and
every fleet once per tick. Before, any change (every heartbeat among them) started a pass over every
fleet, so a promoter's CPU per heartbeat grew with the number of fleets (bench/scale.py)."""

from __future__ import annotations

import time

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
