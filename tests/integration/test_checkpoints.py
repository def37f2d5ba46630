"""Checkpoints against a real nats-server: the projector writes them, `haru verify --since-checkpoint`
walks only what came after (and refuses a checkpoint whose heads the store does not hold), and a
projector rebuild starts from one."""

from __future__ import annotations

import asyncio
import json

import msgspec

from haru.core import checkpoints
from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.fold import fold
from haru.host.tasks import cancel_and_wait
from haru.log.eventlog import body_hash
from haru.projections.projector import Projector
from tests.support import haru
from tests.support.projector import F, Writer, declare, stored_view, wait_view_seq


async def project(log, **kwargs) -> Projector:
    """Run a projector until it has written everything stored now; return it (stopped)."""
    projector = Projector(log, **kwargs)
    task = asyncio.create_task(projector.run())
    try:
        last = await log.last_seq()
        await wait_view_seq(log, last)
        await projector.wait_idle(10)
    finally:
        await cancel_and_wait(task)
    return projector


async def last_checkpoint(log, fleet: str = F) -> tuple[int, ev.Checkpoint]:
    rec = await log.last(sj.checkpoint(fleet))
    assert rec is not None and isinstance(rec.event, ev.Checkpoint), "no checkpoint written"
    return rec.seq, rec.event


async def test_the_projector_writes_checkpoints_that_match_the_store(event_log):
    await declare(event_log)
    w = Writer(event_log)
    await w.move("a")
    await w.churn(60)
    projector = await project(event_log, checkpoint_every=25)
    assert projector.checkpoints_written >= 1
    seq, cp = await last_checkpoint(event_log)
    records = await event_log.history(sj.fleet_events(F))
    upto = [r for r in records if r.seq <= cp.upto]
    # every subject's chain head at `upto`, and nothing else
    heads = {}
    for r in upto:
        heads[r.subject] = (r.seq, body_hash(r.data))
    assert checkpoints.heads_of(cp) == heads
    assert cp.events == len(upto)
    # the view it carries is the fold of exactly those events
    expected = fold((r.seq, r.subject, r.event) for r in upto)[F]
    assert checkpoints.view_of(cp) == msgspec.structs.replace(expected, checkpoint=cp.upto)


async def test_verify_since_checkpoint_walks_only_what_came_after(nats_server, event_log):
    await declare(event_log)
    w = Writer(event_log)
    await w.move("a")
    await w.churn(60)
    await project(event_log, checkpoint_every=25)
    _, cp = await last_checkpoint(event_log)
    await w.churn(7)
    total = await event_log.last_seq()

    full = haru("verify", "--json", nats_url=nats_server.url)
    assert full.returncode == 0, full.stdout + full.stderr
    assert json.loads(full.stdout)["events"] == total

    out = haru("verify", "--since-checkpoint", "--json", nats_url=nats_server.url)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert doc["ok"] and doc["since_checkpoint"] == {F: cp.upto}
    assert doc["events"] == total - cp.upto
    text = haru("verify", "--since-checkpoint", nats_url=nats_server.url)
    assert text.returncode == 0 and f"from checkpoints: {F} after seq {cp.upto}" in text.stdout


async def test_verify_since_checkpoint_refuses_heads_the_store_does_not_hold(nats_server, event_log):
    await declare(event_log)
    w = Writer(event_log)
    await w.churn(12)
    records = await event_log.history(sj.fleet_events(F))
    heads = {r.subject: (r.seq, body_hash(r.data)) for r in records}
    victim = records[3]
    heads[victim.subject] = (victim.seq, "0" * 64)  # not the body stored there
    view = fold((r.seq, r.subject, r.event) for r in records)[F]
    forged = checkpoints.build(
        F, upto=records[-1].seq, events=len(records), heads=heads, view=view, now=records[-1].event.at
    )
    await event_log.append(sj.checkpoint(F), forged, expect=0)
    out = haru("verify", "--since-checkpoint", nats_url=nats_server.url)
    assert out.returncode == 5, out.stdout + out.stderr
    assert f"seq {victim.seq} on {victim.subject}: the checkpoint names seq {victim.seq}" in out.stdout
    assert haru("verify", nats_url=nats_server.url).returncode == 0  # the full walk: history itself is intact


async def test_a_projector_rebuild_starts_from_the_checkpoint(event_log):
    await declare(event_log)
    w = Writer(event_log)
    await w.move("a")
    await w.churn(60)
    await project(event_log, checkpoint_every=25)
    _, cp = await last_checkpoint(event_log)
    await w.move("b")
    await w.churn(5)
    rebuilt = await project(event_log, from_checkpoint=True)
    assert rebuilt.stats.resumed_from == cp.upto + 1
    view = await stored_view(event_log)
    expected = fold((r.seq, r.subject, r.event) for r in await event_log.history() if r.event is not None)[F]
    assert view.active == "b"
    assert msgspec.structs.replace(view, checkpoint=0) == msgspec.structs.replace(expected, checkpoint=0)


async def test_a_restarted_projector_reads_the_heads_since_the_checkpoint_and_checkpoints_again(event_log):
    await declare(event_log)
    w = Writer(event_log)
    await w.move("a")
    await w.churn(60)
    await project(event_log, checkpoint_every=25)
    first_seq, first = await last_checkpoint(event_log)
    await w.churn(20)  # folded into the stored view, not enough for a checkpoint
    await project(event_log, checkpoint_every=25)
    assert (await last_checkpoint(event_log))[0] == first_seq
    await w.churn(10)
    # a restart resumes after the view: the 20 events between the checkpoint and the view are read
    # for their heads beside the follower, and the next checkpoint is whole
    projector = Projector(event_log, checkpoint_every=25)
    task = asyncio.create_task(projector.run())
    try:
        for _ in range(500):
            seq, cp = await last_checkpoint(event_log)
            if seq != first_seq:
                break
            await asyncio.sleep(0.02)
    finally:
        await cancel_and_wait(task)
    assert seq != first_seq, "no second checkpoint"
    assert projector.stats.resumed_from > first.upto + 1
    upto = [r for r in await event_log.history(sj.fleet_events(F)) if r.seq <= cp.upto]
    assert checkpoints.heads_of(cp) == {r.subject: (r.seq, body_hash(r.data)) for r in upto}
    assert cp.events == len(upto)
