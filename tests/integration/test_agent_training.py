"""Training on a standby agent: started after its runtimes sleep, stopped by SIGTERM then SIGKILL."""

from __future__ import annotations

import json
import os

import msgspec
import pytest

from haru.core import subjects
from haru.core.commands import Command, Reply
from haru.log.bus import send
from tests.support.agent_harness import agent_env, is_, tag, wait_event, write_config, write_layout

pytestmark = pytest.mark.timeout(90)


async def start_standby(tmp_path, nats_server, event_log, agents, *, training: dict, env=None):
    layout = write_layout(tmp_path / "layout.json", tmp_path, training=training)
    cfg = write_config(tmp_path / "agent-b.json", nats_server.url, tmp_path, domain="b", layout=layout)
    agent = agents(cfg, tmp_path / "agent-b.log", env)
    # standby: loaded, then put to sleep, then training started in the freed VRAM
    await wait_event(event_log, subjects.model("f", "b", "m1"), is_("model_sleeping"), agent=agent)
    started = await wait_event(event_log, subjects.training("f", "b", "lora"), is_("training_started"), agent=agent)
    log = tmp_path / "state" / "b" / "training-lora.log"  # the trainer is up once it says it trains
    await wait_event(
        event_log,
        subjects.training("f", "b", "lora"),
        lambda r: log.exists() and "training on GPU" in log.read_text(),
        agent=agent,
    )
    return agent, started


async def test_standby_sleeps_then_trains_with_exactly_the_contracts_added_variables(
    tmp_path, nats_server, event_log, agents
):
    env = agent_env(HARU_TEST_MARKER="x y z")
    env.pop("CUDA_DEVICE_ORDER", None)  # the agent adds it: the test must see it added
    agent, started = await start_standby(tmp_path, nats_server, event_log, agents, training={}, env=env)
    env_file = tmp_path / "ckpt" / "b" / "env.json"
    await wait_event(event_log, subjects.training("f", "b", "lora"), lambda r: env_file.exists(), agent=agent)
    seen = json.loads(env_file.read_text())
    # CUDA_DEVICE_ORDER: CUDA numbers the cards as NVML does, so $HARU_GPU_INDEX names the same card
    expected = dict(
        env, HARU_CHECKPOINT_DIR=str(tmp_path / "ckpt" / "b"), HARU_GPU_INDEX="0", CUDA_DEVICE_ORDER="PCI_BUS_ID"
    )
    assert seen == expected
    assert set(seen) - set(env) == {"HARU_CHECKPOINT_DIR", "HARU_GPU_INDEX", "CUDA_DEVICE_ORDER"}
    # its own process group
    assert os.getpgid(started.event.pid) == started.event.pid


async def test_trainer_that_exits_on_sigterm_is_terminated(tmp_path, nats_server, event_log, agents):
    agent, started = await start_standby(tmp_path, nats_server, event_log, agents, training={})
    reply = await send(event_log.bus, "f", "b", "stop_training", Command(op_id="op1"), timeout=10)
    assert reply.ok, reply
    assert reply.data["slots"]["lora"]["how"] == "terminated"
    stopped = await event_log.last(subjects.training("f", "b", "lora"))
    assert tag(stopped) == "training_stopped" and stopped.event.how == "terminated" and stopped.event.exit_code == 0
    # idempotent: stopping stopped training is ok and records nothing new
    again = await send(event_log.bus, "f", "b", "stop_training", Command(op_id="op1"), timeout=10)
    assert again.ok and again.data["slots"]["lora"]["was_running"] is False
    assert (await event_log.last(subjects.training("f", "b", "lora"))).seq == stopped.seq
    # verify_gpu: the trainer's pid is gone from the GPU and its VRAM is free for the wake
    verify = await send(event_log.bus, "f", "b", "verify_gpu", Command(op_id="op1"), timeout=10)
    assert verify.ok, verify
    assert verify.data["gpus"]["0"]["trainer_pids"] == []
    assert verify.data["gpus"]["0"]["free_bytes"] >= verify.data["gpus"]["0"]["needed_bytes"] > 0


async def test_stop_training_then_verify_answers_the_gpus_as_training_stopped(tmp_path, nats_server, event_log, agents):
    """`then_verify`: the promoter's verify_gpu answered in stop_training's own trip (haru.promoter.chain)."""
    await start_standby(tmp_path, nats_server, event_log, agents, training={})
    reply = await send(event_log.bus, "f", "b", "stop_training", Command(op_id="op1", then_verify=True), timeout=10)
    assert reply.ok and reply.data["slots"]["lora"]["how"] == "terminated", reply
    verified = msgspec.convert(reply.data["verify_gpu"], Reply)
    assert verified.ok, verified
    assert verified.data["gpus"]["0"]["trainer_pids"] == []
    assert verified.data["gpus"]["0"]["free_bytes"] >= verified.data["gpus"]["0"]["needed_bytes"] > 0
    plain = await send(event_log.bus, "f", "b", "stop_training", Command(op_id="op1"), timeout=10)
    assert "verify_gpu" not in plain.data  # asked for only


async def test_trainer_ignoring_sigterm_is_killed_after_grace(tmp_path, nats_server, event_log, agents):
    agent, started = await start_standby(
        tmp_path, nats_server, event_log, agents, training={"extra": ["--ignore-sigterm"], "grace_ms": 700}
    )
    # while it runs, verify_gpu refuses: training holds the GPU
    busy = await send(event_log.bus, "f", "b", "verify_gpu", Command(), timeout=10)
    assert not busy.ok and busy.error.code == "training_running"
    reply = await send(event_log.bus, "f", "b", "stop_training", Command(), timeout=10)
    assert reply.ok and reply.data["slots"]["lora"]["how"] == "killed"
    assert reply.took_ms >= 700  # the grace was given before SIGKILL
    stopped = await event_log.last(subjects.training("f", "b", "lora"))
    assert stopped.event.how == "killed" and stopped.event.exit_code == -9
    with pytest.raises(ProcessLookupError):
        os.kill(started.event.pid, 0)
    # start_training while the models sleep: runs again
    again = await send(event_log.bus, "f", "b", "start_training", Command(), timeout=10)
    assert again.ok, again
    assert tag(await event_log.last(subjects.training("f", "b", "lora"))) == "training_started"


async def test_standby_restart_makes_room_reloads_sleeps_and_resumes_training(tmp_path, nats_server, event_log, agents):
    agent, started = await start_standby(tmp_path, nats_server, event_log, agents, training={})
    model = subjects.model("f", "b", "m1")
    loading = (await event_log.history(model))[0].event
    os.kill(loading.pid, 9)
    lost = await wait_event(event_log, model, is_("model_lost", reason="process_exited"), agent=agent)
    slept = await wait_event(event_log, model, lambda r: tag(r) == "model_sleeping" and r.seq > lost.seq, agent=agent)
    resumed = await wait_event(
        event_log,
        subjects.training("f", "b", "lora"),
        lambda r: tag(r) == "training_started" and r.seq > slept.seq,
        agent=agent,
    )
    # The order, across subjects (stream sequences are global): lost, training stopped, loading, resident,
    # sleeping, training started again.
    recs = [
        r
        for r in await event_log.history("haru.evt.f.b.>")
        if r.seq > lost.seq and r.seq <= resumed.seq and (".model." in r.subject or ".training." in r.subject)
    ]
    assert [tag(r) for r in recs] == [
        "training_stopped",
        "model_loading",
        "model_resident",
        "model_sleeping",
        "training_started",
    ]
    assert recs[0].event.how == "terminated" and recs[1].event.attempt == 2


async def test_promotion_steps_against_a_training_standby(tmp_path, nats_server, event_log, agents):
    """What the promoter does to a standby: stop training, verify the VRAM, wake, probe. Then demote it back."""
    agent, started = await start_standby(tmp_path, nats_server, event_log, agents, training={"vram": "16GiB"})
    nc = event_log.bus
    # the trainer holds 16 GiB of the 24: the sleeping 4 GiB model could not wake now
    busy = await send(nc, "f", "b", "verify_gpu", Command(op_id="p"), timeout=10)
    assert not busy.ok and busy.error.code == "training_running"
    assert busy.data["gpus"]["0"]["trainer_pids"] == [started.event.pid]
    refused = await send(nc, "f", "b", "start_training", Command(op_id="p"), timeout=10)
    assert refused.ok  # already running: idempotent
    assert (await send(nc, "f", "b", "stop_training", Command(op_id="p"), timeout=10)).ok
    verified = await send(nc, "f", "b", "verify_gpu", Command(op_id="p"), timeout=10)
    assert verified.ok, verified
    wake = await send(nc, "f", "b", "wake", Command(op_id="p"), timeout=10)
    assert wake.ok, wake
    probe = await send(nc, "f", "b", "probe", Command(op_id="p"), timeout=10)
    assert probe.ok, probe
    # while its model is awake, training on that GPU is refused
    no = await send(nc, "f", "b", "start_training", Command(op_id="p"), timeout=10)
    assert not no.ok and no.error.code == "gpu_busy"
    # demote: sleep, then training resumes from its checkpoint
    assert (await send(nc, "f", "b", "sleep", Command(op_id="d"), timeout=10)).ok
    yes = await send(nc, "f", "b", "start_training", Command(op_id="d"), timeout=10)
    assert yes.ok, yes


async def test_start_training_refused_on_the_active_domain(tmp_path, nats_server, event_log, agents):
    layout = write_layout(tmp_path / "layout.json", tmp_path, training={})
    cfg = write_config(tmp_path / "agent-a.json", nats_server.url, tmp_path, domain="a", layout=layout)
    agent = agents(cfg, tmp_path / "agent-a.log")
    await wait_event(event_log, subjects.model("f", "a", "m1"), is_("model_resident"), agent=agent)
    assert (await send(event_log.bus, "f", "a", "sleep", Command(), timeout=10)).ok
    no = await send(event_log.bus, "f", "a", "start_training", Command(), timeout=10)
    assert not no.ok and no.error.code == "domain_active"
    assert await event_log.history(subjects.training("f", "a", "lora")) == []


async def test_trainer_that_finishes_by_itself_is_exited(tmp_path, nats_server, event_log, agents):
    layout = write_layout(tmp_path / "layout.json", tmp_path, training={"extra": ["--exit-after-ms", "300"]})
    cfg = write_config(tmp_path / "agent-b.json", nats_server.url, tmp_path, domain="b", layout=layout)
    agent = agents(cfg, tmp_path / "agent-b.log")
    stopped = await wait_event(event_log, subjects.training("f", "b", "lora"), is_("training_stopped"), agent=agent)
    assert stopped.event.how == "exited" and stopped.event.exit_code == 0 and stopped.event.ran_ms >= 300
    status = await send(event_log.bus, "f", "b", "status", Command(), timeout=10)
    assert status.data["training"]["lora"]["running"] is False
    assert status.data["training"]["lora"]["last_stop"] == {"how": "exited", "exit_code": 0}
