"""The host's model slots: each admitted model, its runtime and its supervisor (agents/supervisor.py).

Starts each model's supervisor (adopting the runtime a previous agent left, agents/adoption.py), adds,
replaces and retires models when a layout is applied live (agents/live_apply.py), hands a command the
supervisors of the models it names, and unloads (or keeps, for the next agent) every runtime when the
agent stops. Everything a model goes through is recorded by the recorder (agents/recorder.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from haru.agents.adoption import Adoptable, find_runtimes
from haru.agents.model_slot import RUNTIME_STOP_GRACE_S, ModelSlot, awake_on
from haru.agents.observe import Observation, PullInterrupted, Unloaded, observe
from haru.agents.ports import Selection
from haru.agents.recorder import Recorder
from haru.agents.runtime_files import RuntimeFiles
from haru.agents.runtimes import Runtime
from haru.agents.supervisor import ModelSupervisor, SupervisorContext
from haru.core import subjects
from haru.core.commands import Command
from haru.core.errors import IllegalTransition
from haru.core.events import AdapterStateChanged
from haru.core.residency import to_state
from haru.core.specs import ModelSpec, model_gpus
from haru.host.tasks import cancel_and_wait
from haru.log.seam import EventReader

__all__ = ["ModelSlots"]

Spawn = Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]]


class ModelSlots:
    def __init__(
        self,
        *,
        fleet: str,
        domain: str,
        log: EventReader,
        models: dict[str, ModelSlot],
        runtime_for: Callable[[ModelSpec], Runtime],
        recorder: Recorder,
        files: RuntimeFiles,
        context: SupervisorContext,
        spawn: Spawn,
        logger: Any,
    ) -> None:
        self.fleet = fleet
        self.domain = domain
        self.log = log
        self.runtime_for = runtime_for
        self.recorder = recorder
        self.files = files
        self.context = context
        self.spawn = spawn
        self.logger = logger
        # model -> its slot (`new` makes one; the agent admits them). The agent's one mapping, shared with the
        # parts that read the models as they are now (the owners, the training policy): only this adds and removes.
        self.models = models
        self.supervisors: dict[str, ModelSupervisor] = {}  # model -> its supervisor
        self._tasks: dict[str, asyncio.Task[Any]] = {}  # model -> its supervisor's task
        self.adoptable: dict[str, Adoptable] = {}  # model -> the identity of a live runtime found at boot
        self.away: dict[str, str] = {}  # model -> what is known of a runtime that died while no agent watched

    def new(self, spec: ModelSpec) -> ModelSlot:
        return ModelSlot(spec, self.runtime_for(spec), subjects.model(self.fleet, self.domain, spec.name))

    async def load_tip(self, m: ModelSlot) -> None:
        """Continue the model subject's chain from its last event (the sequence the next append expects),
        and take the state it records as the model's last known one."""
        rec = await self.log.last(m.subject)
        if rec is not None:
            m.seq = rec.seq
            if isinstance(rec.event, AdapterStateChanged):
                # the subject also carries its runtime's adapters (agents/adapters.py): the residency is the
                # last residency event before them
                recs = [r for r in await self.log.tail(m.subject, 256) if not isinstance(r.event, AdapterStateChanged)]
                rec = recs[-1] if recs else None
            if rec is not None and rec.event is not None:
                with contextlib.suppress(IllegalTransition):
                    m.state = to_state(rec.event, rec.seq)

    def supervise(self, m: ModelSlot) -> None:
        """Start `m`'s supervisor (adopting the runtime a previous agent left, if one was found)."""
        supervisor = ModelSupervisor(
            m, self.context, found=self.adoptable.pop(m.name, None), away=self.away.pop(m.name, "")
        )
        self.supervisors[m.name] = supervisor
        self._tasks[m.name] = self.spawn(supervisor.run(), f"model:{m.name}")

    async def add(self, spec: ModelSpec) -> ModelSlot:
        """A model the layout gained (or changed): its slot, its chain's tip, its supervisor."""
        m = self.models[spec.name] = self.new(spec)
        await self.load_tip(m)
        self.supervise(m)
        return m

    async def retire(self, name: str, why: str) -> None:
        """Stop a model the layout no longer has (or changed), and record `model_stopped`."""
        m = self.models.get(name)
        if m is None:
            return
        self.supervisors.pop(name, None)
        task = self._tasks.pop(name, None)
        if task is not None:
            await cancel_and_wait(task)
        async with m.lock:
            was_alive = m.runtime.alive()
            m.on_purpose = True
            if m.runtime.kind != "external":
                await m.runtime.stop(RUNTIME_STOP_GRACE_S)
            self.files.drop_identity(name)
            await self.recorder.record(
                m, Unloaded(**self.recorder.about(m), ran=was_alive or m.runtime.kind == "external", detail=why)
            )
        m.exited.set()
        del self.models[name]

    async def replace(self, spec: ModelSpec) -> None:
        await self.retire(spec.name, "the layout changed this model")
        await self.add(spec)

    def supervisor(self, m: ModelSlot) -> ModelSupervisor:
        """The supervisor of `m`: a command's sleep, wake and probe go to it."""
        return self.supervisors[m.name]

    def recheck(self, m: ModelSlot) -> None:
        """Probe `m` now (the serving port saw its runtime fail a request), once at a time."""
        supervisor = self.supervisors.get(m.name)
        if supervisor is not None and supervisor.m is m:
            supervisor.recheck()

    def selected(self, command: Command) -> Selection:
        """The models a command names (all admitted ones when it names none), and the names this host lacks."""
        if not command.models:
            return Selection(models=list(self.models.values()))
        return Selection(
            models=[self.models[n] for n in command.models if n in self.models],
            unknown=[n for n in command.models if n not in self.models],
        )

    def awake_on(self, gpu_index: int) -> list[str]:
        """Models on GPU `gpu_index` that can sleep and are not asleep (training there would fight them for VRAM)."""
        return awake_on(self.models, gpu_index)

    def gpu_went_away(self, index: int) -> None:
        """The provider took GPU `index`: say so for every model on it now, not at each one's next probe,
        before a failover's demotion can ask one of them to sleep."""
        for m in self.models.values():
            if index in model_gpus(m.spec) and m.runtime.kind != "external" and m.name in self.supervisors:
                self.spawn(self.supervisors[m.name].check(), f"gpu-gone:{m.name}")

    async def settled(self) -> None:
        """Until every model's first load attempt has come to rest (models added meanwhile too)."""
        while waiting := [m for m in self.models.values() if not m.settled.is_set()]:
            await asyncio.gather(*(m.settled.wait() for m in waiting))

    # ------------------------------------------------------------- runtimes that outlive the agent

    async def find_runtimes(
        self, state_dir: Path, *, probe_timeout_s: float, why_unwanted: Callable[[str], str] | None = None
    ) -> None:
        """What a previous agent left: runtimes to adopt, and ones that died while no agent watched.
        `why_unwanted(model)`: why a runtime no admitted model claims is stopped (the slots' `retire_why`:
        gone from the layout, or declared but no longer admitted)."""
        found = await find_runtimes(
            state_dir,
            self.models,
            probe_timeout_s=probe_timeout_s,
            unwanted=self._record_unwanted,
            logger=self.logger,
            **({"why_unwanted": why_unwanted} if why_unwanted else {}),
        )
        self.adoptable.update(found.adoptable)
        self.away.update(found.away)

    async def _record_unwanted(self, name: str, why: str) -> None:
        """`model_stopped` on the model's subject for a runtime stopped because the layout changed."""
        m = self.models.get(name)
        unloaded = Unloaded(at=datetime.now(UTC), domain=self.domain, model=name, ran=True, detail=why)
        if m is not None:
            await self.recorder.record(m, unloaded)
            return
        subject = subjects.model(self.fleet, self.domain, name)
        rec = await self.log.last(subject)
        if rec is None or rec.event is None:
            return
        try:
            state = to_state(rec.event, rec.seq)
        except IllegalTransition:
            return  # not a residency event: nothing of ours to close
        event = observe(state, unloaded)
        if event is not None:
            await self.recorder.append(subject, event, rec.seq)

    def keep_all(self) -> None:
        """A restart: every runtime keeps serving; its identity file stays for the next agent."""
        for m in self.models.values():
            self.files.write_identity(m.name, m.runtime)
        self.logger.info(
            "runtimes kept for the next agent",
            models=[m.name for m in self.models.values() if m.runtime.alive() and m.runtime.pid],
        )

    async def unload(self, m: ModelSlot) -> None:
        """Stop a runtime on purpose, and record `model_stopped` when there was something to unload."""
        if m.runtime.kind == "external":
            return
        if m.state_tag == "pulling":  # stopped mid-pull: nothing runs; the .part stays for the next start
            await self._record_on_the_way_out(
                m,
                PullInterrupted(
                    **self.recorder.about(m), detail="agent shutdown during the pull (the next start resumes it)"
                ),
            )
            return
        was_alive = m.runtime.alive()
        m.on_purpose = True
        await m.runtime.stop(RUNTIME_STOP_GRACE_S)
        self.files.drop_identity(m.name)
        await self._record_on_the_way_out(m, Unloaded(**self.recorder.about(m), ran=was_alive, detail="agent shutdown"))

    async def _record_on_the_way_out(self, m: ModelSlot, observation: Observation) -> None:
        """Record while stopping: a failure (the log gone) is logged with its traceback, never raised."""
        try:
            await self.recorder.record(m, observation)
        except Exception:
            self.logger.exception(
                "could not record on the way out", model=m.name, observation=type(observation).__name__
            )
