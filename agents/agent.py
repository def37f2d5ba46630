"""The agent: one per GPU host (= one domain). Supervises runtimes and training, and tells the truth.

    async with Agent.start(config) as agent:     # claims the domain, loads, heartbeats, serves
        await agent.stopped()                    # until SIGTERM/SIGINT (agent.request_stop())

What it writes (each append with the subject's expected last sequence, so it extends the chain it
found, after a crash too):

    haru.evt.<fleet>.<domain>.agent             agent_started / agent_stopping
    haru.evt.<fleet>.<domain>.model.<model>     residency transitions, from real signals
    haru.evt.<fleet>.<domain>.gpu.<index>       gpu_observed, only on change
    haru.evt.<fleet>.<domain>.training.<slot>   training_started / training_stopped
    haru.hb.<fleet>.<domain>                    a heartbeat every second (core NATS, not history)

One agent per domain: `agent_started` is appended with the expected sequence, after checking that
no live agent answers the domain's commands or heartbeats; a loser is refused (`AgentRefused`).

This module only wires the agent's parts (docs/agent.md, "Architecture"), starts them, boots them and
stops them:

    agents/claim.py            claiming the domain (agent_started / agent_stopping)
    agents/role.py             the role: the route pointer, followed
    agents/model_slots.py      each model, its runtime and its supervisor (agents/supervisor.py), which
                               writes what it sees through the recorder (agents/recorder.py, agents/observe.py)
    agents/live_apply.py       layouts applied live
    agents/training_policy.py  when a training slot may start (agents/training_slots.py starts it)
    agents/status.py           the status answer, the heartbeat, the GPUs' verdict and owners
    agents/commands.py         the command service, handed the parts that answer each verb
    agents/serving.py          the serving port

and the GPU watcher, the heartbeat, the runtime files and adoption, each a unit of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator

import aiohttp
import structlog

from haru.agents.appender import Appender
from haru.agents.claim import Claim
from haru.agents.commands import CommandService
from haru.agents.config import AgentConfig, HostSlots, fold_declarations, load_layout_slots, slots_from_host_entry
from haru.agents.gpu import Gpus, open_gpus
from haru.agents.gpu_watch import GpuWatcher
from haru.agents.heartbeat import Heartbeats
from haru.agents.live_apply import LiveApply
from haru.agents.load_queue import LoadQueue
from haru.agents.loops import LoopErrors, on_the_way_out
from haru.agents.model_slots import ModelSlots
from haru.agents.recorder import Recorder
from haru.agents.role import Role
from haru.agents.runtime_files import RuntimeFiles
from haru.agents.runtimes import Runtime, make_runtime
from haru.agents.serving import ServingProxy, check_serving
from haru.agents.signals import SignalWatcher, open_signals
from haru.agents.status import Status
from haru.agents.supervisor import SupervisorContext
from haru.agents.training_policy import TrainingPolicy
from haru.agents.training_slots import TrainingSlots
from haru.core import subjects
from haru.core.errors import ConfigError
from haru.core.events import FailureSignalled
from haru.core.specs import ModelSpec, model_gpus
from haru.host.tasks import cancel_and_wait
from haru.log.eventlog import EventLog

__all__ = ["Agent", "resolve_slots"]


async def resolve_slots(config: AgentConfig, log: EventLog) -> HostSlots:
    """This host's slots: the layout file, else the fleet's declarations, else the config's `host`."""
    if config.layout:
        return load_layout_slots(config.layout, config.fleet, config.domain)
    records = await log.history(subjects.decl(config.fleet))
    declared = fold_declarations(config.fleet, config.domain, [r.event for r in records if r.event is not None])
    if declared is not None:
        return declared
    if config.host is not None:
        return slots_from_host_entry(config.fleet, config.domain, config.host, config.policy)
    raise ConfigError(
        f"domain {config.domain!r} is not declared in fleet {config.fleet!r}: run `haru apply <layout>`, "
        f'or give the agent config a "layout" file or a "host" entry'
    )


class Agent:
    def __init__(
        self, config: AgentConfig, slots: HostSlots, log: EventLog, gpus: Gpus, session: aiohttp.ClientSession
    ) -> None:
        self.config = config
        self.log = log
        self.gpus = gpus
        self.session = session
        self.fleet = fleet = config.fleet
        self.domain = domain = config.domain
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.state_dir = config.state_path()
        self.logger = logger = structlog.get_logger("haru.agent").bind(fleet=fleet, domain=domain)
        self.direct = slots.domain.spec.serve == "direct"
        self.stopping = False
        self._stop = asyncio.Event()
        self._stop_reason = ""
        self.keep_runtimes = False
        self._tasks: list[asyncio.Task] = []
        self._service: CommandService | None = None
        self._serving: ServingProxy | None = None
        self.serving_url = ""
        stopping = lambda: self.stopping  # noqa: E731
        self.files = RuntimeFiles(self.state_dir, logger=logger)
        self.loop_errors = errors = LoopErrors()  # haru_agent_loop_errors_total{loop}
        self.append = Appender(log, stopping=stopping, logger=logger)
        self.claim = Claim(
            log,
            fleet=fleet,
            domain=domain,
            host=self.host,
            pid=self.pid,
            heartbeat_ms=config.heartbeat_ms,
            logger=logger,
        )
        self.gpu_watch = GpuWatcher(
            fleet=fleet,
            domain=domain,
            gpus=gpus,
            append=self.append,
            owners=lambda index: self.status.owners(index),
            on_gone=lambda index: self.models.gpu_went_away(index),
            exclude_pid=self.pid,
            logger=logger,
        )
        self.signals = SignalWatcher(
            domain=domain,
            gpus=open_signals(config.gpus, config.sim_dir),
            notice=slots.domain.spec.preemption_notice,
            record=self._record_signal,
            logger=logger,
            session=session,
        )
        self.training = TrainingSlots(
            slots.admitted_training,
            fleet=fleet,
            domain=domain,
            grace_ms=slots.policy.training_grace_ms,
            log_dir=self.state_dir,
            append=self.append,
            files=self.files,
            agent_seq=lambda: self.claim.seq,
            stopping=stopping,
            logger=logger,
        )
        self.recorder = Recorder(
            domain=domain,
            append=self.append,
            gpu=self.gpu_watch,
            agent_seq=lambda: self.claim.seq,
            stopping=stopping,
            logger=logger,
        )
        self.role = Role(
            log,
            fleet=fleet,
            domain=domain,
            pinned=config.role,
            first_domain=lambda: self.live.slots.first_domain,
            stopping=stopping,
            errors=errors,
            logger=logger,
        )
        context = SupervisorContext(
            domain=domain,
            record=self.recorder.record,
            about=self.recorder.about,
            gpu=self.gpu_watch,
            files=self.files,
            role=lambda: self.role.now,
            policy=lambda: self.live.slots.policy,
            stopping=stopping,
            stop_event=self._stop,
            spawn=self._spawn_task,
            make_room=self.training.make_room,
            resume_training=lambda slots: self.training_policy.resume(slots),
            errors=errors,
            logger=logger,
            loads=LoadQueue(order=lambda: [spec.name for spec in self.live.slots.admitted_models]),
        )
        self.models = ModelSlots(
            fleet=fleet,
            domain=domain,
            log=log,
            runtime_for=self._runtime_for,
            recorder=self.recorder,
            files=self.files,
            context=context,
            spawn=self._spawn_task,
            logger=logger,
        )
        self.live = LiveApply(
            slots,
            log=log,
            fleet=fleet,
            domain=domain,
            models=self.models,
            role=self.role,
            stopping=stopping,
            spawn=self._spawn_task,
            errors=errors,
            logger=logger,
        )
        for spec in slots.admitted_models:
            self.models.models[spec.name] = self.models.new(spec)
        self.training_policy = TrainingPolicy(
            self.training,
            models=self.models,
            role=self.role,
            auto=config.auto_training,
            stopping=stopping,
            logger=logger,
        )
        self.status = Status(
            fleet=fleet,
            domain=domain,
            host=self.host,
            pid=self.pid,
            role=self.role,
            live=self.live,
            models=self.models,
            training=self.training,
            gpu_watch=self.gpu_watch,
            serving_url=lambda: self.serving_url,
        )

    async def _record_signal(self, event: FailureSignalled) -> None:
        """A sign this domain is about to go (agents/signals.py), on the agent subject the claim began."""
        self.claim.seq = await self.log.append(self.claim.subject, event, expect=self.claim.seq)

    async def _drain_serving(self, names: list[str]) -> int:
        """Before a sleep: the serving port's requests in flight to `names` finish (drain_ms at most)."""
        if self._serving is None:
            return 0
        return await self._serving.drain(names, self.live.slots.policy.drain_ms / 1000)

    def _runtime_for(self, spec: ModelSpec) -> Runtime:
        gpu_memory = {g.index: g.memory_bytes for g in self.live.slots.domain.spec.gpus}
        return make_runtime(
            spec,
            session=self.session,
            log_dir=self.state_dir,
            bind_host=self.config.serving.host if self.direct else "127.0.0.1",
            gpu_memory_bytes=max(gpu_memory.get(i, 0) for i in model_gpus(spec)),
            real_gpus=self.config.gpus == "nvml",
        )

    # ------------------------------------------------------------------------------------ lifecycle

    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, config: AgentConfig) -> AsyncIterator[Agent]:
        writer = f"agent:{config.fleet}/{config.domain}@{socket.gethostname()}"
        async with EventLog.connect(config.servers(), writer=writer, creds=config.nats_creds) as log:
            slots = await resolve_slots(config, log)
            check_serving(config, slots)  # the serving port's rule, before anything is claimed or touched
            gpus = open_gpus(config.gpus, config.sim_dir or None)
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
                agent = cls(config, slots, log, gpus, session)
                try:
                    await agent.claim.take(serving_url=slots.domain.spec.serving_url)
                    agent.logger.info(
                        "agent started",
                        seq=agent.claim.seq,
                        source=slots.source,
                        models=list(agent.models.models),
                        training=list(agent.training.trainers),
                    )
                    await agent._boot()
                    yield agent
                finally:
                    await agent._shutdown()
                    gpus.close()

    def request_stop(self, reason: str = "", *, keep_runtimes: bool = False) -> None:
        """Stop. `keep_runtimes`: leave every runtime serving for the next agent to adopt (a restart or an
        upgrade: SIGTERM); otherwise unload them all (SIGINT, `haru up` stopping)."""
        self._stop_reason = reason or "requested"
        self.keep_runtimes = keep_runtimes
        self._stop.set()

    async def stopped(self) -> None:
        await self._stop.wait()

    def _spawn_task(self, coro, name: str) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.append(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.logger.error("agent task failed", task=task.get_name(), error=repr(exc), exc_info=exc)

    async def _boot(self) -> None:
        slots, policy = self.live.slots, self.live.slots.policy
        self.state_dir.mkdir(parents=True, exist_ok=True)
        swept_training = await asyncio.to_thread(self.files.sweep_children, policy.training_grace_ms)
        heartbeat_subject = subjects.heartbeat(self.fleet, self.domain)
        heartbeats = Heartbeats(
            lambda data: self.log.bus.publish(heartbeat_subject, data),
            self.status.heartbeat,
            interval_s=self.config.heartbeat_ms / 1000,
            errors=self.loop_errors,
            logger=self.logger,
        )
        self._spawn_task(heartbeats.run(), "heartbeat")
        await self.role.read()
        self._spawn_task(self.role.follow(), "route")
        # The tips of every subject this agent writes: it continues their chains.
        for m in self.models.models.values():
            await self.models.load_tip(m)
        await self.models.find_runtimes(
            self.state_dir, probe_timeout_s=policy.probe_timeout_ms / 1000, why_unwanted=slots.retire_why
        )
        await self.training.load_tips(self.log, swept_training)
        await self.gpu_watch.load_tips(self.log, slots.gpu_indexes())
        self._service = CommandService(
            self.log.nc,
            models=self.models,
            training=self.training_policy,
            role=self.role,
            live=self.live,
            status=self.status,
            drain=self._drain_serving,
        )
        await self._service.start()
        if self.config.serving.enabled and not self.direct:
            self._serving = ServingProxy(
                self.models,
                self.gpu_watch,
                policy=lambda: self.live.slots.policy,
                keep_runtimes=lambda: self.keep_runtimes,
                role=self.role,
                state_dir=self.state_dir,
                host=self.config.serving.host,
                port=self.config.serving.port,
                declared_url=slots.domain.spec.serving_url,
            )
            await self._serving.start()
            self.serving_url = self._serving.url
        self._spawn_task(
            self.gpu_watch.run(
                lambda: self.live.slots.gpu_indexes(),
                lambda: self.live.slots.policy.probe_interval_ms / 1000,
                self.loop_errors,
            ),
            "gpus",
        )
        self._spawn_task(self.signals.run(lambda: self.live.slots.gpu_indexes(), self.loop_errors), "signals")
        for m in self.models.models.values():
            self.models.supervise(m)
        self._spawn_task(self.training_policy.initial(), "initial-training")
        if slots.source == "declared":
            self._spawn_task(self.live.follow(), "declarations")

    async def _shutdown(self) -> None:
        self.stopping = True
        if not self.claim.seq:
            return  # refused or never claimed: nothing of ours runs, and the pid file is another agent's
        reason = self._stop_reason or "shutdown"
        # Each step is tried whatever the one before did: a failure is logged with its traceback.
        logger = self.logger
        await on_the_way_out("agent_stopping", self.claim.release(reason), logger=logger)
        if self._service is not None:
            await on_the_way_out("the command service", self._service.stop(), logger=logger)
        if self._serving is not None:
            await on_the_way_out("the serving port", self._serving.stop(), logger=logger)
        # Training first: it holds VRAM the runtimes may need, and it is the cheapest to lose.
        for slot in list(self.training.trainers):
            await on_the_way_out(f"training {slot}", self.training.stop(slot), logger=logger)
        hb = [t for t in self._tasks if t.get_name() == "heartbeat"]
        await cancel_and_wait(*(t for t in self._tasks if t not in hb))
        if self.keep_runtimes:
            self.models.keep_all()
        else:
            await asyncio.gather(
                *(
                    on_the_way_out(f"unloading {m.name}", self.models.unload(m), logger=logger)
                    for m in self.models.models.values()
                )
            )
        await cancel_and_wait(*hb)
        self.files.write_children(self.training.trainers.values())
        self.logger.info("agent stopped", reason=reason)
