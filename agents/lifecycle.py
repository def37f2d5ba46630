"""The agent's life: whether it is stopping and why, whether its runtimes outlive it, and the tasks it started.

Built first, so every part that asks `stopping()` or starts a task of its own (`spawn`) is handed it.
`request_stop` ends `stopped()`; the shutdown (agents/agent.py) marks `begin_stopping` and waits for the
tasks. A task that fails is logged with its traceback (nobody else awaits it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

__all__ = ["Lifecycle"]


class Lifecycle:
    def __init__(self, logger: Any) -> None:
        self.logger = logger
        self.tasks: list[asyncio.Task[Any]] = []
        self.reason = ""  # why the agent stops ("" until asked)
        self.keep_runtimes = False  # leave every runtime serving for the next agent to adopt
        self._stopping = False
        self.stop_event = asyncio.Event()

    def stopping(self) -> bool:
        """Whether the agent is on its way out (an append is bounded then, loops end)."""
        return self._stopping

    def begin_stopping(self) -> None:
        self._stopping = True

    def keeps_runtimes(self) -> bool:
        return self.keep_runtimes

    def request_stop(self, reason: str = "", *, keep_runtimes: bool = False) -> None:
        self.reason = reason or "requested"
        self.keep_runtimes = keep_runtimes
        self.stop_event.set()

    def stop_requested(self) -> bool:
        return self.stop_event.is_set()

    async def stopped(self) -> None:
        """Until a stop is requested."""
        await self.stop_event.wait()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Start a task the agent owns: cancelled and awaited when the agent stops."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self.tasks.append(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.logger.error("agent task failed", task=task.get_name(), error=repr(exc), exc_info=exc)
