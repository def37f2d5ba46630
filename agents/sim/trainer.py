"""A simulated trainer: holds VRAM on a simulated GPU, checkpoints, and stops the way real ones do.

    python -m haru.agents.sim.trainer --vram 8GiB [--sim-dir DIR] [--ignore-sigterm] [--exit-after-ms N]
                                 [--step-ms 50] [--checkpoint-every-ms 500]

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
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from haru.agents.sim.errors import SimError
from haru.agents.sim.gpu_state import SimGpuState, parse_size
from haru.core.sizes import format_size


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
    gpu_index = int(os.environ.get("HARU_GPU_INDEX", "0"))
    ckpt_dir = Path(ckpt_env)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    _write_json(ckpt_dir / "env.json", dict(os.environ))

    ckpt_path = ckpt_dir / "checkpoint.json"
    step = 0
    try:
        step = int(json.loads(ckpt_path.read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        pass

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

    _log(f"training on GPU {gpu_index} with {format_size(vram)}, resuming at step {step}")
    try:
        return _train(args, gpu, ckpt_path, step, stopping)
    finally:
        gpu.free(pid)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="haru.agents.sim.trainer", description="simulated preemptible trainer")
    parser.add_argument("--vram", required=True, help="VRAM to hold, bytes or e.g. 8GiB")
    parser.add_argument("--sim-dir", default=os.environ.get("HARU_SIM_DIR"), help="simulated host dir (HARU_SIM_DIR)")
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--exit-after-ms", type=int, default=None)
    parser.add_argument("--step-ms", type=int, default=50)
    parser.add_argument("--checkpoint-every-ms", type=int, default=500)
    return parser


def _train(args: argparse.Namespace, gpu: SimGpuState, ckpt_path: Path, step: int, stopping: dict[str, int]) -> int:
    """Step until a signal, the end or a lost GPU, checkpointing every `checkpoint_every_ms`."""

    def checkpoint() -> None:
        _write_json(ckpt_path, {"step": step, "at": time.time(), "pid": os.getpid()})

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
        time.sleep(args.step_ms / 1000)
        step += 1
        if (time.monotonic() - last_ckpt) * 1000 >= args.checkpoint_every_ms:
            checkpoint()
            last_ckpt = time.monotonic()


if __name__ == "__main__":
    sys.exit(main())
