"""The agent's long-running loops keep going through a failing step, and say so.

A loop body that raises (a bug, a NATS hiccup, an NVML read that throws) is logged with its traceback
and counted, by loop name, in `LoopErrors` (exported as `haru_agent_loop_errors_total{loop}` by
agents/metrics.py); the loop then waits its interval and goes on. Nothing is swallowed silently.

    errors = LoopErrors()
    await every(1.0, beat, name="heartbeat", errors=errors, logger=log)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["LoopErrors", "every", "on_the_way_out", "survive"]


class LoopErrors:
    """How many times each named loop's step raised (and was logged, and the loop went on)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def count(self, loop: str) -> int:
        self.counts[loop] = self.counts.get(loop, 0) + 1
        return self.counts[loop]

    def __getitem__(self, loop: str) -> int:
        return self.counts.get(loop, 0)


async def survive(
    step: Callable[[], Awaitable[Any]], *, name: str, errors: LoopErrors, logger: Any, **context: Any
) -> bool:
    """Run one step of loop `name`; if it raises, log the traceback, count it, and return False."""
    try:
        await step()
        return True
    except asyncio.CancelledError:
        raise
    except Exception:
        n = errors.count(name)
        logger.exception("agent loop step failed; the loop goes on", loop=name, errors=n, **context)
        return False


async def every(
    interval_s: float | Callable[[], float],
    step: Callable[[], Awaitable[Any]],
    *,
    name: str,
    errors: LoopErrors,
    logger: Any,
) -> None:
    """Run `step` every `interval_s` (a number, or read each round) until cancelled; a raising step is
    logged and counted, never the end of the loop."""
    while True:
        await survive(step, name=name, errors=errors, logger=logger)
        await asyncio.sleep(interval_s() if callable(interval_s) else interval_s)


async def on_the_way_out(what: str, step: Awaitable[Any], *, logger: Any) -> None:
    """One step of a shutdown: awaited; a failure is logged with its traceback, and the shutdown goes on."""
    try:
        await step
    except Exception:
        logger.exception("a shutdown step failed; going on", step=what)
