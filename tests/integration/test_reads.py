"""Reads that do not grow with the log (haru/log/reads.py, EventLog.tail) against a real nats-server."""

from __future__ import annotations

from datetime import UTC, datetime

from haru.core import events as ev
from haru.core import subjects as sj
from haru.log import history, reads

T = datetime(2026, 11, 30, tzinfo=UTC)


async def test_tail_reads_the_last_matches_back_from_the_end(event_log):
    x, y = sj.model("f", "a", "x"), sj.model("f", "a", "y")
    seq_x = seq_y = 0
    kinds = (ev.ModelSleeping, ev.ModelWaking, ev.ModelResident)
    ys = []
    for i in range(1500):  # y is sparse: 12 events among 1,500, most of them early
        seq_x = await event_log.append(x, kinds[i % 3](at=T, domain="a", model="x"), expect=seq_x)
        if i % 100 == 0 and i < 1200:
            seq_y = await event_log.append(y, kinds[i % 3](at=T, domain="a", model="y"), expect=seq_y)
            ys.append(seq_y)
    got = await event_log.tail(y, 5)
    assert [r.seq for r in got] == ys[-5:]
    assert [r.seq for r in await event_log.tail(y, 50)] == ys  # fewer than asked: all of them
    assert [r.seq for r in await event_log.tail(x, 3)] == [seq_x - 2, seq_x - 1, seq_x]  # no y among the last 300


async def test_why_reads_the_models_links_not_the_fleets_other_operations(event_log):
    op, m = sj.op("f"), sj.model("f", "b", "m")
    other = await event_log.append(op, ev.PromotionRequested(at=T, op_id="o1", target="b", reason="manual"), expect=0)
    unrelated = await event_log.append(op, ev.OperationAborted(at=T, op_id="o1", cause=other), expect=other)
    request = await event_log.append(
        op, ev.PromotionRequested(at=T, op_id="o2", target="b", reason="manual"), expect=unrelated
    )
    started = await event_log.append(op, ev.StepStarted(at=T, op_id="o2", step="wake", cause=request), expect=request)
    waking = await event_log.append(m, ev.ModelWaking(at=T, domain="b", model="m", cause=started), expect=0)
    done = await event_log.append(op, ev.StepCompleted(at=T, op_id="o2", step="wake", cause=started), expect=started)
    have = await reads.why_records(event_log, "f", "m", "", [])
    assert set(have) == {request, started, waking, done}  # up the links, then what they caused; not o1
    (root,) = history.causal_tree(have)
    assert root.rec.seq == request and [c.rec.seq for c in root.children] == [started]
    assert [c.rec.seq for c in root.children[0].children] == [waking, done]


async def test_why_shows_the_weights_that_applied_to_the_model(event_log):
    m, w = sj.model("f", "b", "m"), sj.weights("f")
    resident = await event_log.append(m, ev.ModelResident(at=T, domain="b", model="m"), expect=0)
    fleet_split = await event_log.append(w, ev.WeightsSet(at=T, weights={"a": 90, "b": 10}), expect=0)
    other_model = await event_log.append(
        w, ev.WeightsSet(at=T, model="n", weights={"a": 50, "b": 50}), expect=fleet_split
    )
    rollback = await event_log.append(
        w, ev.WeightsSet(at=T, reason="canary_rolled_back", domain="b", detail="error rate 30.0%"), expect=other_model
    )
    have = await reads.why_records(event_log, "f", "m", "", [])
    assert set(have) == {resident, fleet_split, rollback}  # not model n's split
