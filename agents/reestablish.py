"""After the event log lost events this agent was acknowledged: say again what is true now.

The log's receipt guard (haru/log/receipts.py) records the loss (`domain_log_regressed`) and then calls
`Reestablish`, which re-reports, on each subject that lost events, the state the agent holds now:
a model's residency (`haru.core.receipts.restated`: a resident model's `model_resident` again,
appended after whatever the log now holds there) and a GPU's observation (recorded afresh, as if
never seen). The agent never carries on from the shorter log: the views are true again as soon as
the projector folds these.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from haru.agents.appender import Append
from haru.agents.gpu_watch import GpuWatcher
from haru.agents.model_slot import ModelSlot
from haru.core import subjects
from haru.core.receipts import Regression, restated
from haru.core.residency import evolve
from haru.log.seam import EventReader

__all__ = ["Reestablish"]


class Reestablish:
    def __init__(
        self,
        *,
        fleet: str,
        domain: str,
        models: Mapping[str, ModelSlot],
        gpu: GpuWatcher,
        gpu_indexes: Any,
        append: Append,
        log: EventReader,
        logger: Any,
    ) -> None:
        self.fleet = fleet
        self.domain = domain
        self.models = models
        self.gpu = gpu
        self.gpu_indexes = gpu_indexes  # () -> the GPU indexes this agent watches
        self.append = append
        self.log = log
        self.logger = logger

    @classmethod
    def of(cls, agent: Any) -> Reestablish:
        """The re-establisher of a running agent (agents/agent.py's `Agent`)."""
        return cls(
            fleet=agent.fleet,
            domain=agent.domain,
            models=agent.models.models,
            gpu=agent.gpu_watch,
            gpu_indexes=agent.current.gpu_indexes,
            append=agent.append,
            log=agent.log,
            logger=agent.logger,
        )

    async def __call__(self, found: Iterable[Regression]) -> None:
        lost = {r.subject for r in found}
        for m in list(self.models.values()):
            if m.subject in lost:
                await self.model(m)
        for index in self.gpu_indexes():
            if subjects.gpu(self.fleet, self.domain, index) in lost:
                self.gpu.last.pop(index, None)  # as if never seen: the next observation is recorded
                self.gpu.seq[index] = await self.log.last_seq_of(subjects.gpu(self.fleet, self.domain, index))
                await self.gpu.observe(index)
                self.logger.warning("re-reported after the event log lost events", gpu=index)

    async def model(self, m: ModelSlot) -> None:
        async with m.append_lock:
            event = restated(m.state, domain=self.domain, model=m.name, at=datetime.now(UTC))
            if event is None:
                return
            m.seq = await self.append(m.subject, event, await self.log.last_seq_of(m.subject))
            m.state = evolve(m.state, event, seq=m.seq, subject=m.subject)
        self.logger.warning("re-reported after the event log lost events", model=m.name, state=m.state_tag)
