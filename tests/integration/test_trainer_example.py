"""The example LoRA trainer (deploy/examples/trainer/train_lora.py), run as the agent runs it: a real PEFT LoRA on a
tiny llama on the CPU, checkpointing to HARU_CHECKPOINT_DIR, killed and stopped at random moments."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.trainer import TRAINER_ENV, latest_step, steps_said, tiny_data, tiny_model, train_command
from tests.support.wait import wait_until_sync

pytestmark = pytest.mark.timeout(180)

STEPS, EVERY = 60, 10


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("trainer")
    return tiny_model(root / "model"), tiny_data(root / "data.jsonl")


def start(base, ckpt: Path, out: Path, steps: int = STEPS, **env) -> subprocess.Popen:
    model, data = base
    full = dict(os.environ, **TRAINER_ENV, HARU_CHECKPOINT_DIR=str(ckpt), HARU_GPU_INDEX="0", **env)
    with open(out, "ab") as f:
        return subprocess.Popen(
            train_command(model, data, steps=steps, every=EVERY), stdout=f, stderr=subprocess.STDOUT, env=full
        )


def said(out: Path) -> str:
    return out.read_text() if out.exists() else ""


def run_through(base, ckpt: Path, out: Path, steps: int = STEPS) -> str:
    proc = start(base, ckpt, out, steps)
    assert proc.wait(timeout=150) == 0, said(out)[-2000:]
    return said(out)


def complete_checkpoints(ckpt: Path) -> list[Path]:
    """Every checkpoint in place (not a temporary one): each must be whole."""
    root = ckpt / "checkpoints"
    return [p for p in root.iterdir() if not p.name.startswith(".")] if root.is_dir() else []


def test_sigkill_at_random_moments_loses_at_most_the_steps_since_the_last_checkpoint(base, tmp_path):
    ckpt, rnd, steps = tmp_path / "ckpt", random.Random(), 3 * STEPS
    losses = []
    for attempt in range(3):
        out = tmp_path / f"run-{attempt}.log"
        before = latest_step(ckpt)
        proc = start(base, ckpt, out, steps)
        # once it trains (past the resume), a random moment: mid-step, mid-checkpoint, between
        wait_until_sync(lambda: steps_said(said(out)) > before, 120, what=lambda: said(out)[-1500:])  # noqa: B023
        time.sleep(rnd.uniform(0, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        if before:  # it went on from the checkpoint the last kill left
            assert f"at step {before} " in said(out) and "resumed from" in said(out), said(out)[:1500]
        if (ckpt / "publish.json").exists():
            break  # (a loaded machine is slow, a quiet one fast: it may have finished before the kill)
        done, kept = steps_said(said(out)), latest_step(ckpt)
        assert done - kept <= EVERY, f"killed after step {done}, the last checkpoint is step {kept}"
        losses.append(done - kept)
        for c in complete_checkpoints(ckpt):  # never a half-written checkpoint in place
            assert {"state.json", "optimizer.pt", "adapter_model.safetensors", "adapter_config.json"} <= {
                f.name for f in c.iterdir()
            }, c
    if not (ckpt / "publish.json").exists():
        before = latest_step(ckpt)
        final = run_through(base, ckpt, tmp_path / "final.log", steps)
        assert not before or f"at step {before} " in final, final[:1500]
    manifest = json.loads((ckpt / "publish.json").read_text())
    assert manifest["metrics"]["steps"] == steps
    print(f"steps lost per SIGKILL: {losses} (checkpoint every {EVERY})")


def test_sigterm_checkpoints_and_exits_0_then_resumes_from_that_step(base, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "run.log"
    proc = start(base, ckpt, out)
    wait_until_sync(lambda: steps_said(said(out)) >= 3, 120, what=lambda: said(out)[-1500:])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, said(out)[-1500:]
    done = steps_said(said(out))
    assert 3 <= done < STEPS
    assert latest_step(ckpt) == done  # nothing lost: it finished the step and checkpointed it
    again = tmp_path / "again.log"
    proc = start(base, ckpt, again)
    wait_until_sync(lambda: "resumed from" in said(again), 120, what=lambda: said(again)[-1500:])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert f"at step {done} " in said(again)
    first_step = [line for line in said(again).splitlines() if line.startswith("step ")][:1]
    assert not first_step or first_step[0].startswith(f"step {done + 1} ")


def test_a_finished_run_writes_the_adapter_and_its_publish_manifest(base, tmp_path):
    model, data = base
    ckpt = tmp_path / "ckpt"
    out = run_through(base, ckpt, tmp_path / "run.log")
    assert "training on the CPU (CUDA_VISIBLE_DEVICES=0)" in out  # pinned to HARU_GPU_INDEX before torch started
    manifest = json.loads((ckpt / "publish.json").read_text())
    adapter = ckpt / manifest["adapter_dir"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (adapter / "adapter_model.safetensors").stat().st_size > 0
    assert config["r"] == manifest["rank"] == 4 and config["peft_type"] == "LORA"
    import hashlib

    assert manifest["data_digest"] == "sha256:" + hashlib.sha256(data.read_bytes()).hexdigest()
    assert manifest["base_model"] == "m1" and manifest["adapter"] == "twice" and manifest["version"]
    assert set(manifest["metrics"]) >= {"steps", "loss", "held_out_loss"}
    assert manifest["metrics"]["held_out_loss"] > 0
    assert not (ckpt / "latest").exists()
    # started again before the agent published it: it leaves the finished run alone and exits 0
    again = run_through(base, ckpt, tmp_path / "again.log")
    assert "not yet published" in again
    assert json.loads((ckpt / "publish.json").read_text()) == manifest
