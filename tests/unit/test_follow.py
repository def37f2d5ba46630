"""haru.log.follow.Follower's own decisions, on the in-memory log: a replay that stops delivering while
the log grows is started again after the position (and each record is handled once); a busy handler
is not a stall; a tail the store cannot serve is not restarted for; a LogError is retried, any other
error is raised. (Against JetStream: tests/integration/test_log_contract.py, and the services' tests.)"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from haru.core import events as ev
from haru.core import subjects
from haru.core.errors import LogUnavailable
from haru.log.follow import Follower
from haru.log.memory import MemoryLog

pytestmark = pytest.mark.timeout(30)
T0 = datetime(2026, 11, 29, 3, 0, tzinfo=UTC)


class StallingLog(MemoryLog):
    """A log whose first `stalls` follow-replays stop delivering after `deliver` records (as nats-py's
    ordered consumer does after a NATS restart, until it notices); later replays are healthy."""

    def __init__(
        self, *, stalls: int = 1, deliver: int = 2, unreadable: set[int] | None = None, fail_first: int = 0
    ) -> None:
        super().__init__(writer="test")
        self.stalls, self.deliver = stalls, deliver
        self.unreadable = unreadable or set()
        self.fail_first = fail_first
        self.replays = 0

    async def replay(self, handler, *, from_seq=1, follow=False, **kwargs):
        self.replays += 1
        if self.fail_first:
            self.fail_first -= 1
            raise LogUnavailable("the log is away for a moment")
        if follow and self.stalls:
            self.stalls -= 1
            handed = 0

            def limited(rec):
                nonlocal handed
                if handed < self.deliver and rec.seq not in self.unreadable:
                    handed += 1
                    return handler(rec)
                return None

            await super().replay(limited, from_seq=from_seq, follow=False, **kwargs)
            await asyncio.Event().wait()  # silent from now on
        if self.unreadable:

            def skip(rec):
                return None if rec.seq in self.unreadable else handler(rec)

            return await super().replay(skip, from_seq=from_seq, follow=follow, **kwargs)
        return await super().replay(handler, from_seq=from_seq, follow=follow, **kwargs)

    async def read_seq(self, seq):
        return None if seq in self.unreadable else await super().read_seq(seq)


async def fill(log: MemoryLog, n: int) -> None:
    for i in range(n):
        await log.append(subjects.model("f", "a", f"m{i}"), ev.ModelLoading(at=T0, domain="a", model=f"m{i}"), expect=0)


async def run_until(follower: Follower, check, timeout: float = 10.0) -> None:
    task = asyncio.create_task(follower.run())
    try:
        async with asyncio.timeout(timeout):
            while not check():
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_stalled_replay_is_started_again_after_the_position_and_each_record_is_handled_once():
    log = StallingLog(stalls=1, deliver=2)
    await fill(log, 5)
    seen: list[int] = []
    reasons: list[str] = []
    f = log.follower(lambda r: seen.append(r.seq), stall_interval=0.05, stall_checks=2, on_restart=reasons.append)
    await run_until(f, lambda: seen == [1, 2, 3, 4, 5])
    assert (f.stalls, reasons, f.position) == (1, ["stalled"], 5)


async def test_a_busy_handler_is_not_a_stall():
    log = StallingLog(stalls=0)
    await fill(log, 3)
    release = asyncio.Event()
    seen: list[int] = []

    async def slow(rec) -> None:
        if rec.seq == 2:
            await release.wait()  # the writer's backpressure: much longer than the stall checks
        seen.append(rec.seq)

    f = log.follower(slow, stall_interval=0.02, stall_checks=2)
    task = asyncio.create_task(f.run())
    try:
        await asyncio.sleep(0.5)
        assert seen == [1] and f.restarts == 0
        release.set()
        async with asyncio.timeout(5):
            while seen != [1, 2, 3]:
                await asyncio.sleep(0.01)
        assert f.restarts == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_busy_queue_is_not_a_stall():
    log = StallingLog(stalls=1, deliver=1)
    await fill(log, 3)
    f = log.follower(lambda rec: None, stall_interval=0.02, stall_checks=2, busy=lambda: True)
    task = asyncio.create_task(f.run())
    try:
        await asyncio.sleep(0.4)
        assert f.position == 1 and f.stalls == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_an_unreadable_tail_is_not_restarted_for():
    log = StallingLog(stalls=0, unreadable={4, 5})
    await fill(log, 5)
    seen: list[int] = []
    f = log.follower(lambda r: seen.append(r.seq), stall_interval=0.02, stall_checks=2)
    task = asyncio.create_task(f.run())
    try:
        await asyncio.sleep(0.5)
        assert seen == [1, 2, 3] and f.stalls == 0  # 4 and 5 cannot be served: restarting would not help
        await log.append(subjects.model("f", "a", "late"), ev.ModelLoading(at=T0, domain="a", model="late"), expect=0)
        async with asyncio.timeout(5):
            while seen[-1] != 6:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_log_going_away_is_retried_and_a_handler_bug_is_raised():
    log = StallingLog(stalls=0, fail_first=2)
    await fill(log, 2)
    seen: list[int] = []
    f = log.follower(lambda r: seen.append(r.seq), retry_s=0.01)
    await run_until(f, lambda: seen == [1, 2])
    assert f.interruptions == 2

    def bug(rec) -> None:
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        async with asyncio.timeout(5):
            await log.follower(bug).run()
