"""A rolling change with a canary step (policy rolling_canary_weight): the standby takes its share of the
traffic after its probe and before the flip, recorded on the weights subject; the flip resets the weights.
Real nats-server, real agents over simulated runtimes, a `haru promoter` child process, the gateway."""

from __future__ import annotations

import json

import pytest

from haru.core import subjects
from haru.core.events import OperationCompleted, StepCompleted, StepStarted, WeightsSet
from haru.core.saga import flow
from tests.support.promoter import describe, op_events, wait_op_end, wait_view
from tests.support.rolling import apply_cli, context_4096, rolling_fleet, rolling_op_id
from tests.support.sim_fleet import FLEET, edit_layout


@pytest.mark.timeout(240)
async def test_a_rolling_change_gives_the_standby_a_canary_share_before_its_flip(tmp_path, nats_server, event_log):
    async with rolling_fleet(tmp_path, nats_server, event_log) as fleet:
        edit_layout(fleet.layout, context_4096)
        doc = json.loads(fleet.layout.read_text())
        doc.setdefault("policy", {}).update(rolling_canary_weight=30, rolling_canary_ms=1500)
        fleet.layout.write_text(json.dumps(doc))
        out = await apply_cli(nats_server.url, fleet.layout)
        assert out.returncode == 0, out.stderr
        op_id = await rolling_op_id(event_log)
        end = await wait_op_end(event_log, op_id, timeout=120, fleet=FLEET)
        events = await op_events(event_log, FLEET, op_id)
        assert isinstance(end, OperationCompleted), describe(events)
        assert [e.step for e in events if isinstance(e, StepStarted)] == flow("rolling"), describe(events)
        canary = next(e for e in events if isinstance(e, StepCompleted) and e.step == "canary")
        assert "b took 30% of the traffic for 1500 ms" in canary.detail, canary.detail
        sets = [r.event for r in await event_log.history(subjects.weights(FLEET))]
        assert [(type(e), e.reason, e.weights, e.op_id) for e in sets] == [
            (WeightsSet, "rolling", {"a": 70, "b": 30}, op_id)
        ]
        view = await wait_view(
            event_log, lambda v: v.active == "b" and v.operation is None, fleet=FLEET, what="b active"
        )
        assert view.weights == {}  # the flip reset them
