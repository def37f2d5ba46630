"""The GPU seam: what a host's GPUs hold, read through one small Protocol.

    Gpus.read(index) -> GpuReading      synchronous and cheap; never raises
    Gpus.close()

    NvmlGpus   the real GPUs, through pynvml (NVML)
    SimGpus    the simulated GPUs of agents/sim (one JSON state file per GPU)

`present` is three-valued, and honest about it: True (the GPU answers), False (it is gone: lost,
not found, or no such index), None (this host cannot know: no NVML library or driver). Nothing
here guesses. A MIG-partitioned GPU is read per MIG instance (memory and processes summed over
the instances) instead of failing, and says `mig=True`.

Per-process memory comes from `nvmlDeviceGetComputeRunningProcesses_v3`, else `_v2` on a driver
without v3 (pynvml's unversioned name raises a library-mismatch error there, not an NVMLError).
`accounted` says the figures are usable: NVML answered and attributed every process's memory.

    account(processes, owners, exclude) -> (usage, foreign)    pure: per owner's process tree, vs plan
    process_tree(roots, parents) -> set of pids                 pure; `read_parents()` reads /proc
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Literal, Protocol

import msgspec

from haru.agents.sim.errors import SimError
from haru.agents.sim.gpu_state import SimGpuState
from haru.core.errors import ConfigError
from haru.core.events import GpuProcess, GpuUsage
from haru.host import procfs


class GpuReading(msgspec.Struct, frozen=True):
    index: int
    present: bool | None
    name: str = ""
    memory_total_bytes: int = 0
    memory_used_bytes: int = 0
    memory_free_bytes: int = 0
    processes: list[GpuProcess] = []
    mig: bool = False
    accounted: bool = False  # per-process memory was read and attributed (see the module docstring)


class Gpus(Protocol):
    def read(self, index: int) -> GpuReading: ...

    def close(self) -> None: ...


# ------------------------------------------------------------------------------------------ NVML


def _pynvml() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the `pynvml` shim warns that it is deprecated
        import pynvml
    return pynvml


def nvml_device_count() -> int | None:
    """NVIDIA GPUs NVML sees; None where NVML cannot be read (no library, no driver), never a guess."""
    nvml = _pynvml()
    try:
        nvml.nvmlInit()
    except Exception:
        return None
    try:
        return int(nvml.nvmlDeviceGetCount())
    except nvml.NVMLError:
        return None
    finally:
        nvml.nvmlShutdown()


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
            per_unit = [self._processes(unit) for unit in units]
        except nvml.NVMLError as exc:
            return GpuReading(index=index, present=presence_from_nvml_error(exc.value))
        return GpuReading(
            index=index,
            present=True,
            name=name,
            memory_total_bytes=total,
            memory_used_bytes=used,
            memory_free_bytes=free,
            processes=[p for procs, _known in per_unit for p in procs],
            mig=mig,
            accounted=all(known for _procs, known in per_unit),
        )

    def close(self) -> None:
        if self.available:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
            self.unavailable = "closed"

    def _mig_enabled(self, handle: Any) -> bool:
        nvml = self._nvml
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError:
            return False  # NOT_SUPPORTED: a GPU without MIG
        return bool(current == nvml.NVML_DEVICE_MIG_ENABLE)

    def _mig_handles(self, handle: Any) -> list[Any]:
        nvml = self._nvml
        out = []
        for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                out.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i))
            except nvml.NVMLError as exc:
                if exc.value != nvml.NVML_ERROR_NOT_FOUND:  # NOT_FOUND: that MIG slot is not instantiated
                    raise
        return out

    def _memory(self, handle: Any, units: list[Any], mig: bool) -> tuple[int, int, int]:
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

    def _processes(self, handle: Any) -> tuple[list[GpuProcess], bool]:
        """The compute processes on `handle`, and whether their memory is known (attributed)."""
        nvml = self._nvml
        procs = None
        for fn in ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"):
            try:
                procs = getattr(nvml, fn)(handle)
                break
            except nvml.NVMLError as exc:
                if exc.value == nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    continue  # an older driver: try the previous version
                if exc.value == nvml.NVML_ERROR_NOT_SUPPORTED:
                    return [], False
                raise
        if procs is None:
            return [], False
        # usedGpuMemory is None when NVML cannot attribute memory (e.g. Windows WDDM, some MIG setups).
        known = all(p.usedGpuMemory is not None for p in procs)
        return [GpuProcess(pid=int(p.pid), used_bytes=int(p.usedGpuMemory or 0)) for p in procs], known


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
            processes=[
                GpuProcess(pid=int(pid), used_bytes=n)
                for pid, n in sorted(state["allocations"].items(), key=lambda kv: int(kv[0]))
            ]
            if present
            else [],
            accounted=bool(present),
        )

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------ accounting


class Owner(msgspec.Struct, frozen=True, kw_only=True):
    """Something Haru started on a GPU: a model's runtime or a training slot, its process tree and plan."""

    name: str
    kind: str = "model"  # model | training
    pids: frozenset[int] = frozenset()
    planned_bytes: int = 0


def account(
    processes: list[GpuProcess], owners: list[Owner], exclude: frozenset[int] = frozenset()
) -> tuple[list[GpuUsage], list[GpuProcess]]:
    """Each owner's memory on the GPU (summed over its tree's processes) against its plan, and the
    processes nobody Haru started owns (`foreign`, minus `exclude`, e.g. the agent itself). Pure."""
    by_pid: dict[int, int] = {}
    for p in processes:
        by_pid[p.pid] = by_pid.get(p.pid, 0) + p.used_bytes
    usage: list[GpuUsage] = []
    owned: set[int] = set()
    for o in owners:
        pids = sorted(pid for pid in by_pid if pid in o.pids)
        owned.update(pids)
        used = sum(by_pid[pid] for pid in pids)
        usage.append(
            GpuUsage(
                name=o.name,
                kind=o.kind,  # type: ignore[arg-type]
                pids=pids,
                used_bytes=used,
                planned_bytes=o.planned_bytes,
                over_plan=used > o.planned_bytes,
            )
        )
    foreign = [
        GpuProcess(pid=pid, used_bytes=n)
        for pid, n in sorted(by_pid.items())
        if pid not in owned and pid not in exclude
    ]
    return usage, foreign


def process_tree(roots: set[int] | frozenset[int], parents: dict[int, int]) -> frozenset[int]:
    """`roots` and all their descendants, given pid -> parent pid. Pure."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out: set[int] = set()
    todo = [r for r in roots if r]
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.add(pid)
        todo.extend(children.get(pid, ()))
    return frozenset(out)


def read_parents() -> dict[int, int]:
    """pid -> parent pid for every process, from /proc (empty where there is no /proc)."""
    return {st.pid: st.ppid for st in procfs.every()}


def open_gpus(kind: Literal["nvml", "sim"], sim_dir: str | os.PathLike[str] | None = None) -> Gpus:
    """The GPU seam for `kind`. `sim` needs `sim_dir` (the simulated host's directory)."""
    if kind == "nvml":
        return NvmlGpus()
    if kind == "sim":
        if sim_dir is None:
            raise ConfigError("open_gpus('sim') needs sim_dir: the simulated host's directory (HARU_SIM_DIR)")
        return SimGpus(sim_dir)
    raise ConfigError(f"GPU kind {kind!r} is not 'nvml' or 'sim'")
