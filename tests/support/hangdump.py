"""When a test is about to hit its pytest-timeout, print where every asyncio task is waiting.

pytest-timeout shows only the main thread, which in an async test is the event loop's `select()`:
it says that something hangs, not what. This prints each task of the running loop and the chain of
coroutines it is suspended in, a few seconds before the timeout fires. (How the CI hang fixed by
haru.host.tasks.cancel_and_wait was found: a watch task "cancelling" yet waiting for its next message.)
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading

import pytest


def _awaiting(coro: object) -> list[str]:
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        lines.append(f"    {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        nxt = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)
        if nxt is not None and not any(hasattr(nxt, a) for a in ("cr_frame", "ag_frame", "gi_frame")):
            lines.append(f"    awaiting {nxt!r}"[:240])
            break
        coro = nxt
    return lines


def dump_tasks(why: str) -> None:
    out = [f"\n===== asyncio tasks ({why}) ====="]
    for obj in gc.get_objects():
        if isinstance(obj, asyncio.AbstractEventLoop) and obj.is_running():
            for task in list(asyncio.all_tasks(obj)):
                state = "cancelling" if task.cancelling() else "pending"
                out.append(f"  task {task.get_name()} ({state})")
                out.extend(_awaiting(task.get_coro()))
    print("\n".join(out), file=sys.stderr, flush=True)


@pytest.fixture(autouse=True)
def _dump_tasks_before_timeout(request):
    marker = request.node.get_closest_marker("timeout")
    timeout = float(marker.args[0]) if marker and marker.args else float(request.config.getini("timeout") or 0)
    if timeout <= 10:
        yield
        return
    timer = threading.Timer(timeout - 5, dump_tasks, args=(f"{request.node.nodeid} is about to time out",))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
