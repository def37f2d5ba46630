"""A training slot's checkpoints travel with it: the example LoRA trainer (real PEFT, on the CPU) trains on the
standby b of a simulated two-domain fleet, a failover stops it (SIGTERM: it checkpoints and exits), and when the
old active a rejoins as the standby its agent fetches b's newest checkpoint from the `haru_checkpoints` bucket,
resumes from it, finishes the run and publishes the adapter. a's host never had b's checkpoint directory."""

from __future__ import annotations

import json
import re

import pytest

from haru.core import subjects
from haru.core.layout import load_layout
from haru.log.apply import apply
from haru.log.training_objects import JsObjects
from tests.support.agent_harness import (
    AgentProcess,
    agent_env,
    is_,
    kill_agents,
    wait_event,
    write_config,
    write_layout,
)
from tests.support.clock import now
from tests.support.failover_sim import FLEET, POLICY, sim, steady
from tests.support.promoter import promoters, wait_view
from tests.support.trainer import TRAINER_ENV, latest_step, tiny_data, tiny_model, train_command
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(240)

STEPS, EVERY = 400, 10


async def test_training_stopped_by_a_failover_resumes_on_the_other_domain_and_publishes(
    tmp_path, nats_server, event_log
):
    model, data = tiny_model(tmp_path / "model"), tiny_data(tmp_path / "data.jsonl")
    layout = write_layout(
        tmp_path / "layout.json", tmp_path, training={"vram": "8GiB", "grace_ms": 20000}, policy=POLICY, fleet=FLEET
    )
    doc = json.loads(layout.read_text())
    for d in doc["domains"]:
        d["slots"][-1]["command"] = train_command(model, data, steps=STEPS, every=EVERY)
    layout.write_text(json.dumps(doc))
    await apply(event_log, load_layout(layout), now())
    ckpt = {d: tmp_path / "ckpt" / d for d in ("a", "b")}
    trainer_log = {d: tmp_path / "state" / d / "training-lora.log" for d in ("a", "b")}
    procs = [
        AgentProcess(
            write_config(tmp_path / f"agent-{d}.json", nats_server.url, tmp_path, domain=d, layout=layout, fleet=FLEET),
            tmp_path / f"agent-{d}.log",
            agent_env(**TRAINER_ENV),
        )
        for d in ("a", "b")
    ]
    bucket = JsObjects(event_log.js, subjects.CHECKPOINTS_BUCKET)
    try:
        async with promoters(nats_server.url):
            await wait_view(event_log, lambda v: steady(v, "a"), timeout=60, fleet=FLEET, what="a active, b training")
            # b trains and its agent uploads its checkpoints (one object for the fleet's slot, replaced)
            uploaded = await wait_until(
                lambda: bucket.info(f"{FLEET}/lora"), 120, what=lambda: trainer_log["b"].read_text()[-1500:]
            )
            assert uploaded.note.startswith("step-")
            # the failover: a's runtime dies, the promoter stops b's training (SIGTERM), wakes b, moves the route
            sim(tmp_path, "kill-runtime", "a", "m1")
            stopped = await wait_event(
                event_log, subjects.training(FLEET, "b", "lora"), is_("training_stopped"), timeout=60, agent=procs[1]
            )
            assert stopped.event.how == "terminated" and stopped.event.exit_code == 0
            b_said = trainer_log["b"].read_text()
            assert "stopped by SIGTERM" in b_said, b_said[-1500:]
            b_done = latest_step(ckpt["b"])  # it checkpointed the step it was in before it exited
            assert 0 < b_done < STEPS
            # a rejoins as the standby and trains: from b's checkpoint, fetched from the bucket
            published = await wait_event(
                event_log, subjects.training(FLEET, "a", "lora"), is_("adapter_published"), timeout=150, agent=procs[0]
            )
    finally:
        kill_agents(procs)
    a_said = trainer_log["a"].read_text()
    resumed = re.search(r"resumed from step-0*(\d+)-(\S+) at step (\d+)", a_said)
    assert resumed, a_said[:1500]
    a_from = int(resumed.group(3))
    # what a failover lost: the steps b trained after the checkpoint a resumed from (at most what b's agent had
    # not uploaded when a fetched: b's SIGTERM checkpoint is normally there already)
    lost = b_done - a_from
    assert 0 <= lost <= EVERY, (b_done, a_from)
    # (a may have trained a little itself before the first route settled: what counts is the resumed run)
    first = [line for line in a_said[resumed.start() :].splitlines() if line.startswith("step ")][0]
    assert first.startswith(f"step {a_from + 1} "), first
    e = published.event
    assert e.metrics["steps"] == STEPS and e.domain == "a" and e.version == resumed.group(2)  # b's run, finished by a
    assert not (ckpt["a"] / "latest").exists()
    assert await bucket.info(f"{FLEET}/lora") is None  # the run is over: nothing left to resume anywhere
    print(f"b trained to step {b_done}, a resumed at step {a_from} (lost {lost}), published {e.version}")
