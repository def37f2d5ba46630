"""A standby's agent publishes what its training slot finished: the example LoRA trainer (real PEFT, on the CPU)
trains on domain b while its models sleep, exits 0 with a publish manifest, and the agent puts the adapter in the
`haru_adapters` object store and records `adapter_published` on the slot's subject. A manifest that cannot be
published stores and records nothing and says why."""

from __future__ import annotations

import io
import json
import sys
import tarfile

import pytest

from haru.core import subjects
from haru.core.events import AdapterPublished
from haru.log.training_objects import JsObjects, digest_of
from tests.support.agent_harness import is_, tag, wait_event, write_config, write_layout
from tests.support.trainer import TRAINER_ENV, tiny_data, tiny_model, train_command
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(150)

SLOT = subjects.training("f", "b", "lora")


def standby_with(tmp_path, nats_server, agents, command: list[str], *, grace_ms: int = 10000):
    layout = write_layout(tmp_path / "layout.json", tmp_path, training={"grace_ms": grace_ms})
    doc = json.loads(layout.read_text())
    for d in doc["domains"]:
        d["slots"][-1]["command"] = command
    layout.write_text(json.dumps(doc))
    cfg = write_config(tmp_path / "agent-b.json", nats_server.url, tmp_path, domain="b", layout=layout)
    from tests.support.agent_harness import agent_env

    return agents(cfg, tmp_path / "agent-b.log", agent_env(**TRAINER_ENV))


async def test_a_finished_run_is_published_to_the_object_store_and_recorded(tmp_path, nats_server, event_log, agents):
    model, data = tiny_model(tmp_path / "model"), tiny_data(tmp_path / "data.jsonl")
    agent = standby_with(tmp_path, nats_server, agents, train_command(model, data, steps=20, every=10))
    stopped = await wait_event(
        event_log, SLOT, is_("training_stopped", how="exited", exit_code=0), timeout=120, agent=agent
    )
    published = await wait_event(event_log, SLOT, is_("adapter_published"), timeout=30, agent=agent)
    e = published.event
    assert isinstance(e, AdapterPublished) and published.seq > stopped.seq
    ckpt = tmp_path / "ckpt" / "b"
    manifest = json.loads((ckpt / "published" / f"{e.version}.json").read_text())  # moved aside once recorded
    assert not (ckpt / "publish.json").exists()
    assert (e.domain, e.slot, e.base_model, e.adapter, e.rank) == ("b", "lora", "m1", "twice", 4)
    assert e.data == f"{data} {digest_of(data.read_bytes())}"
    assert e.metrics["steps"] == 20 and e.metrics["held_out_loss"] == manifest["metrics"]["held_out_loss"]
    # the object: the bytes the event names, a tar of the adapter's folder
    got = await JsObjects(event_log.js, subjects.ADAPTERS_BUCKET).get(e.object_name)
    assert got is not None
    stored, raw = got
    assert digest_of(raw) == e.digest == stored.digest and len(raw) == e.size_bytes
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        names = set(tar.getnames())
        config = json.loads(tar.extractfile("adapter_config.json").read())  # type: ignore[union-attr]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names
    assert config["r"] == 4
    assert (ckpt / "adapter" / "adapter_model.safetensors").read_bytes() == tarfile.open(
        fileobj=io.BytesIO(raw)
    ).extractfile("adapter_model.safetensors").read()  # type: ignore[union-attr]
    # once: nothing more is recorded on the slot
    assert [tag(r) for r in await event_log.history(SLOT)].count("adapter_published") == 1


BAD = r"""
import json, os, pathlib, sys
root = pathlib.Path(os.environ["HARU_CHECKPOINT_DIR"]); (root / "adapter").mkdir(parents=True, exist_ok=True)
(root / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
(root / "adapter" / "adapter_model.safetensors").write_bytes(b"x" * 64)
(root / "publish.json").write_text(json.dumps({"base_model": sys.argv[1], "adapter": "twice", "version": "run-1",
    "adapter_dir": "adapter", "rank": 8}))
print("training on GPU", flush=True)
"""


async def test_a_manifest_naming_an_undeclared_model_is_refused_with_its_reason(
    tmp_path, nats_server, event_log, agents
):
    agent = standby_with(tmp_path, nats_server, agents, [sys.executable, "-c", BAD, "nope"])
    await wait_event(event_log, SLOT, is_("training_stopped", how="exited", exit_code=0), timeout=60, agent=agent)
    said = await wait_until(
        lambda: [
            json.loads(line) for line in agent.log_path.read_text().splitlines() if "adapter_not_published" in line
        ],
        20,
        what="the agent's adapter_not_published line",
    )
    assert "base_model 'nope' is not a model this domain serves (m1)" in said[0]["problem"]
    assert "publish.json" in said[0]["fix"]
    assert "adapter_published" not in [tag(r) for r in await event_log.history(SLOT)]
    assert (tmp_path / "ckpt" / "b" / "publish.json").exists()  # left for the operator, nothing moved or lost
    assert await JsObjects(event_log.js, subjects.ADAPTERS_BUCKET).info("f/nope:twice/run-1") is None
