"""Waiting for behaviour in the tests: poll a check until it holds, within a bound the test states.

    await wait_until(check, timeout_s, interval_s=..., what="...")   # in a coroutine; `check` plain or async
    wait_until_sync(check, timeout_s, interval_s=..., what="...")    # in plain code; `check` plain

`check` returns something truthy once the behaviour is there; that value is returned. Past `timeout_s` the
wait fails with an AssertionError naming `what` and the last value seen (or the last exception, where the
test allows the check to fail for a while with `retry_on`); `what` may be a function, called only then, for a
message that shows the state at the deadline (a log's tail, a process's output). An async check that hangs fails
the wait at the deadline rather than hanging the test.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

Check = Callable[[], Any] | Callable[[], Awaitable[Any]]
What = str | Callable[[], str]


def _said(what: What, check: object) -> str:
    return (what() if callable(what) else what) or repr(check)


def _timed_out(what: What, check: object, timeout_s: float, last: object) -> AssertionError:
    return AssertionError(f"timed out after {timeout_s} s waiting for {_said(what, check)}; last: {last!r}")


async def wait_until(
    check: Check,
    timeout_s: float,
    interval_s: float = 0.05,
    *,
    what: What = "",
    retry_on: tuple[type[BaseException], ...] = (),
) -> Any:
    """Poll `check` (plain or async) every `interval_s` until it returns something truthy; return it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last: object = None
    while True:
        try:
            got = check()
            if inspect.isawaitable(got):
                try:
                    got = await asyncio.wait_for(got, max(0.5, deadline - loop.time()))
                except TimeoutError:
                    raise _Hung() from None
        except _Hung:
            raise AssertionError(f"a check hung while waiting for {_said(what, check)}") from None
        except retry_on as exc:
            last = exc
        else:
            if got:
                return got
            last = got
        if loop.time() >= deadline:
            raise _timed_out(what, check, timeout_s, last)
        await asyncio.sleep(interval_s)


def wait_until_sync(
    check: Callable[[], Any],
    timeout_s: float,
    interval_s: float = 0.05,
    *,
    what: What = "",
    retry_on: tuple[type[BaseException], ...] = (),
) -> Any:
    """Poll `check` every `interval_s` until it returns something truthy; return it. Blocks the thread."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        try:
            got = check()
        except retry_on as exc:
            last = exc
        else:
            if got:
                return got
            last = got
        if time.monotonic() >= deadline:
            raise _timed_out(what, check, timeout_s, last)
        time.sleep(interval_s)


class _Hung(Exception):
    """An awaited check outlived the deadline (kept apart from the exceptions a test retries on)."""
