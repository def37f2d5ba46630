"""`haru apply` of a changed layout reaches running agents (issue 14 item 3, the agent's part).

Agents that read their slots from the declarations follow them: a new model is started, a removed one
stopped, a changed one replaced on the standby; the other models see no event; a change that would
interrupt a model the active domain serves waits there (`pending_layout`) until the domain is standby.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import pytest

from haru.core import subjects
from haru.core.layout import load_layout
from haru.log.apply import apply
from haru.log.bus import send
from tests.support.agent_harness import sim_model
from tests.support.promoter import wait_view
from tests.support.sim_fleet import (
    FLEET,
    MODELS,
    ChatLoad,
    edit_layout,
    residency_tags,
    sim_fleet,
    sim_layout,
    steady,
    tags_become,
)


@pytest.mark.timeout(150)
async def test_apply_reaches_running_agents_model_by_model(tmp_path, nats_server, event_log):
    layout = sim_layout(tmp_path / "layout.json", tmp_path)
    async with sim_fleet(tmp_path, nats_server, event_log, layout, declared=True) as fleet:
        await wait_view(event_log, steady, timeout=60, fleet=FLEET, what="a active and resident, b a standby")
        before = {(d, m): len(await residency_tags(event_log, d, m)) for d in ("a", "b") for m in MODELS}
        async with ChatLoad(fleet.gw.url, models=("m1",)) as load:
            # 1. a model added to both domains: started on both, live
            edit_layout(layout, lambda d, ms: ms.append(sim_model("m3", tmp_path / "sim" / d, d, vram="4GiB")))
            await apply(event_log, load_layout(layout), datetime.now(UTC))
            await tags_become(event_log, "a", "m3", 0, ["model_loading", "model_resident"])
            await tags_become(event_log, "b", "m3", 0, ["model_loading", "model_resident", "model_sleeping"])

            # 2. m3 removed, m2's context changed
            def change(d, ms):
                ms[:] = [m for m in ms if m["name"] != "m3"]
                for m in ms:
                    if m["name"] == "m2":
                        m["context_length"] = 4096

            edit_layout(layout, change)
            await apply(event_log, load_layout(layout), datetime.now(UTC))
            for d in ("a", "b"):
                await tags_become(
                    event_log,
                    d,
                    "m3",
                    0,
                    ["model_loading", "model_resident"] + (["model_sleeping"] if d == "b" else []) + ["model_stopped"],
                )
            # the standby replaces m2 at once (stopped, loaded anew, back to sleep)
            await tags_become(
                event_log,
                "b",
                "m2",
                before[("b", "m2")],
                ["model_stopped", "model_loading", "model_resident", "model_sleeping"],
            )
            await asyncio.sleep(1.0)
        # the active serves m2 as before: its change waits for the domain to be the standby
        assert (await residency_tags(event_log, "a", "m2"))[before[("a", "m2")] :] == []
        reply = await send(event_log.bus, FLEET, "a", "status", timeout=10)
        assert reply.data["pending_layout"] == ["m2"], reply.data
        # m1 was never touched, anywhere, and served throughout
        for d in ("a", "b"):
            assert (await residency_tags(event_log, d, "m1"))[before[(d, "m1")] :] == []
        assert load.failed == [] and load.ok > 20, (load.ok, load.failed[:5])

        # Rolled by hand: promote b (its m2 is the new one), and a, now the standby, applies the change.
        from haru.log.requests import request_operation

        since_a = len(await residency_tags(event_log, "a", "m2"))
        result = await request_operation(event_log, FLEET, "promotion", "b", by="test", now=datetime.now(UTC))
        assert result.status == "accepted", result
        await wait_view(
            event_log, lambda v: v.active == "b" and v.operation is None, timeout=60, fleet=FLEET, what="b promoted"
        )
        got = await tags_become(
            event_log,
            "a",
            "m2",
            since_a,
            ["model_sleeping", "model_stopped", "model_loading", "model_resident", "model_sleeping"],
        )
        assert got[0] == "model_sleeping"  # settled as the old active first: the change came after the saga
        ops = [type(r.event).__name__ for r in await event_log.history(subjects.op(FLEET))]
        assert "StepFailed" not in ops, ops
        reply = await send(event_log.bus, FLEET, "a", "status", timeout=10)
        assert reply.data["pending_layout"] == [], reply.data


@pytest.mark.timeout(60)
async def test_apply_dry_run_says_the_path_each_change_takes(tmp_path, nats_server, event_log):
    from tests.support import haru

    layout = sim_layout(tmp_path / "layout.json", tmp_path)
    await apply(event_log, load_layout(layout), datetime.now(UTC))

    def change(d, ms):
        ms[:] = [m for m in ms if m["name"] != "m1"]
        ms.append(sim_model("m3", tmp_path / "sim" / d, d, vram="4GiB"))
        for m in ms:
            if m["name"] == "m2":
                m["context_length"] = 4096

    edit_layout(layout, change)
    declared = len(await event_log.history(subjects.decl(FLEET)))
    out = await asyncio.to_thread(haru, "apply", "-f", str(layout), "--dry-run", "--json", nats_url=nats_server.url)
    assert out.returncode == 0, out.stderr
    paths = json.loads(out.stdout)["paths"]
    by = {line.split(":", 1)[0]: line for line in paths}
    assert "started live" in by["a/m3"] and "started live" in by["b/m3"]
    assert "stopped live" in by["a/m1"] and "stopped live" in by["b/m1"]
    # before any route_moved the first declared domain is the active one
    assert "ACTIVE" in by["a/m2"] and "rolling change" in by["a/m2"]
    assert "replaced live" in by["b/m2"]
    assert len(await event_log.history(subjects.decl(FLEET))) == declared  # the dry run appended nothing
    text = await asyncio.to_thread(haru, "apply", "-f", str(layout), "--dry-run", nats_url=nats_server.url)
    assert "how each change reaches the running agents (active domain: a" in text.stdout, text.stdout


@pytest.mark.timeout(120)
async def test_a_grown_model_that_leaves_another_unadmitted_is_named_by_the_dry_run_and_by_why(
    tmp_path, nats_server, event_log
):
    """Growing m1 leaves m2 short on the card: the dry run says the active's m2 would be unloaded and why,
    and once applied `haru why` says it is no longer admitted, with the shortfall (not 'no longer in the layout')."""
    from tests.support import haru

    layout = sim_layout(tmp_path / "layout.json", tmp_path)
    async with sim_fleet(tmp_path, nats_server, event_log, layout, declared=True):
        await wait_view(event_log, steady, timeout=60, fleet=FLEET, what="a active and resident, b a standby")

        def grow(d, ms):
            for m in ms:
                if m["name"] == "m1":
                    m["vram"] = m["env"]["HARU_SIM_VRAM"] = "20GiB"

        edit_layout(layout, grow)
        dry = await asyncio.to_thread(haru, "apply", "-f", str(layout), "--dry-run", nats_url=nats_server.url)
        assert dry.returncode == 0, dry.stderr
        assert (
            "a/m2 (serving) is unloaded and left unadmitted on the ACTIVE domain a: no longer admitted, short by "
            "1.0 GiB on GPU 0"
        ) in dry.stdout, dry.stdout
        assert "b/m2 (sleeping) is unloaded and left unadmitted on b" in dry.stdout
        since = len(await residency_tags(event_log, "a", "m2"))
        await apply(event_log, load_layout(layout), datetime.now(UTC))
        await tags_become(event_log, "a", "m2", since, ["model_stopped"])
        why = await asyncio.to_thread(haru, "why", "m2", "--domain", "a", nats_url=nats_server.url)
        assert why.returncode == 0, why.stderr
        assert "no longer admitted: short by 1.0 GiB" in why.stdout and "no longer has this model" not in why.stdout
