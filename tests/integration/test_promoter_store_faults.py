"""An operation stuck behind a failing store ends once the store answers again.

A real nats-server is frozen (SIGSTOP: appends and commands time out), killed and started again on
its store, or its stream made to refuse every append (as full: max_msgs reached, discard new), in
the middle of a promotion run by a real `haru promoter` process. Once the
store answers, the operation completes or aborts: it is never left `running`.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from nats.js import api

from haru.core import subjects
from haru.core.events import OperationAborted, OperationCompleted, RouteMoved, StepStarted
from haru.host.natsd import NatsServer
from haru.log.apply import apply
from haru.log.requests import request_operation
from tests.support.clock import now
from tests.support.promoter import PromoterProcess, describe, op_events, view_of, wait_op_end
from tests.support.promoter_fake import FakeAgent, layout
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(150)
MODELS = ["m1", "m2"]


async def _started(log, op_id: str, step: str):
    for e in await op_events(log, op_id=op_id):
        if isinstance(e, StepStarted) and e.step == step:
            return e
    return None


async def refuse_writes(log, refuse: bool) -> None:
    """Make the event stream refuse every append (full: max_msgs reached, discard new), or stop."""
    info = await log.js.stream_info(subjects.EVENTS_STREAM)
    cfg = info.config
    cfg.max_msgs = info.state.messages if refuse else -1
    cfg.discard = api.DiscardPolicy.NEW if refuse else api.DiscardPolicy.OLD
    await log.js.update_stream(cfg)


@pytest.mark.parametrize("fault", ["frozen", "restarted", "refusing"])
async def test_an_operation_behind_a_failing_store_ends_once_the_store_answers(nats_server, event_log, tmp_path, fault):
    await apply(event_log, layout(), now())
    promoter = PromoterProcess(
        nats_server.url,
        "promoter:store",
        env={"HARU_PROMOTER_STEP_DELAY_MS": "300"},
        log_path=tmp_path / "promoter.log",
    )
    again: NatsServer | None = None
    async with (
        FakeAgent(nats_server.url, "default", "a", MODELS),
        FakeAgent(nats_server.url, "default", "b", MODELS, start="sleeping"),
    ):
        await event_log.append(subjects.route("default"), RouteMoved(at=now(), active="a"), expect=0)
        promoter.start()
        try:
            await asyncio.sleep(1.5)
            accepted = await request_operation(event_log, "default", "promotion", "b", by="test", now=now())
            await wait_until(lambda: _started(event_log, accepted.op_id, "wake"), 20, what="wake started")
            if fault == "frozen":
                os.kill(nats_server.proc.pid, signal.SIGSTOP)  # every append (5 s bound) and command times out
                await asyncio.sleep(6)
                os.kill(nats_server.proc.pid, signal.SIGCONT)
            elif fault == "refusing":
                await refuse_writes(event_log, True)
                await asyncio.sleep(6)
                await refuse_writes(event_log, False)
            else:
                nats_server.kill()
                await asyncio.sleep(4)
                again = NatsServer(nats_server.store_dir, port=nats_server.port)
                again.start_sync()
            end = await wait_op_end(event_log, accepted.op_id, timeout=90)
            events = await op_events(event_log, op_id=accepted.op_id)
            assert isinstance(end, (OperationCompleted, OperationAborted)), describe(events)
            view = await view_of(event_log)
            # (a later operation may run now, e.g. a demotion of the old active: not this one)
            assert view.operation is None or view.operation.op_id != accepted.op_id, describe(events)
            if isinstance(end, OperationCompleted):
                assert view.active == "b"
        finally:
            promoter.kill()
            if again is not None:
                again.stop_sync()
