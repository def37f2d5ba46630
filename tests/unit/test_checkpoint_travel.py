"""Which checkpoint a training slot resumes from, and the agent's upload/fetch of one between two hosts."""

from __future__ import annotations

import structlog

from haru.agents.checkpoint_travel import CheckpointTravel, Synced, choose
from haru.core.specs import TrainingSpec
from haru.log.training_objects import MemoryObjects, Stored

REMOTE = Stored(name="f/lora", digest="sha256:r", size=1, note="step-20")


def test_the_bucket_wins_unless_it_holds_what_this_host_last_had():
    assert choose(None, None, None) == "local"  # nothing anywhere
    assert choose("step-10", None, None) == "local"  # nothing uploaded: the host's own
    assert choose(None, None, REMOTE) == "remote"  # a fresh host: the slot's newest, from wherever it trained
    assert choose("step-10", Synced(name="step-10", digest="sha256:old"), REMOTE) == "remote"  # trained elsewhere since
    # the bucket holds what this host uploaded last: its own is as new or newer (not yet uploaded)
    assert choose("step-30", Synced(name="step-20", digest="sha256:r"), REMOTE) == "local"
    assert choose("step-20", None, REMOTE) == "local"  # the same checkpoint


def spec(root) -> TrainingSpec:
    return TrainingSpec(slot="lora", gpu_index=0, command=["train"], checkpoint_dir=str(root))


def checkpoint(root, name: str, body: bytes) -> None:
    (root / "checkpoints" / name).mkdir(parents=True)
    (root / "checkpoints" / name / "state.json").write_bytes(body)
    (root / "latest").write_text(name + "\n")


async def test_a_checkpoint_uploaded_by_one_host_is_fetched_by_another_and_not_sent_back(tmp_path):
    bucket = MemoryObjects("haru_checkpoints")
    b = CheckpointTravel(fleet="f", objects=bucket, interval_s=1, logger=structlog.get_logger())
    a = CheckpointTravel(fleet="f", objects=bucket, interval_s=1, logger=structlog.get_logger())
    on_b, on_a = spec(tmp_path / "b"), spec(tmp_path / "a")
    assert await b.upload(on_b) is False  # no checkpoint yet
    checkpoint(tmp_path / "b", "step-10", b"ten")
    assert await b.upload(on_b) is True
    assert await b.upload(on_b) is False  # the same one is not sent twice
    checkpoint(tmp_path / "b", "step-20", b"twenty")
    assert await b.upload(on_b) is True
    assert (await bucket.info("f/lora")).note == "step-20"  # one object per fleet and slot, replaced
    # a never had it: fetched whole, `latest` names it, and a does not upload it back
    assert await a.fetch(on_a) == "step-20"
    assert (tmp_path / "a" / "checkpoints" / "step-20" / "state.json").read_bytes() == b"twenty"
    assert (tmp_path / "a" / "latest").read_text().strip() == "step-20"
    assert await a.upload(on_a) is False
    # a trains on and uploads; b, starting again later, takes a's newer one over its own
    checkpoint(tmp_path / "a", "step-30", b"thirty")
    assert await a.upload(on_a) is True
    assert await b.fetch(on_b) == "step-30"
    # the run is published: nothing is left to resume
    await b.forget(on_b)
    assert await bucket.info("f/lora") is None
