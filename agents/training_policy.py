"""When training may run on this host: only on a standby, only in VRAM that sleeping runtimes freed.

A slot starts (a command's `start_training`, the standby's own start once its models have come to rest,
the resumption after a supervisor reloaded a runtime) only when this domain is not the active one and
no model on the slot's GPU is awake; `force` skips both checks. The slots themselves (start, stop,
record) are agents/training_slots.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from haru.agents.model_slot import ModelSlot, awake_on
from haru.agents.ports import Outcome
from haru.agents.role import Role
from haru.agents.training import Ended
from haru.agents.training_slots import TrainingSlots
from haru.core.specs import TrainingSpec

__all__ = ["TrainingPolicy"]


class TrainingPolicy:
    def __init__(
        self,
        slots: TrainingSlots,
        *,
        models: Mapping[str, ModelSlot],
        role: Role,
        auto: bool,
        stopping: Callable[[], bool],
        logger: Any,
    ) -> None:
        """`auto`: a standby starts its slots by itself once its models have come to rest."""
        self.slots = slots
        self.models = models
        self.role = role
        self.auto = auto
        self.stopping = stopping
        self.logger = logger

    def slot_names(self) -> list[str]:
        """The admitted training slots."""
        return list(self.slots.trainers)

    def pid(self, slot: str) -> int | None:
        """The pid of the slot's trainer (None when it never ran)."""
        return self.slots.trainers[slot].pid

    async def stop(self, slot: str) -> Ended | None:
        """Stop the slot's trainer (always allowed: stopping training is what a failover does first)."""
        return await self.slots.stop(slot)

    async def start(self, slot: str, *, force: bool = False) -> Outcome:
        """Start a slot's trainer, unless this domain is the active one or models on its GPU are awake
        (`force`: regardless)."""

        async def admit(spec: TrainingSpec) -> Outcome | None:
            return None if force else await self.refusal(spec)

        return await self.slots.start(slot, admit)

    async def refusal(self, spec: TrainingSpec) -> Outcome | None:
        """Why the slot may not start now (None: it may)."""
        if self.role.now == "active":
            await self.role.read()  # the pointer may have just moved (a settle right after a flip)
        if self.role.now == "active":
            return Outcome(
                ok=False,
                code="domain_active",
                detail=f"domain {self.role.domain!r} is the active domain "
                f"(route revision {self.role.revision}); training runs only on a standby",
            )
        busy = awake_on(self.models, spec.gpu_index)
        if busy:
            return Outcome(
                ok=False,
                code="gpu_busy",
                detail=f"GPU {spec.gpu_index} holds awake models "
                f"({', '.join(busy)}); put them to sleep first (training runs only in VRAM the sleeping "
                f"runtimes freed)",
            )
        return None

    async def resume(self, slots: list[str]) -> None:
        """Start again the slots a supervisor stopped to reload a runtime (on a standby only)."""
        if self.role.now != "standby":
            return
        for slot in slots:
            started = await self.start(slot)
            if not started.ok:
                self.logger.warning("could not resume training", slot=slot, code=started.code, detail=started.detail)

    async def initial(self) -> None:
        """A standby's own start: every slot, once every model's first load has come to rest."""
        await asyncio.gather(*(m.settled.wait() for m in self.models.values()))
        if not self.auto or self.role.now != "standby" or self.stopping():
            return
        for slot in self.slots.trainers:
            started = await self.start(slot)
            if not started.ok:
                self.logger.warning("standby training not started", slot=slot, code=started.code, detail=started.detail)
