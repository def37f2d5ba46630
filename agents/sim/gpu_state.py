"""The simulated GPU: one small JSON state file per GPU, shared by every process on the "host".

    <sim_dir>/gpu<index>.json   {"index", "present", "name", "memory_total_bytes",
                                 "allocations": {"<pid>": bytes, ...}}
    <sim_dir>/gpu<index>.lock   the fcntl lock every read-modify-write takes

The simulated vLLM server, the simulated trainer and `haru sim` all update the file; every update is
a read-modify-write under an exclusive `flock` and lands with write-temp + `os.replace`, so a reader
(which takes no lock) always sees a whole file. Memory used is the sum of the allocations of pids
that are still alive: a process that was SIGKILLed (or is a zombie nobody reaped yet) holds nothing,
as a real driver frees a dead process's memory. Dead pids are dropped from the file on the next write.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

from haru.agents.sim.errors import BadSize, NoSimGpu
from haru.core import sizes
from haru.core.sizes import GiB, MiB  # noqa: F401 - the sizes a sim is set up in, importable beside it
from haru.host import procfs

DEFAULT_GPU_NAME = "Haru Sim GPU"


def parse_size(text: str | int) -> int:
    """Bytes from `4294967296`, `"4GiB"`, `"512MiB"`, `"1.5GB"` (haru.core.sizes). Raises BadSize with the fix."""
    try:
        return sizes.parse_size(text)
    except ValueError as exc:
        raise BadSize(f"{exc}; write e.g. 4GiB, 512MiB or 1073741824") from None


def gpu_path(sim_dir: str | os.PathLike[str], index: int) -> Path:
    return Path(sim_dir) / f"gpu{index}.json"


def gpu_indexes(sim_dir: str | os.PathLike[str]) -> list[int]:
    """The indexes of the simulated GPUs that exist in `sim_dir`, sorted."""
    out = []
    for path in Path(sim_dir).glob("gpu*.json"):
        digits = path.stem[3:]
        if digits.isdigit():
            out.append(int(digits))
    return sorted(out)


class SimGpuState:
    """Read and update one simulated GPU file (`<sim_dir>/gpu<index>.json`)."""

    def __init__(self, sim_dir: str | os.PathLike[str], index: int) -> None:
        self.sim_dir = Path(sim_dir)
        self.index = int(index)
        self.path = gpu_path(sim_dir, index)
        self._lock_path = self.sim_dir / f"gpu{self.index}.lock"

    # ------------------------------------------------------------------------------------- public

    def exists(self) -> bool:
        return self.path.exists()

    def ensure(self, memory_total_bytes: int, name: str = DEFAULT_GPU_NAME) -> dict:
        """Create the GPU (present, nothing allocated) unless it exists; an existing GPU is left as it is."""
        self.sim_dir.mkdir(parents=True, exist_ok=True)
        with self._locked():
            if self._load() is None:
                self._store(
                    {
                        "index": self.index,
                        "present": True,
                        "name": name,
                        "memory_total_bytes": int(memory_total_bytes),
                        "allocations": {},
                    }
                )
        return self.read()

    def allocate(self, pid: int, nbytes: int) -> bool:
        """Set `pid`'s allocation to `nbytes` (replacing what it held). False = out of memory or GPU absent."""
        with self._locked():
            raw = self._require()
            allocations = _live(raw["allocations"])
            others = sum(n for key, n in allocations.items() if key != str(pid))
            if not raw.get("present", True) or others + int(nbytes) > int(raw["memory_total_bytes"]):
                raw["allocations"] = allocations  # a failed allocation leaves what the pid held
                self._store(raw)
                return False
            allocations[str(pid)] = int(nbytes)
            raw["allocations"] = allocations
            self._store(raw)
            return True

    def free(self, pid: int) -> None:
        """Drop `pid`'s allocation (no error if it held nothing or the GPU does not exist)."""
        with self._locked():
            raw = self._load()
            if raw is None:
                return
            allocations = _live(raw["allocations"])
            allocations.pop(str(pid), None)
            raw["allocations"] = allocations
            self._store(raw)

    def set_present(self, present: bool) -> None:
        """Attach (True) or detach (False) the GPU. Detaching keeps the allocations: the processes still hold them."""
        with self._locked():
            raw = self._require()
            raw["present"] = bool(present)
            raw["allocations"] = _live(raw["allocations"])
            self._store(raw)

    def set_signs(
        self, *, xid: int | None = None, ecc_uncorrected: int | None = None, pages_pending: bool | None = None
    ) -> None:
        """Signs that the GPU is about to go, as NVML reports them (agents/signals.py reads them):
        the last critical XID, uncorrected ECC errors, retired pages pending. None leaves one as it is."""
        with self._locked():
            raw = self._require()
            for key, value in (("xid", xid), ("ecc_uncorrected", ecc_uncorrected), ("pages_pending", pages_pending)):
                if value is not None:
                    raw[key] = value
            raw["allocations"] = _live(raw["allocations"])
            self._store(raw)

    def read(self) -> dict:
        """The GPU as it is now: the file's fields, live allocations only, plus used and free bytes.

        Raises NoSimGpu when the file does not exist.
        """
        raw = self._load()
        if raw is None:
            raise NoSimGpu(
                f"simulated GPU {self.index} does not exist ({self.path}); create it with `haru sim add-gpu`"
            )
        allocations = _live(raw.get("allocations", {}))
        total = int(raw.get("memory_total_bytes", 0))
        used = sum(allocations.values())
        return {
            "index": int(raw.get("index", self.index)),
            "present": bool(raw.get("present", True)),
            "name": str(raw.get("name", DEFAULT_GPU_NAME)),
            "memory_total_bytes": total,
            "memory_used_bytes": used,
            "memory_free_bytes": max(total - used, 0),
            "allocations": allocations,
            "xid": int(raw.get("xid", 0)),
            "ecc_uncorrected": int(raw.get("ecc_uncorrected", 0)),
            "pages_pending": bool(raw.get("pages_pending", False)),
        }

    # ------------------------------------------------------------------------------------ private

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.sim_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _load(self) -> dict | None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        raw = json.loads(data)
        raw.setdefault("allocations", {})
        return raw

    def _require(self) -> dict:
        raw = self._load()
        if raw is None:
            raise NoSimGpu(
                f"simulated GPU {self.index} does not exist ({self.path}); create it with `haru sim add-gpu`"
            )
        return raw

    def _store(self, raw: dict) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(raw, indent=1, sort_keys=True))
        os.replace(tmp, self.path)


def _live(allocations: dict) -> dict[str, int]:
    return {pid: int(n) for pid, n in allocations.items() if procfs.pid_alive(int(pid))}
