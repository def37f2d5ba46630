"""The agent's one way to write a model's residency: an observation in, the table's event out.

`Recorder.record(m, observation)` asks `agents.observe.observe` what the observation means for the
model as recorded, stamps the event's cause (haru.core.causes), appends it with the subject's expected
sequence (agents/appender.py) and moves the model's recorded state by the fleet's table
(haru.core.residency.evolve). Serialized per model (`m.append_lock`). A pair the decision table refuses
raises `IllegalObservation`: nothing is appended.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgspec

from haru.agents.appender import Append
from haru.agents.cause import COMMAND_CAUSE
from haru.agents.gpu_watch import GpuWatcher
from haru.agents.model_slot import ModelSlot
from haru.agents.observe import GpuGone, Observation, ProbeFailed, observe
from haru.core import causes
from haru.core.events import Event
from haru.core.residency import event_key, evolve
from haru.core.specs import model_gpus

__all__ = ["Recorder"]

_LOGGED = ("reason", "detail", "attempt", "warmup_ms", "exit_code", "pid")


class Recorder:
    def __init__(
        self,
        *,
        domain: str,
        append: Append,
        gpu: GpuWatcher,
        agent_seq: Callable[[], int],
        stopping: Callable[[], bool],
        logger: Any,
    ) -> None:
        self.domain = domain
        self.append = append
        self.gpu = gpu
        self.agent_seq = agent_seq
        self.stopping = stopping
        self.logger = logger

    def about(self, m: ModelSlot) -> dict[str, Any]:
        """The fields every observation of `m` carries: when, which domain, which model."""
        return {"at": datetime.now(UTC), "domain": self.domain, "model": m.name}

    async def record(self, m: ModelSlot, observation: Observation) -> Event | None:
        """Append what the table decides for `observation` of `m` (None: nothing to write)."""
        gpu_detached = isinstance(observation, GpuGone) or (
            isinstance(observation, ProbeFailed) and observation.reason == "gpu_detached"
        )
        index = m.spec.gpu_index
        if gpu_detached and m.spec.gpu_indexes:
            # a model across GPUs (tensor parallel): the GPU of its loss is the first of them that is gone
            index = next((i for i in model_gpus(m.spec) if self.gpu.read(i).present is False), index)
        if gpu_detached and not self.gpu.gone_seq(index):
            # Record the GPU's absence first, so the loss can cite the observation that showed it.
            try:
                await self.gpu.observe(index)
            except Exception:
                self.logger.exception("could not record the GPU's absence before the loss", model=m.name)
        async with m.append_lock:
            event = observe(m.state, observation)
            if event is None:
                return None
            event = causes.with_cause(
                event,
                causes.residency_cause(
                    event,
                    prev_tag=m.state_tag,
                    prev_seq=m.seq,
                    command=COMMAND_CAUSE.get(),
                    gpu_gone=self.gpu.gone_seq(index),
                    agent=self.agent_seq(),
                    stopping=self.stopping(),
                ),
            )
            m.seq = await self.append(m.subject, event, m.seq)
            m.state = evolve(m.state, event, seq=m.seq, subject=m.subject)  # the table wrote only legal events
        self.logger.info(
            event_key(event), model=m.name, **{k: v for k, v in msgspec.to_builtins(event).items() if k in _LOGGED}
        )
        return event
