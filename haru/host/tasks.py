"""Stopping background tasks for certain.

`task.cancel()` once and `await task` is not enough on Python 3.11 with nats-py: asyncio.wait_for
returns the inner result and drops the cancellation when the awaited future completes in the same
loop turn (gh-86296, fixed in 3.12), and nats-py's flush path catches CancelledError and goes on.
nats-py awaits both on every request. A task that ate its cancellation keeps running (a watch
loop waits for the next message forever), and whoever awaits it hangs: seen as a gateway that
never stopped, on a loaded 2-core machine, once in about a hundred runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any

__all__ = ["cancel_and_wait", "run_until_signal"]


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None, retry_s: float = 1.0) -> None:
    """Cancel `tasks` and return once every one has ended, cancelling again each `retry_s` a task
    is still running. What the tasks ended with (a result, an exception) is retrieved and dropped:
    the caller is shutting them down. `None` entries are skipped, so optional tasks can be passed
    as they are. If the caller itself is cancelled meanwhile, that cancellation propagates."""
    given = [t for t in tasks if t is not None]
    pending = {t for t in given if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=retry_s)
    for task in given:
        if not task.cancelled():
            task.exception()  # retrieved, so asyncio does not log "exception was never retrieved"


async def run_until_signal(task: asyncio.Task[Any], signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> bool:
    """Await a service's `task` until it ends or one of `signals` arrives; then stop it for certain.

    Returns True when a signal stopped it. What the task raised propagates (a cancellation from
    elsewhere, too). A bare `add_signal_handler(sig, task.cancel)` leaves a process running after
    SIGTERM when the one cancellation is swallowed (see cancel_and_wait).
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    installed = []
    for sig in signals:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await cancel_and_wait(stopper)
        if not task.done():  # a signal, or the caller itself is being cancelled
            await cancel_and_wait(task)
    if stop.is_set():
        return True
    task.result()
    return False
