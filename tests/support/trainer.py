"""The example LoRA trainer (deploy/examples/trainer/train_lora.py) for the tests: its managed venv (torch CPU,
transformers, peft; made once per machine), a tiny safetensors llama and a small prompt/answer data set, both
written by the tests (nothing is downloaded).

Tests never make the venv (~1.2 GB, a minute or two): `.ci/run` makes or reuses it before pytest and sets
HARU_REQUIRE_TRAINER=1, so in CI a missing env FAILS the tests; elsewhere they are skipped with the command
that makes it.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from haru.up.trainer_env import BuildError, find_python

ROOT = Path(__file__).resolve().parents[2]
TRAIN_LORA = ROOT / "deploy" / "examples" / "trainer" / "train_lora.py"
TINY_HF_MODEL = ROOT / "agents" / "runtimes" / "tiny_hf_model.py"
# One thread each: the machine is small and shared, and a tiny model gains nothing from more.
TRAINER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def trainer_python() -> Path:
    """The interpreter with torch and peft, or fail (HARU_REQUIRE_TRAINER=1, as in CI) / skip saying how."""
    try:
        python = find_python()
    except BuildError as exc:
        pytest.fail(str(exc))
    if python is not None:
        return python
    how = (
        "no trainer env: make it once with `python -m haru.up.trainer_env` (torch CPU, transformers, peft; "
        "cached per machine in ~/.cache/haru/trainer-venv) or point HARU_TRAINER_PYTHON at a Python with them"
    )
    if os.environ.get("HARU_REQUIRE_TRAINER") == "1":
        pytest.fail(f"HARU_REQUIRE_TRAINER=1 and {how}")
    pytest.skip(how)


def tiny_model(out: Path, seed: int = 0) -> Path:
    """agents/runtimes/tiny_hf_model.py run by the trainer's interpreter (it has sentencepiece and safetensors)."""
    subprocess.run(
        [str(trainer_python()), str(TINY_HF_MODEL), str(out), "--seed", str(seed)],
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=300,
    )
    return out


def tiny_data(path: Path, n: int = 40, seed: int = 0) -> Path:
    """`n` prompt/answer lines a LoRA can learn: "Say <word> twice:" -> "<word> <word>"."""
    rnd = random.Random(seed)
    words = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree"]
    lines = []
    for _ in range(n):
        w = rnd.choice(words)
        lines.append(json.dumps({"prompt": f"Say {w} twice:", "answer": f"{w} {w}"}))
    path.write_text("\n".join(lines) + "\n")
    return path


def train_command(model: Path, data: Path, *, steps: int, every: int, base_model: str = "m1", adapter: str = "twice"):
    """The training slot's command: the example trainer under the managed interpreter, rank 4."""
    return [
        str(trainer_python()),
        str(TRAIN_LORA),
        "--base",
        str(model),
        "--base-model",
        base_model,
        "--adapter",
        adapter,
        "--data",
        str(data),
        "--steps",
        str(steps),
        "--checkpoint-every",
        str(every),
        "--rank",
        "4",
    ]


def latest_step(ckpt_dir: Path) -> int:
    """The step of the checkpoint `latest` names (0: none), read as the trainer would."""
    try:
        name = (ckpt_dir / "latest").read_text().strip()
    except FileNotFoundError:
        return 0
    return json.loads((ckpt_dir / "checkpoints" / name / "state.json").read_text())["step"]


def steps_said(output: str) -> int:
    """The last step the trainer said it finished ("step N loss X")."""
    done = [int(line.split()[1]) for line in output.splitlines() if line.startswith("step ")]
    return done[-1] if done else 0
