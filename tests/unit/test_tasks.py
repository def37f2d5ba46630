"""cancel_and_wait ends tasks that swallow a cancellation, as nats-py's request path can."""

from __future__ import annotations

import asyncio

import pytest

from haru.host.tasks import cancel_and_wait

pytestmark = pytest.mark.timeout(30)


async def _swallows_one_cancel(started: asyncio.Event) -> None:
    """Like nats-py's `_flush_pending`: catches CancelledError and carries on, into a long wait."""
    started.set()
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        pass
    await asyncio.sleep(3600)


async def test_one_cancel_is_not_enough_for_a_task_that_swallows_it():
    started = asyncio.Event()
    task = asyncio.create_task(_swallows_one_cancel(started))
    await started.wait()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=0.2)
    assert not done  # the hang cancel_and_wait exists for
    await cancel_and_wait(task, retry_s=0.05)
    assert task.cancelled()


async def test_a_cancellation_lost_in_wait_for_is_repeated():
    """gh-86296 on 3.11: wait_for returns the result when its future completes as the task is
    cancelled, and the task goes on. cancel_and_wait ends it anyway, on any Python."""
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    got: list[int] = []

    async def request_then_wait() -> None:
        got.append(await asyncio.wait_for(fut, 60))
        await asyncio.sleep(3600)

    task = asyncio.create_task(request_then_wait())
    await asyncio.sleep(0)  # the task is inside wait_for now
    fut.set_result(1)
    await cancel_and_wait(task, retry_s=0.05)
    assert task.done()


async def test_results_and_errors_are_collected_and_none_is_skipped():
    async def fails() -> None:
        raise RuntimeError("boom")

    async def returns() -> int:
        return 7

    failing, returning = asyncio.create_task(fails()), asyncio.create_task(returns())
    await asyncio.sleep(0)
    await cancel_and_wait(None, failing, returning, None)
    assert failing.done() and returning.done()
    await cancel_and_wait()  # nothing to do is fine


async def test_the_callers_own_cancellation_propagates():
    started = asyncio.Event()
    stubborn = asyncio.create_task(_swallows_one_cancel(started))
    await started.wait()
    stopper = asyncio.create_task(cancel_and_wait(stubborn, retry_s=10))
    await asyncio.sleep(0.05)
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    await cancel_and_wait(stubborn, retry_s=0.05)
    assert stubborn.cancelled()


async def test_a_signal_stops_a_service_that_swallows_its_first_cancellation():
    import os
    import signal

    from haru.host.tasks import run_until_signal

    started = asyncio.Event()
    service = asyncio.create_task(_swallows_one_cancel(started))
    await started.wait()
    asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGUSR1)
    assert await run_until_signal(service, signals=(signal.SIGUSR1,)) is True
    assert service.done()


async def test_a_service_that_fails_on_its_own_raises_through_run_until_signal():
    import signal

    from haru.host.tasks import run_until_signal

    async def fails() -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("the log follower stopped")

    with pytest.raises(RuntimeError, match="follower stopped"):
        await run_until_signal(asyncio.create_task(fails()), signals=(signal.SIGUSR1,))

    async def returns() -> None:
        return None

    assert await run_until_signal(asyncio.create_task(returns()), signals=(signal.SIGUSR1,)) is False
