"""Following HARU_EVENTS on JetStream (haru/log/js_replay.py, haru/log/follow.py), where it differs from the
in-memory log the contract suite also runs (tests/integration/test_log_contract.py): the headers a following
replay hands over, and a consumer deleted under a follower."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from haru.core import events as ev
from haru.core import subjects
from haru.host.tasks import cancel_and_wait

T0 = datetime(2026, 11, 29, 3, 0, tzinfo=UTC)
SUBJECT = subjects.model("default", "a", "stories")


def loading(i: int) -> ev.ModelLoading:
    return ev.ModelLoading(at=T0 + timedelta(seconds=i), domain="a", model="stories", endpoint="127.0.0.1:18080", pid=i)


async def append(log, n: int, start: int = 0) -> int:
    seq = await log.last_seq_of(SUBJECT)
    for i in range(start, start + n):
        seq = await log.append(SUBJECT, loading(i), expect=seq)
    return seq


async def until(cond, timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.02)


async def test_a_following_replay_starts_where_asked_and_hands_the_stored_headers(event_log):
    last = await append(event_log, 12)
    seen: list = []
    follower = asyncio.create_task(event_log.replay(seen.append, from_seq=5, follow=True))
    try:
        await until(lambda: len(seen) >= last - 4)
    finally:
        await cancel_and_wait(follower)
    assert [r.seq for r in seen] == list(range(5, last + 1))
    assert [r.event.pid for r in seen] == list(range(4, last))  # each its own body
    stored = await event_log.read_seq(7)  # the headers of an append, as the log's own read has them
    assert seen[2].headers == stored.headers and seen[2].headers  # non-empty: every append writes two


async def test_a_consumer_deleted_under_a_follower_is_replaced_and_nothing_is_lost_or_repeated(event_log):
    last = await append(event_log, 40)
    seen: list[int] = []
    deleting: list[asyncio.Task] = []

    async def delete_all() -> int:
        infos = await event_log.js.consumers_info(subjects.EVENTS_STREAM)
        for info in infos:
            await event_log.js.delete_consumer(subjects.EVENTS_STREAM, info.name)
        return len(infos)

    def handler(rec) -> None:
        seen.append(rec.seq)
        if rec.seq == last:
            deleting.append(asyncio.get_running_loop().create_task(delete_all()))

    follower = event_log.follower(handler, name="test", stall_interval=0.2, stall_checks=2)
    task = asyncio.create_task(follower.run())
    try:
        await until(lambda: len(seen) >= last and deleting and deleting[0].done())
        assert deleting[0].result() == 1
        total = await append(event_log, 5, start=40)  # stored while no consumer delivers
        await until(lambda: len(seen) >= total)
        await asyncio.sleep(0.3)  # nothing more, nothing twice
    finally:
        await cancel_and_wait(task)
    assert seen == list(range(1, total + 1))
    assert follower.restarts >= 1
