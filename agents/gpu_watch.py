"""The GPU watcher: reads each of the host's GPUs (NVML, or the simulated GPU file, through `Gpus`) and
appends `gpu_observed` on `haru.evt.<fleet>.<domain>.gpu.<index>` only when something changed (presence,
memory moved by at least GPU_USED_THRESHOLD, processes, MIG, per-process accounting).

It owns the last observation recorded per GPU and whether it ever saw each GPU present (`went_away`:
the GPU was there and is not, so the provider took it). What to do about a GPU that just went away is
the listeners' (`on_gone`, registered after construction: the model slots, which record through this
watcher); what Haru started on a GPU comes from `owners(index)`. The loop (`run`)
logs and counts a failing read or append (`LoopErrors["gpus"]`) and goes on.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from haru.agents.appender import Append
from haru.agents.gpu import GpuReading, Gpus, Owner, account
from haru.agents.loops import LoopErrors, survive
from haru.core import subjects
from haru.core.events import GpuObserved, GpuProcess, GpuUsage
from haru.core.sizes import MiB
from haru.log.seam import EventReader

__all__ = ["GpuWatcher", "GPU_USED_THRESHOLD", "gpu_changed"]

GPU_USED_THRESHOLD = 64 * MiB  # memory moves smaller than this are noise, not an observation


def gpu_changed(
    last: GpuObserved, r: GpuReading, usage: list[GpuUsage] | None = None, foreign: list[GpuProcess] | None = None
) -> bool:
    if last.present != r.present or last.memory_total_bytes != r.memory_total_bytes or last.mig != r.mig:
        return True
    if last.accounted != r.accounted:
        return True
    if {u.name for u in last.usage if u.over_plan} != {u.name for u in usage or [] if u.over_plan}:
        return True  # an anomaly began or ended
    if {p.pid for p in last.foreign} != {p.pid for p in foreign or []}:
        return True
    if abs(last.memory_used_bytes - r.memory_used_bytes) >= GPU_USED_THRESHOLD:
        return True
    return {p.pid for p in last.processes} != {p.pid for p in r.processes}


class GpuWatcher:
    def __init__(
        self,
        *,
        fleet: str,
        domain: str,
        gpus: Gpus,
        append: Append,
        owners: Callable[[int], list[Owner]],
        exclude_pid: int,
        logger: Any,
    ) -> None:
        self.fleet = fleet
        self.domain = domain
        self.gpus = gpus
        self.append = append
        self.owners = owners
        self.on_gone: list[Callable[[int], None]] = []  # told of each GPU that just went away (registered after)
        self.exclude_pid = exclude_pid
        self.logger = logger
        self.seq: dict[int, int] = {}  # the GPU subject's last sequence
        self.last: dict[int, GpuObserved | None] = {}  # the last observation recorded
        self.seen: set[int] = set()  # GPUs this agent saw present
        self._lock = asyncio.Lock()  # the loop and verify_gpu both observe: one append per change

    async def load_tips(self, log: EventReader, indexes: Iterable[int]) -> None:
        """The tips of the GPU subjects: the watcher continues their chains."""
        for index in indexes:
            rec = await log.last(subjects.gpu(self.fleet, self.domain, index))
            self.seq[index] = rec.seq if rec is not None else 0
            self.last[index] = rec.event if rec is not None and isinstance(rec.event, GpuObserved) else None

    def read(self, index: int) -> GpuReading:
        r = self.gpus.read(index)
        if r.present:
            self.seen.add(index)
        return r

    def went_away(self, index: int) -> bool:
        """The GPU was there (this agent saw it) and now is not: the provider took it."""
        return self.read(index).present is False and index in self.seen

    def gone_seq(self, index: int) -> int:
        """The recorded observation that GPU `index` is gone (0 = none)."""
        last = self.last.get(index)
        return self.seq.get(index, 0) if last is not None and last.present is False else 0

    def accounting(self, r: GpuReading) -> tuple[list[GpuUsage], list[GpuProcess]]:
        """(usage, foreign) for a reading: empty when it carries no per-process figures."""
        if not r.present or not r.accounted:
            return [], []
        return account(r.processes, self.owners(r.index), exclude=frozenset({self.exclude_pid}))

    async def observe(self, index: int) -> GpuReading:
        """Read GPU `index` and record it if it changed; a GPU that just went away is `on_gone`'s."""
        async with self._lock:
            r = self.read(index)
            last = self.last.get(index)
            usage, foreign = self.accounting(r)
            if last is None or gpu_changed(last, r, usage, foreign):
                for u in usage:
                    if u.over_plan and not any(x.name == u.name and x.over_plan for x in (last.usage if last else [])):
                        self.logger.warning(
                            "over_plan",
                            gpu=index,
                            owner=u.name,
                            kind=u.kind,
                            used_bytes=u.used_bytes,
                            planned_bytes=u.planned_bytes,
                            pids=u.pids,
                        )
                event = GpuObserved(
                    at=datetime.now(UTC),
                    domain=self.domain,
                    index=index,
                    present=r.present,
                    name=r.name,
                    memory_total_bytes=r.memory_total_bytes,
                    memory_used_bytes=r.memory_used_bytes,
                    processes=list(r.processes),
                    mig=r.mig,
                    usage=usage,
                    foreign=foreign,
                    accounted=r.accounted,
                )
                self.seq[index] = await self.append(
                    subjects.gpu(self.fleet, self.domain, index), event, self.seq.get(index, 0)
                )
                self.last[index] = event
                if last is not None and last.present and not r.present:
                    for gone in self.on_gone:
                        gone(index)
            return r

    async def run(
        self, indexes: Callable[[], Iterable[int]], interval_s: Callable[[], float], errors: LoopErrors
    ) -> None:
        """Observe every GPU each interval; a GPU whose read or append raises is logged, counted, and
        observed again next round (the others are observed this round all the same)."""
        while True:
            for index in indexes():
                await survive(
                    functools.partial(self.observe, index), name="gpus", errors=errors, logger=self.logger, gpu=index
                )
            await asyncio.sleep(interval_s())
