"""verify_gpu's judgment: given the models, the trainers and a reading of each of their GPUs, is it safe
to wake the sleeping models there (free VRAM covers them, no trainer process is left)? No GPU read and no
append here: the agent reads the GPUs (recording what changed) and passes the readings in. (The trainers'
process groups and `pid_alive` do read /proc.) `settled` repeats observe-and-judge within the policy's
settle window (`verify_settle_ms`) while the only problem is memory the driver has not released yet."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import msgspec

from haru.agents.gpu import GpuReading
from haru.agents.model_slot import ModelSlot
from haru.agents.ports import GpuVerdict
from haru.agents.training import Trainer
from haru.core.commands import ErrorInfo
from haru.core.specs import model_gpus

__all__ = ["judge_gpus", "gpus_of", "settled", "SETTLE_POLL_S"]

SETTLE_POLL_S = 0.05  # within the settle window the GPUs are read this often (an NVML read costs ~1 ms)
# Problems the settle window waits out: memory a stopped trainer held, not yet released by the driver.
# Training still running (stop_training first) and a detached GPU do not go away by waiting.
_SETTLES = frozenset({"gpu_busy"})


async def settled(
    observe: Callable[[], Awaitable[object]],
    judge: Callable[[], GpuVerdict],
    *,
    settle_s: float,
    poll_s: float = SETTLE_POLL_S,
    clock: Callable[[], float] = time.monotonic,
) -> GpuVerdict:
    """verify_gpu within a bounded settle window: observe and judge, and while the only problem is memory
    not released yet, read again every `poll_s` until it is or `settle_s` has passed. The verdict's data
    says how long the memory took to come back (`settle_ms`) and the bound (`settle_bound_ms`)."""
    started = clock()
    await observe()
    verdict = judge()
    polls = 1
    while (
        not verdict.ok and verdict.error is not None and verdict.error.code in _SETTLES and clock() - started < settle_s
    ):
        await asyncio.sleep(poll_s)
        await observe()
        verdict = judge()
        polls += 1
    took = int((clock() - started) * 1000)
    data = {**verdict.data, "settle_ms": took, "settle_bound_ms": int(settle_s * 1000), "reads": polls}
    error = verdict.error
    if error is not None and error.code in _SETTLES:
        error = msgspec.structs.replace(
            error,
            message=f"{error.message} (still so after {took} ms of the "
            f"{int(settle_s * 1000)} ms settle window, verify_settle_ms)",
        )
    return GpuVerdict(ok=verdict.ok, error=error, data=data)


def gpus_of(models: Sequence[ModelSlot]) -> list[int]:
    """The GPUs the judgment reads: those of the models that are not external endpoints."""
    return sorted({i for m in models if m.runtime.kind != "external" for i in model_gpus(m.spec)})


def judge_gpus(
    models: Sequence[ModelSlot],
    trainers: Mapping[str, Trainer],
    readings: Mapping[int, GpuReading],
    *,
    residual_bytes: int,
    pid_alive: Callable[[int], bool],
) -> GpuVerdict:
    """Free VRAM on each inference GPU covers what its asleep models need to wake, and no trainer
    pid is left on the GPU.

    On a host without NVML (present None) the VRAM cannot be read: what can be verified is, and the
    rest is said in `data["unverified"]` instead of aborting every promotion. The trainers' processes
    must be gone as the OS reports it (/proc), since the driver frees an exited process's device memory.
    """
    trainer_pids: set[int] = set()
    for t in trainers.values():
        trainer_pids |= t.group_pids()
        if t.ended is not None:
            trainer_pids.add(t.ended.pid)
    running = [slot for slot, t in trainers.items() if t.running()]
    per_gpu: dict[int, list[ModelSlot]] = {}
    for m in models:
        if m.runtime.kind != "external":
            for i in model_gpus(m.spec):  # a model across GPUs needs its share on each
                per_gpu.setdefault(i, []).append(m)
    out: dict[str, dict] = {}
    problems: list[tuple[str, str]] = []
    unverified: list[str] = []
    residual = residual_bytes
    for index, ms in sorted(per_gpu.items()):
        r = readings[index]
        needed = sum(
            max(0, m.spec.vram_bytes - (residual if m.runtime.can_sleep else 0))
            for m in ms
            if m.state_tag in ("sleeping", "waking")
        )
        on_gpu = sorted(p.pid for p in r.processes if p.pid in trainer_pids)
        out[str(index)] = {
            "present": r.present,
            "free_bytes": r.memory_free_bytes,
            "needed_bytes": needed,
            "total_bytes": r.memory_total_bytes,
            "trainer_pids": on_gpu,
            "models": [m.name for m in ms],
        }
        if r.present is False:
            problems.append(("gpu_detached", f"GPU {index} is gone (the provider took it)"))
        elif r.present is None:
            alive = sorted(p for p in trainer_pids if pid_alive(p))
            out[str(index)].update(nvml=False, trainer_pids=alive)
            if alive:
                problems.append(
                    (
                        "gpu_busy",
                        f"trainer processes {alive} still run (GPU {index} cannot be read: no NVML on this host)",
                    )
                )
            else:
                unverified.append(
                    f"GPU {index}: NVML absent on this host, so free VRAM is unverified "
                    f"(needed {needed} bytes to wake); trainer processes gone as the OS reports it"
                )
        else:
            if on_gpu:
                problems.append(("gpu_busy", f"GPU {index} still has trainer processes {on_gpu}"))
            if r.memory_free_bytes < needed:
                problems.append(
                    (
                        "gpu_busy",
                        f"GPU {index} has {r.memory_free_bytes} bytes free; its sleeping models "
                        f"need {needed} to wake (short by {needed - r.memory_free_bytes})",
                    )
                )
    if running:
        problems.insert(0, ("training_running", f"training still runs: {', '.join(running)}; stop_training first"))
    data = {"gpus": out, "training_running": running, "unverified": unverified}
    if problems:
        return GpuVerdict(
            ok=False, error=ErrorInfo(code=problems[0][0], message="; ".join(p[1] for p in problems)), data=data
        )
    return GpuVerdict(ok=True, data=data)
