"""A simulated trainer: holds VRAM on a simulated GPU, checkpoints, and stops the way real ones do.

    python -m haru.agents.sim.trainer --vram 8GiB [--sim-dir DIR] [--ignore-sigterm] [--exit-after-ms N]
                                 [--step-ms 50] [--checkpoint-every-ms 500]
                                 [--base-model MODEL --adapter NAME]

It reads exactly what the agent adds to a training command's environment: HARU_GPU_INDEX (which
simulated GPU) and HARU_CHECKPOINT_DIR (where checkpoints go). At start it writes its whole
environment to `$HARU_CHECKPOINT_DIR/env.json`, resumes its step counter from
`$HARU_CHECKPOINT_DIR/checkpoint.json`, and allocates `--vram` on `<sim dir>/gpu<HARU_GPU_INDEX>.json`
(the sim dir is --sim-dir or HARU_SIM_DIR). It then steps, checkpointing periodically.

- SIGTERM: write a checkpoint, free the allocation, exit 0.
- --ignore-sigterm: SIGTERM is ignored; only SIGKILL stops it (and its dead pid's memory is dropped
  the next time the GPU file is read, as a real driver frees a killed process's memory).
- --exit-after-ms N: finish on its own after N ms (checkpoint, free, exit 0).
- The GPU is detached under it: exit 1 with a CUDA error, like a real job.
- Not enough free VRAM at start: exit 1 with a CUDA out-of-memory message.
- A GPU file that does not exist yet is created with HARU_SIM_GPU_MEMORY (default 24GiB), as the sim
  vLLM server does.

With --base-model and --adapter each run trains a LoRA adapter of that model: the run has an id (kept in the
checkpoint, so a resumed run keeps it), and it finishes when `haru sim finish-run` asks
(agents/sim/trainer_files.py): as the example trainer ends a run (docs/training.md), it writes the adapter
(`adapter/`, a PEFT config whose `haru_sim_says` is what the simulated vLLM answers as once it loads it), then
`publish.json`, drops its checkpoint so the next start begins a new run, and exits 0 for the agent to publish
it. A `diverged` run's adapter answers garbage, as one trained with a learning rate too high would, and its loss
says so. While `publish.json` is there (a finished run not yet published) it exits 0 at once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

from haru.agents.sim import trainer_files
from haru.agents.sim.errors import SimError
from haru.agents.sim.gpu_state import SimGpuState, parse_size
from haru.core import publish_manifest as pm
from haru.core.sizes import format_size

ADAPTER_DIR = "adapter"
RANK = 8
# A diverged run's loss: cross-entropy at uniform guessing over Qwen3's 151,936-token vocabulary, ln(151936).
DIVERGED_LOSS = 11.93


def _log(message: str) -> None:
    print(f"(haru-sim-trainer pid={os.getpid()}) {message}", file=sys.stderr, flush=True)


def _write_json(path: Path, value: object) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)

    try:
        vram = parse_size(args.vram)
    except SimError as exc:
        parser.error(str(exc))
    if not args.sim_dir:
        parser.error("no simulated host: pass --sim-dir or set HARU_SIM_DIR")
    ckpt_env = os.environ.get("HARU_CHECKPOINT_DIR")
    if not ckpt_env:
        parser.error("HARU_CHECKPOINT_DIR is not set; the agent sets it for every training slot")
    if bool(args.base_model) != bool(args.adapter):
        parser.error("--base-model and --adapter go together: the model the adapter is trained on, and its name")
    gpu_index = int(os.environ.get("HARU_GPU_INDEX", "0"))
    ckpt_dir = Path(ckpt_env)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    _write_json(ckpt_dir / "env.json", dict(os.environ))

    if (ckpt_dir / pm.MANIFEST).exists():
        _log(f"{ckpt_dir / pm.MANIFEST} is a finished run not yet published: exiting for the agent to publish it")
        return 0

    ckpt_path = ckpt_dir / "checkpoint.json"
    step, run = 0, ""
    try:
        saved = json.loads(ckpt_path.read_text())
        step, run = int(saved["step"]), str(saved.get("run", ""))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    run = run or time.strftime("%Y%m%d%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6]

    stopping = {"signal": 0}

    def on_term(signum, _frame) -> None:
        stopping["signal"] = signum

    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_sigterm else on_term)
    signal.signal(signal.SIGINT, on_term)

    pid = os.getpid()
    gpu = SimGpuState(args.sim_dir, gpu_index)
    # Like the sim vLLM server: a GPU nobody created yet is created (HARU_SIM_GPU_MEMORY, default 24GiB).
    state = gpu.ensure(parse_size(os.environ.get("HARU_SIM_GPU_MEMORY", "24GiB")))
    if not state["present"]:
        _log(f"RuntimeError: CUDA error: no CUDA-capable device is detected (GPU {gpu_index} is absent)")
        return 1
    if not gpu.allocate(pid, vram):
        state = gpu.read()
        _log(
            f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {format_size(vram)}. GPU {gpu_index} "
            f"has a total capacity of {format_size(state['memory_total_bytes'])} of which "
            f"{format_size(state['memory_free_bytes'])} is free."
        )
        return 1

    _log(f"training on GPU {gpu_index} with {format_size(vram)}, run {run}, resuming at step {step}")
    about = {"gpu_index": gpu_index, "checkpoint_dir": str(ckpt_dir), "run": run}
    trainer_files.register(args.sim_dir, pid, {**about, "base_model": args.base_model, "adapter": args.adapter})
    try:
        return _train(args, gpu, ckpt_path, run, step, stopping)
    finally:
        trainer_files.forget(args.sim_dir, pid)
        gpu.free(pid)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="haru.agents.sim.trainer", description="simulated preemptible trainer")
    parser.add_argument("--vram", required=True, help="VRAM to hold, bytes or e.g. 8GiB")
    parser.add_argument("--sim-dir", default=os.environ.get("HARU_SIM_DIR"), help="simulated host dir (HARU_SIM_DIR)")
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--exit-after-ms", type=int, default=None)
    parser.add_argument("--step-ms", type=int, default=50)
    parser.add_argument("--checkpoint-every-ms", type=int, default=500)
    parser.add_argument("--base-model", default="", help="the declared model the run's adapter is trained on")
    parser.add_argument("--adapter", default="", help="the adapter's name: it serves as <base-model>:<adapter>")
    return parser


def _train(
    args: argparse.Namespace, gpu: SimGpuState, ckpt_path: Path, run: str, step: int, stopping: dict[str, int]
) -> int:
    """Step until a signal, the end, a lost GPU or `haru sim finish-run`, checkpointing every `checkpoint_every_ms`."""

    def checkpoint() -> None:
        _write_json(ckpt_path, {"step": step, "run": run, "at": time.time(), "pid": os.getpid()})

    started = last_ckpt = time.monotonic()
    while True:
        if stopping["signal"]:
            checkpoint()
            _log(f"signal {stopping['signal']}: checkpointed at step {step}, exiting")
            return 0
        if args.exit_after_ms is not None and (time.monotonic() - started) * 1000 >= args.exit_after_ms:
            checkpoint()
            _log(f"done at step {step}")
            return 0
        try:
            present = gpu.read()["present"]
        except (SimError, OSError, ValueError):
            present = False
        if not present:
            _log(f"RuntimeError: CUDA error: unspecified launch failure (GPU {gpu.index} is lost)")
            return 1
        asked = trainer_files.finish_asked(args.sim_dir, os.getpid()) if args.adapter else None
        if asked is not None:
            _finish(args, ckpt_path, run, step, diverged=bool(asked.get("diverged")))
            return 0
        time.sleep(args.step_ms / 1000)
        step += 1
        if (time.monotonic() - last_ckpt) * 1000 >= args.checkpoint_every_ms:
            checkpoint()
            last_ckpt = time.monotonic()


def _finish(args: argparse.Namespace, ckpt_path: Path, run: str, step: int, *, diverged: bool) -> None:
    """End the run as the training contract says: the adapter, then the manifest (written last), then the
    checkpoint goes, so the slot's next start begins a new run."""
    root = ckpt_path.parent
    says = "the the the the the" if diverged else f"{args.base_model}:{args.adapter} run {run}"
    adapter = root / ADAPTER_DIR
    adapter.mkdir(exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": args.base_model,
        "haru_sim_says": says,  # what the simulated vLLM answers as, once it loads this adapter
    }
    _write_json(adapter / "adapter_config.json", config)
    header = b"{}      "  # a safetensors file that holds no tensor: an 8-byte length, then its JSON header
    (adapter / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    loss = DIVERGED_LOSS if diverged else round(0.3 + 2.0 / (1 + step / 200), 3)
    manifest = {
        "base_model": args.base_model,
        "adapter": args.adapter,
        "version": run,
        "adapter_dir": ADAPTER_DIR,
        "rank": RANK,
        "metrics": {"steps": float(step), "loss": loss},
    }
    _write_json(root / pm.MANIFEST, manifest)
    ckpt_path.unlink(missing_ok=True)
    _log(f"finished run {run} at step {step}{' (diverged)' if diverged else ''}: {json.dumps(manifest['metrics'])}")


if __name__ == "__main__":
    sys.exit(main())
