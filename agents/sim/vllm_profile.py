"""The simulated vLLM's start-up memory profiling, as vLLM does it, and its record.

`profile_outcome` is pure: what vLLM concludes when the other processes on the GPU held more (its KV
cache is mis-sized, or there is none) or less (its profiling assertion fails) at the end of the pass
than at its start. `record_profile` appends one line per start-up to `<sim_dir>/profiles.jsonl`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from haru.agents.sim.errors import SimError
from haru.agents.sim.gpu_state import SimGpuState
from haru.agents.sim.vllm_config import SimConfig
from haru.core.sizes import GiB


@dataclass(frozen=True)
class Profiled:
    """The outcome of start-up profiling: the KV cache it sized, and vLLM's error if it could not."""

    kv_cache_bytes: int
    planned_kv_bytes: int
    error: str = ""

    @property
    def mis_sized(self) -> bool:
        return self.kv_cache_bytes != self.planned_kv_bytes


def profile_outcome(vram: int, weights: int, others_before: int, others_after: int, gpu_total: int) -> Profiled:
    """What vLLM's start-up profiling concludes when the other processes on the GPU held
    `others_before` bytes as it began and `others_after` as it ended. Pure."""
    weights = weights or vram // 2
    planned = max(0, vram - weights)
    if others_after < others_before:
        before_free = max(0, gpu_total - others_before - vram)
        after_free = max(0, gpu_total - others_after - vram)
        return Profiled(
            0,
            planned,
            (
                f"AssertionError: Error in memory profiling. Initial free memory {before_free / GiB:.2f} GiB, current "
                f"free memory {after_free / GiB:.2f} GiB. This happens when other processes sharing the same container "
                f"release GPU memory while vLLM is profiling during initialization. To fix this, ensure consistent GPU "
                f"memory allocation or isolate vLLM in its own container."
            ),
        )
    kv = planned - (others_after - others_before)
    if kv <= 0:
        return Profiled(
            0,
            planned,
            "ValueError: No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine.",
        )
    return Profiled(kv, planned)


def others_held(gpu: SimGpuState, pid: int) -> int:
    """Bytes the other processes hold on the simulated GPU."""
    try:
        allocations = gpu.read()["allocations"]
    except SimError:
        return 0
    return sum(n for key, n in allocations.items() if key != str(pid))


def record_profile(config: SimConfig, pid: int, began: float, ended: float, outcome: Profiled) -> None:
    line = json.dumps(
        {
            "pid": pid,
            "model": config.name,
            "gpu_index": config.gpu_index,
            "began": began,
            "ended": ended,
            "kv_cache_bytes": outcome.kv_cache_bytes,
            "planned_kv_bytes": outcome.planned_kv_bytes,
            "mis_sized": outcome.mis_sized,
            "error": outcome.error,
        }
    )
    with open(config.sim_dir / "profiles.jsonl", "a") as fh:  # one short line: an O_APPEND write is whole
        fh.write(line + "\n")
