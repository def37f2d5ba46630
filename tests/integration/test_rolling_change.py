"""A layout change on the active domain rolls through the standby as a promoter operation (issue 14 item 3).

Real nats-server, real agents over simulated vLLM runtimes and GPUs, a real gateway, and promoters as
child processes (`haru promoter`) where a test kills one. `haru apply` of a changed model requests the
`rolling` operation: the standby applies it, is woken, probed and promoted, then the old active applies
it. `haru op` shows its steps; a promoter killed in the middle is resumed by the next; `haru op abort`
aborts it before the flip; one operation is in flight per fleet.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from haru.core import subjects
from haru.core.events import OperationAborted, OperationCompleted, RollingRequested, StepStarted
from haru.core.saga import flow
from haru.log.bus import send
from tests.support import haru
from tests.support.promoter import describe, op_events, wait_op_end, wait_view
from tests.support.rolling import apply_cli, context_4096, rolling_fleet, rolling_op_id
from tests.support.sim_fleet import FLEET, ChatLoad, edit_layout, residency_tags, tags_become
from tests.support.wait import wait_until


async def started(event_log, op_id: str, step: str) -> StepStarted | None:
    for e in await op_events(event_log, FLEET, op_id):
        if isinstance(e, StepStarted) and e.step == step:
            return e
    return None


@pytest.mark.timeout(240)
async def test_haru_apply_rolls_a_change_on_the_active_through_the_standby_under_load(tmp_path, nats_server, event_log):
    async with rolling_fleet(tmp_path, nats_server, event_log) as fleet:
        before = {(d, m): len(await residency_tags(event_log, d, m)) for d in ("a", "b") for m in ("m1", "m2")}
        async with (
            ChatLoad(fleet.gw.url, models=("m1",)) as untouched,
            ChatLoad(fleet.gw.url, clients=2, models=("m2",)) as changed,
        ):
            edit_layout(fleet.layout, context_4096)
            out = await apply_cli(nats_server.url, fleet.layout)
            assert out.returncode == 0, out.stderr
            op_id = await rolling_op_id(event_log)
            assert f"rolling change {op_id} requested for a/m2" in out.stdout, out.stdout
            end = await wait_op_end(event_log, op_id, timeout=120, fleet=FLEET)
            events = await op_events(event_log, FLEET, op_id)
            assert isinstance(end, OperationCompleted), describe(events)
            await asyncio.sleep(0.5)
        # every step once, in the table's order, each completed
        assert [e.step for e in events if isinstance(e, StepStarted)] == flow("rolling"), describe(events)
        assert "step_failed:" not in " ".join(describe(events))
        request = events[0]
        assert isinstance(request, RollingRequested) and request.target == "b" and request.source == "a"
        assert request.reason == "layout_changed" and request.cause > 0  # cites the model_changed
        view = await wait_view(
            event_log, lambda v: v.active == "b" and v.operation is None, fleet=FLEET, what="b active"
        )
        assert view.last_operation.kind == "rolling" and view.last_operation.state == "completed"
        # b replaced m2 before it was promoted; a replaced it once it was the standby (after the flip)
        b_m2 = (await residency_tags(event_log, "b", "m2"))[before[("b", "m2")] :]
        assert b_m2[:3] == ["model_stopped", "model_loading", "model_resident"], b_m2
        a_m2 = (await residency_tags(event_log, "a", "m2"))[before[("a", "m2")] :]
        assert "model_stopped" in a_m2 and a_m2[a_m2.index("model_stopped") :][:3] == [
            "model_stopped",
            "model_loading",
            "model_resident",
        ], a_m2
        assert a_m2.count("model_loading") == 1 and b_m2.count("model_loading") == 1, (a_m2, b_m2)  # once each
        assert "replaced m2" in next(
            e.detail
            for e in events
            if getattr(e, "step", "") == "apply_old_active" and type(e).__name__ == "StepCompleted"
        )
        # the untouched model: no residency event anywhere but the promotion's own sleep/wake, and no failed request
        for d in ("a", "b"):
            got = (await residency_tags(event_log, d, "m1"))[before[(d, "m1")] :]
            assert all(t in ("model_waking", "model_resident", "model_sleeping") for t in got), (d, got)
        assert untouched.failed == [] and untouched.ok > 20, (untouched.ok, untouched.failed[:5])
        assert changed.failed == [] and changed.ok > 0, (changed.ok, changed.failed[:5])
        reply = await send(event_log.nc, FLEET, "a", "status", timeout=10)
        assert reply.data["pending_layout"] == [] and reply.data["role"] == "standby", reply.data
        # haru op lists it and shows its steps; haru status shows it as the last operation
        listed = await asyncio.to_thread(haru, "op", "--fleet", FLEET, nats_url=nats_server.url)
        assert any(
            op_id in line and "rolling" in line and "completed" in line for line in listed.stdout.splitlines()
        ), listed.stdout
        shown = await asyncio.to_thread(haru, "op", op_id, "--json", nats_url=nats_server.url)
        doc = json.loads(shown.stdout)
        assert doc["kind"] == "rolling" and doc["state"] == "completed"
        assert [s["step"] for s in doc["steps"] if s["state"] == "completed"] == flow("rolling")
        status = await asyncio.to_thread(haru, "status", "--fleet", FLEET, nats_url=nats_server.url)
        assert f"rolling of b over a ({op_id}" in status.stdout, status.stdout


@pytest.mark.timeout(240)
async def test_a_promoter_killed_in_the_middle_of_a_rolling_change_is_resumed_by_the_next(
    tmp_path, nats_server, event_log
):
    async with rolling_fleet(tmp_path, nats_server, event_log, step_delay_ms=1000) as fleet:
        edit_layout(fleet.layout, context_4096)
        out = await apply_cli(nats_server.url, fleet.layout)
        assert out.returncode == 0, out.stderr
        op_id = await rolling_op_id(event_log)
        # killed while it runs the old active's apply: after the flip, so it can only go forward
        await wait_until(lambda: started(event_log, op_id, "apply_old_active"), 90, what="apply_old_active started")
        fleet.promoter.kill()
        await asyncio.sleep(1.5)
        assert (await wait_view(event_log, lambda v: True, fleet=FLEET)).operation is not None  # nobody drives it
        fleet.promoter.start()  # the next promoter (same --id: it re-runs its own step at once)
        end = await wait_op_end(event_log, op_id, timeout=90, fleet=FLEET)
        events = await op_events(event_log, FLEET, op_id)
        assert isinstance(end, OperationCompleted), describe(events)
        attempts = [e.attempt for e in events if isinstance(e, StepStarted) and e.step == "apply_old_active"]
        assert attempts == [1, 2], describe(events)
        routes = [r.event.active for r in await event_log.history(subjects.route(FLEET))]
        assert routes[-1] == "b" and routes.count("b") == 1, routes  # the route moved once
        reply = await send(event_log.nc, FLEET, "a", "status", timeout=10)
        assert reply.data["pending_layout"] == [], reply.data


@pytest.mark.timeout(240)
async def test_a_rolling_change_is_one_in_flight_and_abortable_before_the_flip(tmp_path, nats_server, event_log):
    # Each step pauses 2.5 s, so the flip is ~10 s after stop_training starts: room for three CLI runs (a
    # loaded CI machine took over 6 s for them, one after another, with 1.5 s steps).
    async with rolling_fleet(tmp_path, nats_server, event_log, step_delay_ms=2500) as fleet:
        edit_layout(fleet.layout, context_4096)
        out = await apply_cli(nats_server.url, fleet.layout)
        assert out.returncode == 0, out.stderr
        op_id = await rolling_op_id(event_log)
        await wait_until(lambda: started(event_log, op_id, "stop_training"), 60, what="stop_training started")
        # one operation in flight per fleet: another kind conflicts, the same one joins (asked at once)
        other, same = await asyncio.gather(
            asyncio.to_thread(haru, "promote", "a", "--fleet", FLEET, nats_url=nats_server.url),
            asyncio.to_thread(haru, "roll", "--fleet", FLEET, nats_url=nats_server.url),
        )
        assert other.returncode == 4 and op_id in other.stdout and "in flight" in other.stderr, (
            other.stdout,
            other.stderr,
        )
        assert same.returncode == 0 and same.stdout.strip() == op_id, (same.stdout, same.stderr)
        aborted = await asyncio.to_thread(
            haru, "op", "abort", op_id, "--why", "wrong context", nats_url=nats_server.url
        )
        assert aborted.returncode == 0, aborted.stderr
        end = await wait_op_end(event_log, op_id, timeout=30, fleet=FLEET)
        assert isinstance(end, OperationAborted) and end.error.endswith("wrong context"), end
        assert "flip" not in [e.step for e in await op_events(event_log, FLEET, op_id) if isinstance(e, StepStarted)]
        await asyncio.sleep(2.0)  # the step that was running finishes; its outcome is refused, nothing more runs
        assert [type(e).__name__ for e in await op_events(event_log, FLEET, op_id)][-1] == "OperationAborted"
        routes = [r.event.active for r in await event_log.history(subjects.route(FLEET))]
        assert routes[-1] == "a", routes  # routing did not move
        reply = await send(event_log.nc, FLEET, "a", "status", timeout=10)
        assert reply.data["pending_layout"] == ["m2"], reply.data  # the change still waits on the active
        again = await asyncio.to_thread(haru, "op", "abort", op_id, nats_url=nats_server.url)
        assert again.returncode == 0 and "already aborted" in again.stdout, (
            again.stdout,
            again.stderr,
            [
                f"{type(e).__name__}:{getattr(e, 'op_id', '')}:{getattr(e, 'step', '')}"
                for e in await op_events(event_log, FLEET)
            ],
        )
        # requested again, it rolls through
        rolled = await asyncio.to_thread(
            haru, "roll", "--fleet", FLEET, "--wait", "--timeout", "120", nats_url=nats_server.url, timeout=150
        )
        assert rolled.returncode == 0, (rolled.stdout, rolled.stderr)
        assert "apply_old_active" in rolled.stdout and "completed" in rolled.stdout
        reply = await send(event_log.nc, FLEET, "a", "status", timeout=10)
        assert reply.data["pending_layout"] == [], reply.data
        a_m2 = await residency_tags(event_log, "a", "m2")
        await tags_become(event_log, "a", "m2", len(a_m2), [], timeout=1)
