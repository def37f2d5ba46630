"""`haru.core.residency.evolve` memoizes, per (state class, event class), the branch the table takes
(`_step`). Every state (sleeping at both levels) against every residency event and verdict: the
memoized answer equals the one read from the table (`_evolve`), illegal pairs included."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from haru.core import events as ev
from haru.core import residency as r
from haru.core.errors import IllegalTransition

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
T1 = datetime(2026, 11, 29, 13, 0, 0, tzinfo=UTC)

STATES = [
    r.Unknown(),
    r.Unknown(since=T0, seq=2),
    r.Loading(since=T0, seq=3, attempt=2, endpoint="http://x"),
    r.Resident(since=T0, seq=4, warmup_ms=900),
    r.Sleeping(since=T0, seq=5, level=1),
    r.Sleeping(since=T0, seq=5, level=2),
    r.Waking(since=T0, seq=6),
    r.Lost(since=T0, seq=7, reason="evicted", detail="gone"),
    r.Failed(since=T0, seq=8, runtime_said="OOM"),
    r.Stopped(since=T0, seq=9, detail="asked"),
    r.NotAdmitted(since=T0, seq=10, short_by_bytes=5),
]

EVENTS = [
    ev.ModelLoading(at=T1, domain="a", model="m", attempt=3, endpoint="http://y"),
    ev.ModelResident(at=T1, domain="a", model="m", warmup_ms=10, endpoint="http://y"),
    ev.ModelSleeping(at=T1, domain="a", model="m", level=1),
    ev.ModelSleeping(at=T1, domain="a", model="m", level=2),
    ev.ModelWaking(at=T1, domain="a", model="m"),
    ev.ModelLost(at=T1, domain="a", model="m", reason="unhealthy", detail="timeout"),
    ev.ModelFailed(at=T1, domain="a", model="m", runtime_said="CUDA OOM"),
    ev.ModelStopped(at=T1, domain="a", model="m", detail="bye"),
    ev.AdmissionDecided(at=T1, domain="a", name="m", gpu_index=0, admitted=True, vram_bytes=1),
    ev.AdmissionDecided(at=T1, domain="a", name="m", gpu_index=0, admitted=False, vram_bytes=1, short_by_bytes=3),
]


def outcome(fn, state, event):
    try:
        return fn(state, event)
    except IllegalTransition as exc:
        return ("illegal", str(exc))


@pytest.mark.parametrize("state", STATES, ids=lambda s: f"{r.state_name(s)}-{s.seq}-{getattr(s, 'level', '')}")
@pytest.mark.parametrize("event", EVENTS, ids=lambda e: r.event_key(e) + str(getattr(e, "level", "")))
def test_memoized_step_equals_the_table(state, event):
    memo = outcome(lambda s, e: r.evolve(s, e, seq=42, subject="haru.evt.f.a.model.m"), state, event)
    table = outcome(lambda s, e: r._evolve(s, e, 42, "haru.evt.f.a.model.m"), state, event)
    memoized = r._STEPS[type(state), type(event)] is not None
    assert memoized == (not isinstance(table, tuple) and not isinstance(event, ev.AdmissionDecided))
    assert memo == table
    assert type(memo) is type(table)
    if not isinstance(table, tuple):  # what is kept is kept (the fold relies on `is` to copy nothing)
        assert (memo is state) == (table is state)
