"""Where the agent's slots come from: the fleet's declarations (haru apply), or its own config."""

from __future__ import annotations

import json
import signal
from datetime import UTC, datetime

import pytest

from haru.core import subjects
from haru.core.commands import Command
from haru.core.layout import load_layout
from haru.log.apply import apply
from haru.log.bus import send
from tests.support.agent_harness import (
    AgentProcess,
    agent_env,
    is_,
    sim_model,
    tag,
    wait_event,
    write_config,
    write_layout,
)

pytestmark = pytest.mark.timeout(90)


async def test_agent_reads_declared_layout_and_runs_only_admitted_models(tmp_path, nats_server, event_log, agents):
    # "big" does not fit on the 24 GiB card after "m1" and "m2": the planner refuses it at apply time.
    layout_path = write_layout(
        tmp_path / "layout.json", tmp_path, models={"m1": {}, "m2": {}, "big": {"vram": "20GiB"}}
    )
    await apply(event_log, load_layout(layout_path), datetime.now(UTC))
    cfg = write_config(tmp_path / "agent-a.json", nats_server.url, tmp_path, domain="a")  # no layout: the log's
    agent = agents(cfg, tmp_path / "agent-a.log")
    for name in ("m1", "m2"):
        await wait_event(event_log, subjects.model("f", "a", name), is_("model_resident"), agent=agent)
    status = await send(event_log.bus, "f", "a", "status", Command(), timeout=10)
    assert status.data["source"] == "declared"
    assert sorted(status.data["models"]) == ["m1", "m2"]
    assert status.data["not_admitted"]["big"] > 0
    assert await event_log.history(subjects.model("f", "a", "big")) == []  # never loaded
    assert status.data["role"] == "active"  # no route_moved yet: the first declared domain is active


async def test_undeclared_host_runs_from_its_config(tmp_path, nats_server, event_log, agents):
    sim_dir = tmp_path / "sim" / "a"
    sim_dir.mkdir(parents=True)
    host = {
        "gpus": [{"index": 0, "memory": "24GiB"}],
        "slots": [{"name": "chat", "gpu": 0, "models": [sim_model("solo", sim_dir, "a")]}],
    }
    cfg = write_config(
        tmp_path / "agent-a.json",
        nats_server.url,
        tmp_path,
        domain="a",
        host=host,
        policy={"probe_interval_ms": 200},
        role="active",
    )
    agent = agents(cfg, tmp_path / "agent-a.log")
    await wait_event(event_log, subjects.model("f", "a", "solo"), is_("model_resident"), agent=agent)
    status = await send(event_log.bus, "f", "a", "status", Command(), timeout=10)
    assert status.data["source"] == "config" and status.data["role"] == "active"
    agent.signal(signal.SIGINT)
    assert await agent.wait() == 0


async def test_role_follows_the_route_pointer(tmp_path, nats_server, event_log, agents):
    from haru.core.events import RouteMoved

    layout_path = write_layout(tmp_path / "layout.json", tmp_path)
    await event_log.append(subjects.route("f"), RouteMoved(at=datetime.now(UTC), active="b"), expect=0)
    cfg = write_config(tmp_path / "agent-a.json", nats_server.url, tmp_path, domain="a", layout=layout_path)
    agent = agents(cfg, tmp_path / "agent-a.log")
    # a is standby by the route: it loads, then sleeps
    await wait_event(event_log, subjects.model("f", "a", "m1"), is_("model_sleeping"), agent=agent)
    status = await send(event_log.bus, "f", "a", "status", Command(), timeout=10)
    assert status.data["role"] == "standby" and status.data["active_domain"] == "b"
    last = await event_log.last(subjects.route("f"))
    await event_log.append(
        subjects.route("f"), RouteMoved(at=datetime.now(UTC), active="a", previous="b"), expect=last.seq
    )
    for _ in range(50):
        status = await send(event_log.bus, "f", "a", "status", Command(), timeout=10)
        if status.data["role"] == "active":
            break
        import asyncio

        await asyncio.sleep(0.1)
    assert status.data["role"] == "active" and status.data["route_revision"] > last.seq


async def test_bad_config_fails_with_one_line(tmp_path, nats_server):
    cfg = tmp_path / "bad.json"
    cfg.write_text(json.dumps({"fleet": "f", "domain": "A!", "nats_url": nats_server.url}))
    agent = AgentProcess(cfg, tmp_path / "bad.log", agent_env())
    try:
        assert await agent.wait(20) == 1
        assert "domain name 'A!'" in agent.output()
    finally:
        agent.kill()


async def test_dry_run_prints_what_would_run(tmp_path, nats_server):
    from tests.support import haru

    layout = write_layout(tmp_path / "layout.json", tmp_path, models={"m1": {}, "big": {"vram": "22GiB"}}, training={})
    cfg = write_config(tmp_path / "agent-b.json", nats_server.url, tmp_path, domain="b", layout=layout)
    out = haru("agent", "--config", str(cfg), "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["role"] == "standby" and plan["source"].startswith("layout:")
    assert [m["name"] for m in plan["models"]] == ["m1"] and "big" in plan["not_admitted"]
    assert [t["slot"] for t in plan["training"]] == ["lora"]
    text = haru("agent", "--config", str(cfg), "--dry-run")
    assert text.returncode == 0 and "not admitted big" in text.stdout


async def test_llama_server_model_under_the_agent(tmp_path, nats_server, event_log, agents):
    import sys
    from pathlib import Path

    fake = [sys.executable, str(Path(__file__).parent / "agent_fakes" / "fake_llama_server.py")]
    layout = write_layout(tmp_path / "layout.json", tmp_path, training={"vram": "4GiB"})
    doc = json.loads(layout.read_text())
    for d in doc["domains"]:
        d["slots"][0]["models"] = [
            {
                "name": "gemma:2b",
                "runtime": "llama_server",
                "vram": "3GiB",
                "source": "/m/gemma.gguf",
                "binary": fake,
                "env": {"FAKE_LOAD_MS": "300"},
            }
        ]
    layout.write_text(json.dumps(doc))
    cfg = write_config(tmp_path / "agent-b.json", nats_server.url, tmp_path, domain="b", layout=layout)
    agent = agents(cfg, tmp_path / "agent-b.log")
    subject = subjects.model("f", "b", "gemma:2b")
    res = await wait_event(event_log, subject, is_("model_resident"), agent=agent)
    assert res.event.warmup_ms >= 300  # measured through the 503 "Loading model" phase
    # a standby: llama-server cannot sleep, stays resident, and training runs beside it
    await wait_event(event_log, subjects.training("f", "b", "lora"), is_("training_started"), agent=agent)
    reply = await send(event_log.bus, "f", "b", "sleep", Command(), timeout=10)
    assert reply.ok and "no sleep mode" in reply.data["models"]["gemma:2b"]["detail"]
    assert tag(await event_log.last(subject)) == "model_resident"
    wake = await send(event_log.bus, "f", "b", "wake", Command(), timeout=10)
    assert wake.ok, wake
