"""The GPU host against a real llama-server (on the CPU; the GPUs are simulated): one cold load at a time
per GPU in declaration order, and a model across two GPUs launched with llama.cpp's split flags."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest

from haru.agents.sim.gpu_state import GiB, SimGpuState
from haru.core import subjects
from tests.support.agent_harness import AgentProcess, agent_env, is_, tag, wait_event, write_config
from tests.support.llama import REAL_POLICY, llama_binary, llama_model, tiny_models

pytestmark = [pytest.mark.llama, pytest.mark.timeout(150)]
FLEET = "default"


@pytest.fixture(scope="module")
def llama():
    return llama_binary()


@pytest.fixture
def agents():
    started: list[AgentProcess] = []

    def start(config, log_path):
        a = AgentProcess(config, log_path, agent_env())
        started.append(a)
        return a

    yield start
    for a in started:
        a.kill()


def layout(tmp_path, models: list[dict], gpus=(0,)) -> object:
    domains = []
    for d in ("a", "b"):
        sim = tmp_path / "sim" / d
        sim.mkdir(parents=True, exist_ok=True)
        for i in gpus:
            SimGpuState(sim, i).ensure(24 * GiB)
        domains.append(
            {
                "name": d,
                "gpus": [{"index": i, "memory": "24GiB", "reserve": "1GiB"} for i in gpus],
                "slots": [{"name": "chat", "gpu": 0, "models": models}],
            }
        )
    path = tmp_path / "layout.json"
    path.write_text(json.dumps({"fleet": FLEET, "policy": REAL_POLICY, "domains": domains}))
    return path


async def test_real_llama_servers_load_one_at_a_time_in_declaration_order(
    tmp_path, llama, nats_server, event_log, agents
):
    names = ["m1", "m2", "m3"]
    gguf = tiny_models(tmp_path / "gguf", {n: i + 1 for i, n in enumerate(names)})
    path = layout(tmp_path, [llama_model(n, llama, gguf[n]) for n in names])
    cfg = write_config(
        tmp_path / "agent-a.json", nats_server.url, tmp_path, domain="a", layout=path, fleet=FLEET, role="active"
    )
    agent = agents(cfg, tmp_path / "agent-a.log")
    windows = []
    for n in names:
        resident = await wait_event(
            event_log, subjects.model(FLEET, "a", n), is_("model_resident"), agent=agent, timeout=90
        )
        recs = await event_log.history(subjects.model(FLEET, "a", n))
        spawned = next(r for r in recs if tag(r) == "model_loading" and r.event.pid)
        windows.append((n, spawned.seq, resident.seq))
    # each spawn comes after the previous model answered, in declaration order (stream sequences)
    for (_, _, done), (_, nxt, _) in pairwise(windows):
        assert done < nxt, windows
    waited = [
        r.event
        for r in await event_log.history(subjects.model(FLEET, "a", "m3"))
        if tag(r) == "model_loading" and not r.event.pid
    ]
    assert waited and "its turn on GPU 0" in waited[0].waiting_for


async def test_a_real_llama_server_across_two_gpus_gets_the_split_flags_and_serves(
    tmp_path, llama, nats_server, event_log, agents
):
    gguf = tiny_models(tmp_path / "gguf", {"tp": 7})
    path = layout(tmp_path, [llama_model("tp", llama, gguf["tp"], gpus=[0, 1])], gpus=(0, 1))
    cfg = write_config(
        tmp_path / "agent-a.json", nats_server.url, tmp_path, domain="a", layout=path, fleet=FLEET, role="active"
    )
    agent = agents(cfg, tmp_path / "agent-a.log")
    await wait_event(event_log, subjects.model(FLEET, "a", "tp"), is_("model_resident"), agent=agent, timeout=90)
    loading = next(
        r.event
        for r in await event_log.history(subjects.model(FLEET, "a", "tp"))
        if tag(r) == "model_loading" and r.event.pid
    )
    with open(f"/proc/{loading.pid}/cmdline", "rb") as fh:
        argv = fh.read().split(b"\0")
    with open(f"/proc/{loading.pid}/environ", "rb") as fh:
        env = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
    assert argv[argv.index(b"--split-mode") + 1] == b"layer" and argv[argv.index(b"--tensor-split") + 1] == b"1,1"
    assert env[b"CUDA_VISIBLE_DEVICES"] == b"0,1"
