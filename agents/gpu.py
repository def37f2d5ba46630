"""The GPU seam: what a host's GPUs hold, read through one small Protocol.

    Gpus.read(index) -> GpuReading      synchronous and cheap; never raises
    Gpus.close()

    NvmlGpus   the real GPUs, through pynvml (NVML)
    SimGpus    the simulated GPUs of agents/sim (one JSON state file per GPU)

`present` is three-valued, and honest about it: True (the GPU answers), False (it is gone: lost,
not found, or no such index), None (this host cannot know: no NVML library or driver). Nothing
here guesses. A MIG-partitioned GPU is read per MIG instance (memory and processes summed over
the instances) instead of failing, and says `mig=True`.
"""

from __future__ import annotations

import os
import warnings
from typing import Literal, Protocol

import msgspec

from agents.sim.errors import SimError
from agents.sim.gpu_state import SimGpuState
from haru.errors import ConfigError
from haru.events import GpuProcess


class GpuReading(msgspec.Struct, frozen=True):
    index: int
    present: bool | None
    name: str = ""
    memory_total_bytes: int = 0
    memory_used_bytes: int = 0
    memory_free_bytes: int = 0
    processes: list[GpuProcess] = []
    mig: bool = False


class Gpus(Protocol):
    def read(self, index: int) -> GpuReading: ...

    def close(self) -> None: ...


# ------------------------------------------------------------------------------------------ NVML


def _pynvml():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the `pynvml` shim warns that it is deprecated
        import pynvml
    return pynvml


def presence_from_nvml_error(code: int) -> bool | None:
    """What an NVML error code says about presence: False = the GPU is gone, None = cannot tell."""
    nvml = _pynvml()
    gone = {nvml.NVML_ERROR_GPU_IS_LOST, nvml.NVML_ERROR_NOT_FOUND, nvml.NVML_ERROR_INVALID_ARGUMENT}
    return False if code in gone else None


class NvmlGpus:
    """The host's real GPUs through NVML. Without NVML (no library, no driver) every read is present=None."""

    def __init__(self) -> None:
        self._nvml = _pynvml()
        self.unavailable = ""
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as exc:
            self.unavailable = str(exc) or type(exc).__name__

    @property
    def available(self) -> bool:
        return not self.unavailable

    def read(self, index: int) -> GpuReading:
        if not self.available:
            return GpuReading(index=index, present=None)
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = nvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else str(name)
            mig = self._mig_enabled(handle)
            units = self._mig_handles(handle) if mig else [handle]
            total, used, free = self._memory(handle, units, mig)
            processes = [p for unit in units for p in self._processes(unit)]
        except nvml.NVMLError as exc:
            return GpuReading(index=index, present=presence_from_nvml_error(exc.value))
        return GpuReading(
            index=index,
            present=True,
            name=name,
            memory_total_bytes=total,
            memory_used_bytes=used,
            memory_free_bytes=free,
            processes=processes,
            mig=mig,
        )

    def close(self) -> None:
        if self.available:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
            self.unavailable = "closed"

    def _mig_enabled(self, handle) -> bool:
        nvml = self._nvml
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError:
            return False  # NOT_SUPPORTED: a GPU without MIG
        return current == nvml.NVML_DEVICE_MIG_ENABLE

    def _mig_handles(self, handle) -> list:
        nvml = self._nvml
        out = []
        for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                out.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i))
            except nvml.NVMLError as exc:
                if exc.value != nvml.NVML_ERROR_NOT_FOUND:  # NOT_FOUND: that MIG slot is not instantiated
                    raise
        return out

    def _memory(self, handle, units: list, mig: bool) -> tuple[int, int, int]:
        nvml = self._nvml
        if not mig:
            info = nvml.nvmlDeviceGetMemoryInfo(handle)
            return int(info.total), int(info.used), int(info.free)
        infos = [nvml.nvmlDeviceGetMemoryInfo(unit) for unit in units]
        used = sum(int(i.used) for i in infos)
        try:
            total = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
        except nvml.NVMLError:
            total = sum(int(i.total) for i in infos)
        free = sum(int(i.free) for i in infos)
        return total, used, free

    def _processes(self, handle) -> list[GpuProcess]:
        nvml = self._nvml
        try:
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except nvml.NVMLError as exc:
            if exc.value == nvml.NVML_ERROR_NOT_SUPPORTED:
                return []
            raise
        # usedGpuMemory is None when NVML cannot attribute memory (e.g. Windows WDDM, some MIG setups).
        return [GpuProcess(pid=int(p.pid), used_bytes=int(p.usedGpuMemory or 0)) for p in procs]


# ------------------------------------------------------------------------------------------ sim


class SimGpus:
    """The simulated GPUs in `sim_dir` (agents/sim/gpu_state). A GPU without a state file is absent."""

    def __init__(self, sim_dir: str | os.PathLike[str]) -> None:
        self.sim_dir = sim_dir

    def read(self, index: int) -> GpuReading:
        try:
            state = SimGpuState(self.sim_dir, index).read()
        except (SimError, OSError, ValueError):
            return GpuReading(index=index, present=False)
        present = state["present"]
        return GpuReading(
            index=index,
            present=present,
            name=state["name"],
            memory_total_bytes=state["memory_total_bytes"],
            memory_used_bytes=state["memory_used_bytes"] if present else 0,
            memory_free_bytes=state["memory_free_bytes"] if present else 0,
            processes=[GpuProcess(pid=int(pid), used_bytes=n) for pid, n in sorted(state["allocations"].items(), key=lambda kv: int(kv[0]))]
            if present
            else [],
        )

    def close(self) -> None:
        pass


def open_gpus(kind: Literal["nvml", "sim"], sim_dir: str | os.PathLike[str] | None = None) -> Gpus:
    """The GPU seam for `kind`. `sim` needs `sim_dir` (the simulated host's directory)."""
    if kind == "nvml":
        return NvmlGpus()
    if kind == "sim":
        if sim_dir is None:
            raise ConfigError("open_gpus('sim') needs sim_dir: the simulated host's directory (HARU_SIM_DIR)")
        return SimGpus(sim_dir)
    raise ConfigError(f"GPU kind {kind!r} is not 'nvml' or 'sim'")
