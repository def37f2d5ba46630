"""The projector's fold and writes on the in-memory log (haru/log/memory.py): views in the KV, one route
intent per pointer move, racing projectors, resuming from the stored views, invalid bodies. Without a
nats-server; what only a server shows (a NATS restart mid-replay, a damaged store, a killed process)
stays in tests/integration/test_projector.py and test_damaged_log.py."""

from __future__ import annotations

import asyncio

import pytest

from haru.core import events as ev
from haru.core import subjects as sj
from haru.log.memory import MemoryLog
from haru.host.tasks import cancel_and_wait
from haru.core.views import intent_decoder
from projections.projector import Projector
from haru.core.intents import changed
from tests.integration.test_projector import F, MODELS, Writer, declare, expected_views, now, wait_view_seq

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def log():
    log = MemoryLog(writer="test")
    await declare(log)
    return log


async def intents_published(log: MemoryLog) -> int:
    got = await log.last_intent(F)
    return 0 if got is None else got[1]  # the intents' stream is dense: its last sequence counts them


async def test_views_and_intents_follow_the_log(log):
    w = Writer(log)
    r1 = await w.move("a")
    await w.churn(9, domain="a")
    projector = Projector(log)
    task = asyncio.create_task(projector.run())
    try:
        last = await log.last_seq()
        view = await wait_view_seq(log, last)
        assert view == (await expected_views(log))[F]
        ri = intent_decoder.decode((await log.last_intent(F))[0])
        assert (ri.revision, ri.active.domain, ri.view_seq) == (r1, "a", last)
        assert set(ri.answers) == set(MODELS)
        r2 = await w.move("b")  # following: a new pointer move becomes a new intent
        await wait_view_seq(log, r2)
        await projector.wait_idle(5)
        ri = intent_decoder.decode((await log.last_intent(F))[0])
        assert (ri.revision, ri.active.domain) == (r2, "b")
        assert projector.stats.resumed_from == 1
    finally:
        await cancel_and_wait(task)


async def test_every_pointer_move_becomes_one_intent_even_when_writes_coalesce(log):
    w = Writer(log)
    moves = [await w.move(d) for d in ("a", "b", "a", "b", "a")]  # all stored before the projector reads one
    projector = Projector(log)
    task = asyncio.create_task(projector.run())
    try:
        await wait_view_seq(log, moves[-1])
        await projector.wait_idle(5)
        assert await intents_published(log) == len(moves)
        assert intent_decoder.decode((await log.last_intent(F))[0]).revision == moves[-1]
    finally:
        await cancel_and_wait(task)


async def test_two_racing_projectors_publish_each_move_once_and_agree_on_the_view(log):
    w = Writer(log)
    seen: list = []

    async def watch() -> None:
        async for _, body, _ in log.watch_intents(F):
            seen.append(intent_decoder.decode(body))

    watcher = asyncio.create_task(watch())
    first, second = Projector(log.connect("projector:1")), Projector(log.connect("projector:2"))
    tasks = [asyncio.create_task(first.run()), asyncio.create_task(second.run())]
    try:
        moves = []
        for d in ("a", "b", "a", "b"):
            moves.append(await w.move(d))
            await w.churn(3, domain=d)
        last = await log.last_seq()
        view = await wait_view_seq(log, last)
        await first.wait_idle(5)
        await second.wait_idle(5)
        assert view == (await expected_views(log))[F]
        await asyncio.sleep(0.1)  # the watcher hears the last publish
        # every move has its intent, and no intent was published twice (by the two of them, or one)
        assert [ri.revision for ri in seen if ri.revision in moves and ri.view_seq == ri.revision] == moves
        assert all(changed(a, b) for a, b in zip(seen, seen[1:])), [(ri.revision, ri.view_seq) for ri in seen]
        assert first.stats.intents_published + second.stats.intents_published == len(seen) == await intents_published(log)
    finally:
        await cancel_and_wait(watcher, *tasks)


async def test_a_restarted_projector_resumes_after_its_stored_view(log):
    w = Writer(log)
    await w.move("a")
    await w.churn(6, domain="a")
    projector = Projector(log)
    task = asyncio.create_task(projector.run())
    folded = await log.last_seq()
    try:
        await wait_view_seq(log, folded)
        await projector.wait_idle(5)
    finally:
        await cancel_and_wait(task)
    r = await w.move("b")
    again = Projector(log)
    task = asyncio.create_task(again.run())
    try:
        assert (await wait_view_seq(log, r)).active == "b"
        assert again.stats.resumed_from == folded + 1
        assert again.stats.handled == r - folded  # nothing folded twice
    finally:
        await cancel_and_wait(task)


async def test_an_invalid_body_is_counted_skipped_and_projection_goes_on(log):
    w = Writer(log)
    await w.move("a")
    bad_subject = sj.model(F, "a", MODELS[0])
    await log.append_raw(bad_subject, b'{"type": "model_loading", "at": "not a time"}')
    await log.append_raw(sj.agent(F, "a"), b"\x00 not json at all")
    w.tips.pop(bad_subject, None)
    good = await w.put(bad_subject, ev.ModelLoading(at=now(), domain="a", model=MODELS[0]))
    projector = Projector(log)
    task = asyncio.create_task(projector.run())
    try:
        view = await wait_view_seq(log, good)
        assert view.anomalies == 2 and "skipped" in view.last_anomaly
        assert view.domains["a"].models[MODELS[0]].residency.seq == good
        assert projector.stats.invalid == 2
        r = await w.move("b")
        assert (await wait_view_seq(log, r)).active == "b"
    finally:
        await cancel_and_wait(task)
