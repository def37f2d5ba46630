"""Training slots: the preemptible workload a standby runs in the VRAM its sleeping runtimes freed.

The slot's command is spawned verbatim (no arguments appended, no shell), in its own process group
(its own session), with the agent's environment plus exactly two variables:

    HARU_CHECKPOINT_DIR   the slot's checkpoint_dir: checkpoint there, resume from it on start
    HARU_GPU_INDEX        the slot's GPU: pin yourself to it

Stop = SIGTERM to the whole group, SIGKILL to the group after the grace; failover never waits for a
perfect checkpoint. How it ended is one of `exited` (on its own), `terminated` (it obeyed SIGTERM
within the grace), `killed` (SIGKILL after the grace).

`Trainer` is the process half only; the agent records `training_started`/`training_stopped`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from haru.agents.errors import TrainingProblem
from haru.agents.runtimes.base import killpg
from haru.core.events import StopHow
from haru.core.launch import with_interpreter
from haru.core.specs import TrainingSpec
from haru.host import procfs
from haru.host.children import die_with_parent

__all__ = ["Trainer", "Ended", "training_env"]


class Ended(msgspec.Struct, frozen=True, kw_only=True):
    how: StopHow
    exit_code: int | None
    ran_ms: int
    pid: int


def training_env(base: dict[str, str], spec: TrainingSpec) -> dict[str, str]:
    """The trainer's environment: `base` plus HARU_CHECKPOINT_DIR and HARU_GPU_INDEX, and
    CUDA_DEVICE_ORDER=PCI_BUS_ID, without which CUDA numbers GPUs fastest first: HARU_GPU_INDEX is in
    NVML's order (PCI bus order), so on a mixed-GPU host a trainer pinning
    CUDA_VISIBLE_DEVICES=$HARU_GPU_INDEX would land on another card (runtimes get the same)."""
    env = dict(base)
    env["HARU_CHECKPOINT_DIR"] = os.path.expanduser(spec.checkpoint_dir)
    env["HARU_GPU_INDEX"] = str(spec.gpu_index)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return env


OnExit = Callable[[Ended], Awaitable[None]]


class Trainer:
    """One training slot's process. start/stop are idempotent; `on_exit` hears an exit nobody asked for."""

    def __init__(
        self,
        spec: TrainingSpec,
        *,
        grace_ms: int,
        log_dir: Path,
        on_exit: OnExit | None = None,
        base_env: dict[str, str] | None = None,
    ) -> None:
        self.spec = spec
        self.grace_ms = spec.grace_ms or grace_ms
        self._log_path = Path(log_dir) / f"training-{spec.slot}.log"
        self._on_exit = on_exit
        self._base_env = base_env
        self._proc: asyncio.subprocess.Process | None = None
        self._started = 0.0
        self._stopping = False
        self._watch: asyncio.Task | None = None
        self._ended: Ended | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running() and self._proc else None

    @property
    def pgid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    @property
    def ended(self) -> Ended | None:
        return self._ended

    def ran_ms(self) -> int:
        return int((time.monotonic() - self._started) * 1000) if self._started else 0

    async def start(self) -> int:
        """Spawn the command; returns its pid. Raises TrainingProblem if it cannot be spawned."""
        if self.running():
            return self._proc.pid  # type: ignore[union-attr]
        if not self.spec.command:
            raise TrainingProblem(f"training slot {self.spec.slot!r} has an empty command; declare one in the layout")
        ckpt = Path(os.path.expanduser(self.spec.checkpoint_dir))
        try:
            ckpt.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TrainingProblem(
                f"training slot {self.spec.slot!r}: cannot create checkpoint_dir {str(ckpt)!r}: {exc}"
            ) from exc
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        env = training_env(dict(os.environ) if self._base_env is None else self._base_env, self.spec)
        with open(self._log_path, "ab") as log:
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    *with_interpreter(self.spec.command, sys.executable),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    preexec_fn=die_with_parent(
                        signal.SIGTERM
                    ),  # its grace to checkpoint when the agent dies, even by SIGKILL
                )
            except OSError as exc:
                raise TrainingProblem(
                    f"training slot {self.spec.slot!r}: cannot start {self.spec.command[0]!r}: {exc}"
                ) from exc
        self._started = time.monotonic()
        self._stopping = False
        self._ended = None
        self._watch = asyncio.ensure_future(self._watch_exit(self._proc))
        return self._proc.pid

    async def _watch_exit(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if self._stopping or self._proc is not proc:
            return
        killpg(proc.pid, signal.SIGKILL)  # whatever it left behind in its group
        self._ended = Ended(how="exited", exit_code=code, ran_ms=self.ran_ms(), pid=proc.pid)
        if self._on_exit is not None:
            await self._on_exit(self._ended)

    async def stop(self) -> Ended | None:
        """SIGTERM to the group, SIGKILL after the grace. None if it was not running."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return None
        self._stopping = True
        killpg(proc.pid, signal.SIGTERM)
        how: StopHow = "terminated"
        try:
            async with asyncio.timeout(self.grace_ms / 1000):
                await proc.wait()
        except TimeoutError:
            how = "killed"
            killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        killpg(proc.pid, signal.SIGKILL)  # stragglers in the group
        self._ended = Ended(how=how, exit_code=proc.returncode, ran_ms=self.ran_ms(), pid=proc.pid)
        return self._ended

    def group_pids(self) -> set[int]:
        """Every live pid in the trainer's process group (it may have forked workers)."""
        pgid = self.pgid
        if pgid is None:
            return set()
        return pids_in_group(pgid)


def pids_in_group(pgid: int) -> set[int]:
    return {st.pid for st in procfs.every() if st.pgrp == pgid and not st.zombie}
