"""What the agent's appender does with an append the log neither acknowledged nor refused for good: JetStream's
"duplicate message id is in process" (10158), answered to a retry while the stream leader still proposes the
first try, is asked again until it is settled (haru/log/jetstream.py), and a refusal the appender does not
expect leaves the entry at the head of the backlog, asked again, instead of ending the backlog's task (CI saw
that task end on a 10158 during a partition, and a model that slept stayed `resident` in every view)."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime

import nats.js.errors as js_errors
import pytest
import structlog

from haru.agents.appender import Appender
from haru.core import events as ev
from haru.core.errors import LogError, LogUnavailable
from haru.log.jetstream import IN_PROCESS, JetStreamClient
from haru.log.memory import MemoryLog
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(30)
S = "haru.evt.f.a.model.m1"


def in_process() -> js_errors.APIError:
    return js_errors.APIError(code=409, err_code=IN_PROCESS, description="duplicate message id is in process")


async def test_an_append_whose_first_try_is_still_in_process_is_asked_again_under_the_same_id():
    client = object.__new__(JetStreamClient)  # only the checked publish: no connection
    client.timeout = 5.0
    tries: list[dict[str, str]] = []

    async def publish(subject: str, data: bytes, headers: dict[str, str]) -> int:
        tries.append(headers)
        if len(tries) < 3:
            raise in_process()
        return 42  # the first try's acknowledgement, once its proposal settled

    client._publish = publish  # type: ignore[method-assign]
    assert await client._publish_checked("HARU_EVENTS", S, b"{}", 7, "mid-1") == 42
    assert [h["Nats-Msg-Id"] for h in tries] == ["mid-1"] * 3  # the same append, never a second one


class Refusing:
    """A MemoryLog whose next appends fail as scripted."""

    def __init__(self, *fails: BaseException) -> None:
        self.log = MemoryLog()
        self.fails = list(fails)

    async def append(self, subject, event, *, expect):
        if self.fails:
            raise self.fails.pop(0)
        return await self.log.append(subject, event, expect=expect)

    def __getattr__(self, name):
        return getattr(self.log, name)


async def test_a_refusal_the_appender_does_not_expect_keeps_the_entry_and_the_backlog_running():
    log = Refusing(LogUnavailable("no leader"), LogError("appending: JetStream refused: something new (code 1)"))
    appender = Appender(log, stopping=lambda: False, logger=structlog.get_logger(), buffer=8, attempt_s=1.0)
    run = asyncio.create_task(appender.run())
    try:
        sleeping = ev.ModelSleeping(at=datetime.now(UTC), domain="a", model="m1")
        ref = await appender(S, sleeping, 0)  # not acknowledged: buffered
        assert ref < 0
        await wait_until(lambda: not appender.backlog, 10.0, what="the backlog drained past the refusal")
        assert not run.done()
        stored = await log.log.history(S)
        assert [type(r.event).__name__ for r in stored] == ["ModelSleeping"]
    finally:
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run
