"""Asking the log again while it is between leaders.

A stream has no leader for a moment after a planned step-down (`haru promoter --stream-leaders`), and for
seconds while a cluster starts or elects after losing a node. A service that reads the log to start (the
promoter's resume, the projector's stored views) asks again for a while instead of exiting on the first
`LogUnavailable`, as the log's follower does once running (haru/log/follow.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from haru.core.errors import LogUnavailable

__all__ = ["START_WAIT_S", "until_available"]

T = TypeVar("T")

START_WAIT_S = 60.0  # a leader election takes 4-9 s; a cluster that just formed, longer


async def until_available(
    call: Callable[[], Awaitable[T]],
    *,
    within_s: float = START_WAIT_S,
    pause_s: float = 1.0,
    on_retry: Callable[[LogUnavailable], None] | None = None,
) -> T:
    """`await call()`, called again while it raises `LogUnavailable`, for up to `within_s`; then its error.
    Each call starts over: `call` must not leave half its work behind when it raises."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        try:
            return await call()
        except LogUnavailable as exc:
            if loop.time() + pause_s > deadline:
                raise
            if on_retry is not None:
                on_retry(exc)
            await asyncio.sleep(pause_s)
