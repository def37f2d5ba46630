"""The host's training slots: start and stop each slot's trainer, and record it.

    haru.evt.<fleet>.<domain>.training.<slot>   training_started / training_stopped / adapter_published

One lock for all slots (a start checks the GPU's models, a stop frees VRAM a reload waits for). Whether a
slot may start now (the domain's role, awake models on its GPU) is the caller's policy, asked under that
lock through `admit`. A trainer that exits 0 leaving a finished run's manifest has its adapter published
(agents/publishing.py) and recorded after its `training_stopped`; a start of that slot waits for the
publication (else the new trainer would find the manifest still there and exit at once), a stop never does.
Before a slot starts, its newest checkpoint is fetched from the bucket when another domain trained it since
(agents/checkpoint_travel.py). The running trainers' process groups are kept in the pid file
(agents/runtime_files.py) so a crashed agent's successor stops them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from haru.agents.appender import Append
from haru.agents.cause import COMMAND_CAUSE
from haru.agents.checkpoint_travel import CheckpointTravel
from haru.agents.errors import TrainingProblem
from haru.agents.ports import Outcome
from haru.agents.publishing import Publisher
from haru.agents.runtime_files import RuntimeFiles
from haru.agents.training import Ended, Trainer
from haru.core import causes, subjects
from haru.core.errors import LogError
from haru.core.events import Event, TrainingStarted, TrainingStopped
from haru.core.specs import TrainingSpec
from haru.log.seam import EventReader

__all__ = ["TrainingSlots"]

# admit(spec) under the lock: None = may start; an Outcome = the refusal to return
Admit = Callable[[TrainingSpec], Awaitable[Outcome | None]]


def _now() -> datetime:
    return datetime.now(UTC)


class TrainingSlots:
    def __init__(
        self,
        specs: Iterable[TrainingSpec],
        *,
        fleet: str,
        domain: str,
        grace_ms: int,
        log_dir: Path,
        append: Append,
        files: RuntimeFiles,
        agent_seq: Callable[[], int],
        stopping: Callable[[], bool],
        logger: Any,
        publisher: Publisher | None = None,
        travel: CheckpointTravel | None = None,
    ) -> None:
        self.fleet = fleet
        self.publisher = publisher
        self.travel = travel
        self.domain = domain
        self.append = append
        self.files = files
        self.agent_seq = agent_seq
        self.stopping = stopping
        self.logger = logger
        self.seq: dict[str, int] = {}  # each slot subject's last sequence
        self._lock = asyncio.Lock()
        self.trainers: dict[str, Trainer] = {
            t.slot: Trainer(t, grace_ms=grace_ms, log_dir=log_dir, on_exit=self._on_exit(t.slot)) for t in specs
        }
        self._exiting = {slot: asyncio.Lock() for slot in self.trainers}  # from a trainer's exit to its publication

    def running(self) -> list[str]:
        return [slot for slot, t in self.trainers.items() if t.running()]

    async def load_tips(self, log: EventReader, swept: dict[str, str]) -> None:
        """Continue each slot's chain. A slot the log says is running is not (the previous agent died with
        it: it got SIGTERM then, its parent-death signal, and `swept` stopped whatever ignored that, with
        the slot's grace): say how it ended."""
        for slot in self.trainers:
            rec = await log.last(subjects.training(self.fleet, self.domain, slot))
            self.seq[slot] = rec.seq if rec is not None else 0
            if rec is not None and isinstance(rec.event, TrainingStarted):
                await self._record(
                    slot,
                    TrainingStopped(
                        at=_now(),
                        domain=self.domain,
                        slot=slot,
                        how=swept.get(slot, "terminated"),  # type: ignore[arg-type]
                        exit_code=None,
                        ran_ms=0,
                    ),
                )

    async def start(self, slot: str, admit: Admit) -> Outcome:
        t = self.trainers[slot]
        async with self._exiting[slot], self._lock:
            if t.running():
                return Outcome(ok=True, detail=f"already running (pid {t.pid})")
            refused = await admit(t.spec)
            if refused is not None:
                return refused
            if self.travel is not None:  # the slot may have trained on another domain since it ran here
                await self.travel.fetch(t.spec)
            try:
                pid = await t.start()
            except TrainingProblem as exc:
                return Outcome(ok=False, code=exc.code, detail=str(exc))
            await self._record(
                slot, TrainingStarted(at=_now(), domain=self.domain, slot=slot, pid=pid, gpu_index=t.spec.gpu_index)
            )
            self.files.write_children(self.trainers.values())
        self.logger.info("training_started", slot=slot, pid=pid)
        return Outcome(ok=True, detail=f"started (pid {pid})")

    async def stop(self, slot: str) -> Ended | None:
        """Stop the slot's trainer (SIGTERM, SIGKILL after its grace); None if it was not running."""
        t = self.trainers[slot]
        async with self._lock:
            ended = await t.stop()
            if ended is not None:
                await self._stopped(slot, ended)
        return ended

    async def make_room(self, gpu_index: int) -> list[str]:
        """Stop every trainer on GPU `gpu_index`; the slots stopped."""
        stopped = []
        for slot, t in self.trainers.items():
            if t.spec.gpu_index == gpu_index and t.running():
                await self.stop(slot)
                stopped.append(slot)
        return stopped

    def _on_exit(self, slot: str) -> Callable[[Ended], Awaitable[None]]:
        async def on_exit(ended: Ended) -> None:
            async with self._exiting[slot]:
                async with self._lock:
                    await self._stopped(slot, ended)
                if ended.exit_code == 0 and self.publisher is not None:
                    await self._publish(slot)

        return on_exit

    async def _publish(self, slot: str) -> None:
        """Publish the run the slot's trainer finished (outside the lock: a stop for a failover never waits for an
        upload), then record it under the lock."""
        assert self.publisher is not None
        ready = await self.publisher.publish(self.trainers[slot].spec)
        if ready is None:
            return
        event, done = ready
        async with self._lock:
            await self._record(slot, event)
        done()
        if self.travel is not None:
            try:
                await self.travel.forget(self.trainers[slot].spec)
            except LogError as exc:
                self.logger.warning("checkpoint_not_forgotten", slot=slot, problem=str(exc))
        self.logger.info(
            "adapter_published", slot=slot, adapter=event.adapter, version=event.version, digest=event.digest
        )

    async def _stopped(self, slot: str, ended: Ended) -> None:
        await self._record(
            slot,
            TrainingStopped(
                at=_now(), domain=self.domain, slot=slot, how=ended.how, exit_code=ended.exit_code, ran_ms=ended.ran_ms
            ),
        )
        self.files.write_children(self.trainers.values())
        self.logger.info("training_stopped", slot=slot, how=ended.how, exit_code=ended.exit_code)

    async def _record(self, slot: str, event: Event) -> None:
        subject = subjects.training(self.fleet, self.domain, slot)
        event = causes.with_cause(
            event,
            causes.training_cause(event, command=COMMAND_CAUSE.get(), agent=self.agent_seq(), stopping=self.stopping()),
        )
        self.seq[slot] = await self.append(subject, event, self.seq.get(slot, 0))
