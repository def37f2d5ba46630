"""A simulated trainer's run ends when `haru sim finish-run` asks, as the training contract says a run ends (its
adapter, then publish.json, exit 0), and the agent's own training slots and publisher publish it: real trainer
processes, the real `haru sim` CLI, the agent's `TrainingSlots` and `Publisher` over the in-memory log and object
store. A start of the slot while the publication uploads waits for it."""

from __future__ import annotations

import asyncio
import io
import json
import re
import tarfile
from pathlib import Path

import pytest
import structlog

from haru.agents.publishing import Publisher
from haru.agents.runtime_files import RuntimeFiles
from haru.agents.sim import trainer_files
from haru.agents.training_slots import TrainingSlots
from haru.core import subjects
from haru.core.events import AdapterPublished
from haru.core.specs import TrainingSpec
from haru.log.memory import MemoryLog
from haru.log.training_objects import MemoryObjects, Stored
from tests.support import haru
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(60)

SLOT = subjects.training("f", "b", "lora")
RUN = re.compile(r"finished run (\d{14}-[0-9a-f]{6})")


class GatedObjects(MemoryObjects):
    """The adapters bucket, whose uploads wait until `gate` is set (a large adapter on a slow link)."""

    def __init__(self) -> None:
        super().__init__(subjects.ADAPTERS_BUCKET)
        self.gate = asyncio.Event()
        self.uploading = asyncio.Event()

    async def put(self, name: str, data: bytes, *, note: str = "") -> Stored:
        self.uploading.set()
        await self.gate.wait()
        return await super().put(name, data, note=note)


def slots_for(tmp_path: Path, log: MemoryLog, objects: MemoryObjects, *trainer_args: str) -> TrainingSlots:
    spec = TrainingSpec(
        slot="lora",
        gpu_index=0,
        command=["python", "-m", "haru.agents.sim.trainer", "--vram", "1GiB", "--sim-dir", str(tmp_path / "sim" / "b")]
        + ["--step-ms", "10", *trainer_args],
        checkpoint_dir=str(tmp_path / "ckpt"),
    )
    logger = structlog.get_logger("test")
    publisher = Publisher(fleet="f", domain="b", objects=objects, log=log, models=lambda: {"m1"}, logger=logger)
    return TrainingSlots(
        [spec],
        fleet="f",
        domain="b",
        grace_ms=2000,
        log_dir=tmp_path / "state",
        append=lambda subject, event, expect: log.append(subject, event, expect=expect),
        files=RuntimeFiles(tmp_path / "state", logger=logger),
        agent_seq=lambda: 0,
        stopping=lambda: False,
        logger=logger,
        publisher=publisher,
    )


async def start(slots: TrainingSlots, tmp_path: Path) -> int:
    async def admit(_spec):
        return None

    started = await slots.start("lora", admit)
    assert started.ok, started
    pid = slots.trainers["lora"].pid
    assert pid is not None
    await wait_until(lambda: any(t["pid"] == pid for t in trainer_files.trainers(tmp_path / "sim" / "b")), 10)
    return pid


async def finish_run(tmp_path: Path, *extra: str):
    return await asyncio.to_thread(haru, "sim", "finish-run", "b", *extra, "--sim-root", str(tmp_path / "sim"))


async def published(log: MemoryLog, n: int) -> list[AdapterPublished]:
    async def got():
        found = [r.event for r in await log.history(SLOT) if isinstance(r.event, AdapterPublished)]
        return found if len(found) >= n else None

    return await wait_until(got, 15)


async def config_of(objects: MemoryObjects, name: str) -> dict:
    got = await objects.get(name)
    assert got is not None, name
    with tarfile.open(fileobj=io.BytesIO(got[1])) as tar:
        assert set(tar.getnames()) == {"adapter_config.json", "adapter_model.safetensors"}
        return json.loads(tar.extractfile("adapter_config.json").read())  # type: ignore[union-attr]


async def test_finish_run_publishes_each_run_once_and_a_diverged_one_answers_garbage(tmp_path):
    log, objects = MemoryLog(), MemoryObjects(subjects.ADAPTERS_BUCKET)
    slots = slots_for(tmp_path, log, objects, "--base-model", "m1", "--adapter", "sql")
    try:
        pid = await start(slots, tmp_path)
        out = await finish_run(tmp_path)
        assert out.returncode == 0, out.stderr
        run = RUN.search(out.stdout)
        assert run and f"(pid {pid})" in out.stdout and "adapter m1:sql" in out.stdout, out.stdout
        [first] = await published(log, 1)
        assert (first.base_model, first.adapter, first.version, first.rank) == ("m1", "sql", run.group(1), 8)
        assert first.metrics["steps"] > 0 and first.metrics["loss"] < 2.3
        config = await config_of(objects, first.object_name)
        assert config["r"] == 8 and config["haru_sim_says"] == f"m1:sql run {first.version}"  # what the sim answers
        assert (tmp_path / "ckpt" / "published" / f"{first.version}.json").exists()
        assert not (tmp_path / "ckpt" / "checkpoint.json").exists()  # the next start begins a new run

        await start(slots, tmp_path)
        out = await finish_run(tmp_path, "--diverged")
        assert out.returncode == 0 and ", diverged" in out.stdout, out.stdout + out.stderr
        _, second = await published(log, 2)
        assert second.version != first.version and second.metrics["loss"] == 11.93
        assert "m1:sql" not in (await config_of(objects, second.object_name))["haru_sim_says"]  # fails its probe
    finally:
        await slots.stop("lora")


async def test_a_start_while_the_run_is_being_published_waits_for_the_publication(tmp_path):
    log, objects = MemoryLog(), GatedObjects()
    slots = slots_for(tmp_path, log, objects, "--base-model", "m1", "--adapter", "sql")
    try:
        await start(slots, tmp_path)
        assert (await finish_run(tmp_path)).returncode == 0
        await asyncio.wait_for(objects.uploading.wait(), 10)  # the agent is uploading the adapter
        restart = asyncio.ensure_future(start(slots, tmp_path))
        await asyncio.sleep(0.5)
        assert not restart.done(), "the slot started again while its finished run was being published"
        objects.gate.set()
        await asyncio.wait_for(restart, 15)
        [once] = await published(log, 1)
        # the new trainer runs a new run: it did not find the old manifest and exit at once
        [running] = trainer_files.trainers(tmp_path / "sim" / "b")
        assert running["run"] != once.version and slots.trainers["lora"].running()
    finally:
        await slots.stop("lora")


async def test_finish_run_says_what_is_missing(tmp_path):
    out = await finish_run(tmp_path)
    assert out.returncode == 3 and "no simulated trainer runs on domain 'b'" in out.stderr
    assert "haru demote b" in out.stderr, out.stderr

    log, objects = MemoryLog(), MemoryObjects(subjects.ADAPTERS_BUCKET)
    slots = slots_for(tmp_path, log, objects)  # a trainer that trains no adapter
    try:
        await start(slots, tmp_path)
        out = await finish_run(tmp_path)
        assert out.returncode == 2 and "--base-model MODEL --adapter NAME" in out.stderr, out.stderr
        assert slots.trainers["lora"].running()  # asked nothing: it trains on
    finally:
        await slots.stop("lora")
