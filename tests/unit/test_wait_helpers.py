"""The suite's one way to wait (tests/support/wait.py): it returns what the check found, fails at the bound with
what it waited for, and never passes a test whose behaviour did not happen."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.wait import wait_until, wait_until_sync


async def test_returns_the_first_truthy_value_of_a_plain_or_async_check():
    calls = []

    def plain():
        calls.append(1)
        return len(calls) if len(calls) >= 3 else 0

    async def awaited():
        return "there"

    assert await wait_until(plain, 5, interval_s=0.001) == 3
    assert await wait_until(awaited, 5) == "there"
    assert wait_until_sync(lambda: "now", 5) == "now"


async def test_fails_at_the_bound_naming_what_it_waited_for_and_the_last_value():
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 0.2 s waiting for the door to open; last: \[\]"):
        await wait_until(lambda: [], 0.2, interval_s=0.01, what="the door to open")
    assert time.monotonic() - started >= 0.2
    with pytest.raises(AssertionError, match="waiting for the log's tail: 42"):
        wait_until_sync(lambda: None, 0.05, what=lambda: "the log's tail: 42")


async def test_an_error_in_the_check_propagates_unless_the_test_retries_on_it():
    def boom():
        raise ValueError("not yet")

    with pytest.raises(ValueError, match="not yet"):
        await wait_until(boom, 1)
    with pytest.raises(AssertionError, match=r"last: ValueError\('not yet'\)"):
        await wait_until(boom, 0.1, interval_s=0.01, retry_on=(ValueError,))
    with pytest.raises(AssertionError, match=r"last: ValueError\('not yet'\)"):
        wait_until_sync(boom, 0.1, interval_s=0.01, retry_on=(ValueError,))


async def test_an_async_check_that_hangs_fails_the_wait_instead_of_hanging_the_test():
    async def hangs():
        await asyncio.sleep(60)

    started = time.monotonic()
    with pytest.raises(AssertionError, match="a check hung while waiting for the reply"):
        await wait_until(hangs, 0.2, what="the reply", retry_on=(Exception,))
    assert time.monotonic() - started < 10
