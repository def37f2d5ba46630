"""LoRA adapters served at run time on a simulated fleet (real agents, projector, promoter, gateway; the
simulated vLLM's runtime LoRA API): a published adapter is fetched, loaded, probed and served as
`<base>:<adapter>` through the gateway; a version whose probe fails never serves; a good new version goes
out as a canary and takes over; a failover wakes the standby with its adapters; no client request fails
throughout."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime

import aiohttp
import pytest

from haru.core import subjects
from haru.core.layout import load_layout
from haru.log.apply import apply
from haru.log.requests import request_operation
from tests.support import haru
from tests.support.adapters import canaried_then_promoted, publish, write_adapter
from tests.support.agent_harness import tag
from tests.support.promoter import wait_view
from tests.support.sim_fleet import FLEET, ChatLoad, residency_tags, sim_fleet, sim_layout, steady, tags_become

pytestmark = pytest.mark.timeout(150)
SERVED = "m1:sql"


def with_adapters(layout):
    doc = json.loads(layout.read_text())
    doc["policy"]["adapter_canary_ms"] = 1500
    for d in doc["domains"]:
        m1 = d["slots"][0]["models"][0]
        m1["max_loras"] = 2
        m1["adapter_probes"] = {"sql": [{"prompt": "SELECT", "expect": "sql-ok"}]}
    layout.write_text(json.dumps(doc))
    return layout


async def chat(url: str, model: str) -> tuple[int, str]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body) as r:
        raw = await r.json()
        return r.status, raw["choices"][0]["message"]["content"] if r.status == 200 else json.dumps(raw)


async def answers(url: str, model: str, want: str, timeout: float = 40) -> None:
    deadline = time.monotonic() + timeout
    got: tuple[int, str] = (0, "")
    while time.monotonic() < deadline:
        got = await chat(url, model)
        if got[0] == 200 and want in got[1]:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{model} never answered {want!r}: last {got}")


async def test_a_published_adapter_is_served_a_bad_version_is_rolled_back_and_a_good_one_takes_over(
    tmp_path, nats_server, event_log
):
    layout = with_adapters(sim_layout(tmp_path / "layout.json", tmp_path))
    async with sim_fleet(tmp_path, nats_server, event_log, layout) as f:
        await wait_view(event_log, steady, timeout=60, fleet=FLEET, what="a active and resident, b a standby")
        url = f.gw.url
        status, text = await chat(url, SERVED)
        assert status == 404 and "m1:sql" in text  # nothing published yet

        write_adapter(tmp_path / "v1", says="sql-ok v1")
        await publish(event_log, tmp_path / "v1", base="m1", adapter="sql", version="run-1")
        await answers(url, SERVED, "sql-ok v1")  # fetched, loaded, probed, routed: served
        status, base = await chat(url, "m1")
        assert status == 200 and "sql-ok" not in base  # the base model on the same runtime answers as itself

        async with ChatLoad(url, clients=4, models=(SERVED, "m1")) as load:
            write_adapter(tmp_path / "v2", says="sql-broken")
            await publish(event_log, tmp_path / "v2", base="m1", adapter="sql", version="run-2")
            view = await wait_view(
                event_log,
                lambda v: "run-2" in v.adapters.get(SERVED, None).rolled_back if SERVED in v.adapters else False,
                timeout=30,
                fleet=FLEET,
                what="run-2 rolled back by its probe",
            )
            why = view.adapters[SERVED].rolled_back["run-2"]
            assert "evaluation probe failed" in why and "sql-broken" in why, why
            assert view.adapters[SERVED].current == "run-1"

            write_adapter(tmp_path / "v3", says="sql-ok v3")
            await publish(event_log, tmp_path / "v3", base="m1", adapter="sql", version="run-3")
            view = await canaried_then_promoted(event_log, SERVED, "run-3", fleet=FLEET, timeout=60)
            assert view.adapters[SERVED].previous == "run-1"
            await answers(url, SERVED, "sql-ok v3")

            # A failover: the standby's runtime woke without the adapters (it slept through all of the above);
            # its wake loads and probes them before the route moves to it.
            asked = await request_operation(event_log, FLEET, "promotion", "b", by="test", now=datetime.now(UTC))
            assert asked.status == "accepted", asked
            view = await wait_view(
                event_log, lambda v: v.active == "b" and v.operation is None, timeout=60, fleet=FLEET, what="b active"
            )
            copy = view.adapters[SERVED].copy("b", "run-3")
            assert copy is not None and copy.state == "resident" and copy.probe == "passed", copy
            await answers(url, SERVED, "[domain b]")
        assert load.ok > 0 and load.failed == [], load.failed[:5]

        # what the active's runtime did, in order, on the base model's subject
        recs = await event_log.history(subjects.model(FLEET, "a", "m1"))
        seen = [(r.event.version, r.event.state) for r in recs if tag(r) == "adapter_state_changed"]
        assert ("run-2", "resident") in seen and ("run-2", "unloaded") in seen, seen  # loaded, probed, unloaded
        assert ("run-1", "unloaded") not in seen  # kept loaded: what a rollback returns to

    # `haru why m1:sql`: the served version's decision rests on its probe, which rests on the run that made it
    out = haru("why", SERVED, "--json", nats_url=nats_server.url)
    assert out.returncode == 0, out.stderr
    tree = json.loads(out.stdout)

    def walk(nodes, depth=0):
        for n in nodes:
            yield depth, n
            yield from walk(n["caused"], depth + 1)

    found = {
        (n["type"], n["event"].get("version"), n["event"].get("reason", n["event"].get("state"))): (d, n)
        for d, n in walk(tree)
    }
    depth, run3 = found[("adapter_published", "run-3", None)]
    assert run3["event"]["metrics"] == {"loss": 0.25} and run3["event"]["data"] == "tests/data.jsonl"
    chains = [[c["type"] for c in [n, *n["caused"]]] for n in run3["caused"]]
    assert ["adapter_state_changed", "adapter_routed", "adapter_routed"] in chains, chains  # canary, then promoted
    _, rolled = found[("adapter_routed", "run-2", "rolled_back")]
    assert "evaluation probe failed" in rolled["event"]["detail"]


async def test_max_loras_added_by_a_live_apply_restarts_the_runtime_and_serves_adapters(
    tmp_path, nats_server, event_log
):
    """No model takes adapters when the agents start; `haru apply` then gives m1 `max_loras`: the standby
    replaces m1 at once (its runtime restarts with --enable-lora) and starts following the adapters, the
    active's change waits for a failover, and after it the published adapter serves, without restarting an agent."""
    layout = sim_layout(tmp_path / "layout.json", tmp_path)
    async with sim_fleet(tmp_path, nats_server, event_log, layout, declared=True) as f:
        await wait_view(event_log, steady, timeout=60, fleet=FLEET, what="a active and resident, b a standby")
        pids = {d: p.proc.pid for d, p in f.agents.items()}
        since = len(await residency_tags(event_log, "b", "m1"))
        await apply(event_log, load_layout(with_adapters(layout)), datetime.now(UTC))
        await tags_become(
            event_log, "b", "m1", since, ["model_stopped", "model_loading", "model_resident", "model_sleeping"]
        )

        write_adapter(tmp_path / "v1", says="sql-ok v1")
        await publish(event_log, tmp_path / "v1", base="m1", adapter="sql", version="run-1")
        asked = await request_operation(event_log, FLEET, "promotion", "b", by="test", now=datetime.now(UTC))
        assert asked.status == "accepted", asked
        await wait_view(
            event_log, lambda v: v.active == "b" and v.operation is None, timeout=60, fleet=FLEET, what="b active"
        )
        await answers(f.gw.url, SERVED, "sql-ok v1")  # loaded by b's woken runtime, probed, routed
        view = await wait_view(
            event_log,
            lambda v: SERVED in v.adapters and v.adapters[SERVED].current == "run-1",
            timeout=30,
            fleet=FLEET,
            what="run-1 served",
        )
        copy = view.adapters[SERVED].copy("b", "run-1")
        assert copy is not None and copy.state == "resident" and copy.probe == "passed", copy
        assert {d: p.proc.pid for d, p in f.agents.items()} == pids  # no agent restarted
