"""A service that reads the log to start asks again while the log is between leaders (haru/log/waiting.py)."""

from __future__ import annotations

import pytest

from haru.core.errors import LogError, LogUnavailable
from haru.log.waiting import until_available


async def test_it_asks_again_while_the_log_is_unavailable_and_returns_the_answer():
    calls, said = [], []

    async def read() -> int:
        calls.append(1)
        if len(calls) < 3:
            raise LogUnavailable("no stream leader yet")
        return 42

    assert await until_available(read, pause_s=0.01, on_retry=said.append) == 42
    assert len(calls) == 3 and [str(e) for e in said] == ["no stream leader yet"] * 2


async def test_it_gives_up_after_its_bound_with_the_logs_own_error():
    async def read() -> int:
        raise LogUnavailable("JetStream did not answer")

    with pytest.raises(LogUnavailable, match="did not answer"):
        await until_available(read, within_s=0.05, pause_s=0.01)


async def test_any_other_error_is_not_waited_out():
    calls = []

    async def read() -> int:
        calls.append(1)
        raise LogError("JetStream refused: bad request")

    with pytest.raises(LogError, match="refused"):
        await until_available(read, pause_s=0.01)
    assert calls == [1]
