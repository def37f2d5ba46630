"""The agent: one per GPU host (= one domain). Supervises runtimes and training, and tells the truth.

    async with Agent.start(config, serving_env=env) as agent:   # claims the domain, loads, heartbeats, serves
        await agent.stopped()                                    # until SIGTERM/SIGINT (agent.request_stop())

(`env`: agents/serving_env.py's ServingEnv, read from the environment by `haru agent`.)

What it writes (each append with the subject's expected last sequence, so it extends the chain it
found, after a crash too):

    haru.evt.<fleet>.<domain>.agent             agent_started / agent_stopping
    haru.evt.<fleet>.<domain>.model.<model>     residency transitions, from real signals
    haru.evt.<fleet>.<domain>.gpu.<index>       gpu_observed, only on change
    haru.evt.<fleet>.<domain>.training.<slot>   training_started / training_stopped
    haru.hb.<fleet>.<domain>                    a heartbeat every second (core NATS, not history)

One agent per domain: `agent_started` is appended with the expected sequence, after checking that
no live agent answers the domain's commands or heartbeats; a loser is refused (`AgentRefused`).

This module only wires the agent's parts (docs/agent.md, "Architecture"), bottom-up, each handed the
parts it calls; starts them, boots them and stops them:

    agents/claim.py            claiming the domain (agent_started / agent_stopping)
    agents/role.py             the role: the route pointer, followed
    agents/model_slots.py      each model, its runtime and its supervisor (agents/supervisor.py), which
                               writes what it sees through the recorder (agents/recorder.py, agents/observe.py)
    agents/live_apply.py       layouts applied live
    agents/training_policy.py  when a training slot may start (agents/training_slots.py starts it)
    agents/status.py           the status answer, the heartbeat, the GPUs' verdict (agents/owners.py: whose)
    agents/commands.py         the command service on the log's bus, typed against what each verb asks
    agents/serving.py          the serving port
    agents/adapters.py         LoRA adapters loaded into the runtimes at run time, as the fleet view says
    agents/lifecycle.py        stopping, the tasks; agents/current.py the slots as they are now
    agents/appender.py         every append, buffered in order while the log is away (agents/backlog.py)
    agents/majority.py         a NATS node without a stream majority is left for a server that has one

and the GPU watcher, the heartbeat, the runtime files and adoption, each a unit of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
from collections.abc import AsyncIterator

import aiohttp
import structlog

from haru.agents.adapters import Adapters
from haru.agents.appender import Appender
from haru.agents.checkpoint_travel import CheckpointTravel
from haru.agents.claim import Claim
from haru.agents.commands import CommandService
from haru.agents.config import AgentConfig, HostSlots, fold_declarations, load_layout_slots, slots_from_host_entry
from haru.agents.current import CurrentSlots
from haru.agents.gpu import Gpus, open_gpus
from haru.agents.gpu_watch import GpuWatcher
from haru.agents.heartbeat import Heartbeats
from haru.agents.lifecycle import Lifecycle
from haru.agents.live_apply import LiveApply
from haru.agents.load_queue import LoadQueue
from haru.agents.loops import LoopErrors, on_the_way_out
from haru.agents.majority import MajorityWatch
from haru.agents.model_slot import ModelSlot
from haru.agents.model_slots import ModelSlots
from haru.agents.owners import Owners
from haru.agents.ports import Identity
from haru.agents.publishing import Publisher
from haru.agents.recorder import Recorder
from haru.agents.reestablish import Reestablish
from haru.agents.role import Role
from haru.agents.runtime_files import RuntimeFiles
from haru.agents.runtime_for import RuntimeFor
from haru.agents.serving import ServingProxy, check_serving
from haru.agents.serving_env import ServingEnv
from haru.agents.signals import SignalWatcher, open_signals
from haru.agents.status import Status
from haru.agents.supervisor import SupervisorContext
from haru.agents.training_policy import TrainingPolicy
from haru.agents.training_slots import TrainingSlots
from haru.core import subjects
from haru.core.errors import ConfigError
from haru.host.tasks import cancel_and_wait
from haru.log.eventlog import EventLog
from haru.log.receipts import RECEIPTS_FILE
from haru.log.seam import EventReader, Log
from haru.log.training_objects import JsObjects, Objects

__all__ = ["Agent", "resolve_slots"]


async def resolve_slots(config: AgentConfig, log: EventReader) -> HostSlots:
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


CHECKPOINT_POLL_S = 1.0  # how often the agent looks for a checkpoint to upload: what a killed host may lose


class Agent:
    """The agent's parts, built bottom-up: each is handed the parts it calls, all built before it. Two
    listeners close the loops that are real (registered once both ends exist): the GPU watcher tells the
    model slots of a GPU that went away (the slots record through the watcher), and the role tells the
    live apply that the route moved (the live apply asks the role)."""

    def __init__(
        self,
        config: AgentConfig,
        slots: HostSlots,
        log: Log,
        gpus: Gpus,
        session: aiohttp.ClientSession,
        serving_env: ServingEnv,
        *,
        adapters: Objects,
        checkpoints: Objects,
    ) -> None:
        """`serving_env`: what the serving port takes from the environment, read by the command that
        starts the agent (haru/cli/agent.py); nothing in the agent reads the environment itself. `adapters`: the
        bucket finished training runs publish to; `checkpoints`: the one training slots' checkpoints travel through."""
        self.config = config
        self.log = log
        self.gpus = gpus
        self.session = session
        self.fleet = fleet = config.fleet
        self.domain = domain = config.domain
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.identity = identity = Identity(fleet=fleet, domain=domain, host=self.host, pid=self.pid)
        self.state_dir = config.state_path()
        self.logger = logger = structlog.get_logger("haru.agent").bind(fleet=fleet, domain=domain)
        self.direct = slots.domain.spec.serve == "direct"
        policy = slots.policy

        # What every part may share: the agent's life, its slots as they are now, its model slots by name.
        self.life = life = Lifecycle(logger)
        self.current = current = CurrentSlots(slots)
        hosted: dict[str, ModelSlot] = {}
        self.files = files = RuntimeFiles(self.state_dir, logger=logger)
        self.loop_errors = errors = LoopErrors()  # haru_agent_loop_errors_total{loop}

        # The writer's path: every append of the agent goes through `append` (expected sequence; buffered in
        # order while the log is away, so the agent keeps observing), except the claim's own (agent_started/
        # agent_stopping, and the failure signals on the agent subject), which must fail rather than wait.
        self.append = append = Appender(log, stopping=life.stopping, logger=logger, buffer=config.backlog)
        self.claim = claim = Claim(
            log,
            log.bus,
            fleet=fleet,
            domain=domain,
            host=self.host,
            pid=self.pid,
            heartbeat_ms=config.heartbeat_ms,
            logger=logger,
        )

        self.publisher = Publisher(
            fleet=fleet,
            domain=domain,
            objects=adapters,
            log=log,
            models=hosted.keys,
            logger=logger,
        )
        self.travel = CheckpointTravel(fleet=fleet, objects=checkpoints, interval_s=CHECKPOINT_POLL_S, logger=logger)
        self.training = training = TrainingSlots(
            slots.admitted_training,
            fleet=fleet,
            domain=domain,
            grace_ms=policy.training_grace_ms,
            log_dir=self.state_dir,
            append=append,
            files=files,
            agent_seq=claim.tip,
            stopping=life.stopping,
            logger=logger,
            publisher=self.publisher,
            travel=self.travel,
        )
        self.role = role = Role(
            log,
            fleet=fleet,
            domain=domain,
            pinned=config.role,
            first_domain=current.first_domain,
            stopping=life.stopping,
            errors=errors,
            logger=logger,
        )
        self.training_policy = training_policy = TrainingPolicy(
            training, models=hosted, role=role, auto=config.auto_training, stopping=life.stopping, logger=logger
        )
        self.gpu_watch = gpu_watch = GpuWatcher(
            fleet=fleet,
            domain=domain,
            gpus=gpus,
            append=append,
            owners=Owners(hosted, training, current),
            exclude_pid=self.pid,
            logger=logger,
        )
        self.signals = SignalWatcher(
            domain=domain,
            gpus=open_signals(config.gpus, config.sim_dir),
            notice=slots.domain.spec.preemption_notice,
            record=claim.record_signal,
            logger=logger,
            session=session,
        )
        self.recorder = recorder = Recorder(
            domain=domain, append=append, gpu=gpu_watch, agent_seq=claim.tip, stopping=life.stopping, logger=logger
        )
        self.adapters = runtime_adapters = Adapters(
            fleet=fleet,
            domain=domain,
            log=log,
            objects=adapters,
            models=hosted,
            append=append,
            session=session,
            store_dir=self.state_dir / "adapters",
            policy=current.policy,
            stopping=life.stopping,
            logger=logger,
        )
        context = SupervisorContext(
            domain=domain,
            record=recorder.record,
            about=recorder.about,
            gpu=gpu_watch,
            files=files,
            role=role,
            policy=current.policy,
            stopping=life.stopping,
            stop_event=life.stop_event,
            spawn=life.spawn,
            make_room=training.make_room,
            resume_training=training_policy.resume,
            errors=errors,
            logger=logger,
            loads=LoadQueue(order=current.model_order),
            restore_adapters=runtime_adapters.restore,
        )
        runtime_for = RuntimeFor(
            current,
            session=session,
            log_dir=self.state_dir,
            bind_host=config.serving.host if self.direct else "127.0.0.1",
            real_gpus=config.gpus == "nvml",
        )
        self.models = models = ModelSlots(
            fleet=fleet,
            domain=domain,
            log=log,
            models=hosted,
            runtime_for=runtime_for,
            recorder=recorder,
            files=files,
            context=context,
            spawn=life.spawn,
            logger=logger,
        )
        gpu_watch.on_gone.append(models.gpu_went_away)
        for spec in slots.admitted_models:
            hosted[spec.name] = models.new(spec)
        self.live = live = LiveApply(
            current,
            log=log,
            fleet=fleet,
            domain=domain,
            models=models,
            role=role,
            stopping=life.stopping,
            spawn=life.spawn,
            errors=errors,
            logger=logger,
        )
        self.serving: ServingProxy | None = None
        if config.serving.enabled and not self.direct:
            self.serving = ServingProxy(
                models,
                gpu_watch,
                policy=current.policy,
                keep_runtimes=life.keeps_runtimes,
                role=role,
                state_dir=self.state_dir,
                host=config.serving.host,
                port=config.serving.port,
                declared_url=slots.domain.spec.serving_url,
                env=serving_env,
            )
        self.status = status = Status(
            identity,
            role=role,
            live=live,
            models=models,
            training=training,
            gpu_watch=gpu_watch,
            serving=self.serving,
        )
        self.service = CommandService(
            log.bus,
            identity,
            models=models,
            training=training_policy,
            role=role,
            live=live,
            status=status,
            drain=self._drain if self.serving is not None else None,
        )
        # Its NATS node must reach a stream majority, or the agent moves to a server of its list that has one
        # (given one server, there is nowhere to move).
        self.majority: MajorityWatch | None = None
        if config.majority_check_ms and len(config.servers()) > 1 and isinstance(log, EventLog):
            self.majority = MajorityWatch(
                log, servers=config.servers(), interval_s=config.majority_check_ms / 1000, logger=logger
            )
        self.heartbeats = Heartbeats(
            functools.partial(log.bus.publish, subjects.heartbeat(fleet, domain)),
            status.heartbeat,
            interval_s=config.heartbeat_ms / 1000,
            errors=errors,
            logger=logger,
        )

    async def _drain(self, names: list[str]) -> int:
        """Before a sleep: the serving port's requests in flight to `names` finish (drain_ms at most)."""
        assert self.serving is not None  # handed to the command service only with a serving port
        return await self.serving.drain(names, self.current.policy().drain_ms / 1000)

    @property
    def stopping(self) -> bool:
        return self.life.stopping()

    @property
    def keep_runtimes(self) -> bool:
        return self.life.keep_runtimes

    @property
    def serving_url(self) -> str:
        """The serving port's URL ("" when this host has none, or before it listens)."""
        return self.serving.listening_url if self.serving is not None else ""

    # ------------------------------------------------------------------------------------ lifecycle

    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, config: AgentConfig, *, serving_env: ServingEnv) -> AsyncIterator[Agent]:
        writer = f"agent:{config.fleet}/{config.domain}@{socket.gethostname()}"
        async with EventLog.connect(config.servers(), writer=writer, creds=config.nats_creds, steer=True) as log:
            if log.receipt_guard is not None:  # a log that forgot what we were acknowledged: domain_log_regressed
                log.receipt_guard.record_as(domain=config.domain)
                config.state_path().mkdir(parents=True, exist_ok=True)  # receipts outlive the agent (a restart)
                log.receipt_guard.persist(config.state_path() / RECEIPTS_FILE)
            slots = await resolve_slots(config, log)
            # the serving port's rule, before anything is claimed or touched
            check_serving(config, slots, serving_env.token)
            gpus = open_gpus(config.gpus, config.sim_dir or None)
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
                adapters = JsObjects(log.js, subjects.ADAPTERS_BUCKET)
                checkpoints = JsObjects(log.js, subjects.CHECKPOINTS_BUCKET)
                agent = cls(config, slots, log, gpus, session, serving_env, adapters=adapters, checkpoints=checkpoints)
                if log.receipt_guard is not None:  # a recorded loss: re-report what is true now
                    log.receipt_guard.after_recording(Reestablish.of(agent))
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
        self.life.request_stop(reason, keep_runtimes=keep_runtimes)

    async def stopped(self) -> None:
        await self.life.stopped()

    async def _boot(self) -> None:
        slots, policy, life = self.current.slots, self.current.policy(), self.life
        self.state_dir.mkdir(parents=True, exist_ok=True)
        swept_training = await asyncio.to_thread(self.files.sweep_children, policy.training_grace_ms)
        life.spawn(self.heartbeats.run(), "heartbeat")
        # Commands are answered from the first heartbeat on (a promoter hearing it may ask at once); each waits
        # for the end of the boot (`service.ready`), so it is never 'no agent answers' for a booting agent.
        await self.service.start(booting=True)
        life.spawn(self.append.run(), "backlog")
        if self.majority is not None:
            life.spawn(self.majority.run(), "majority")
        await self.role.read()
        life.spawn(self.role.follow(), "route")
        # The tips of every subject this agent writes: it continues their chains.
        for m in self.models.models.values():
            await self.models.load_tip(m)
        await self.models.find_runtimes(
            self.state_dir, probe_timeout_s=policy.probe_timeout_ms / 1000, why_unwanted=slots.retire_why
        )
        await self.training.load_tips(self.log, swept_training)
        await self.gpu_watch.load_tips(self.log, slots.gpu_indexes())
        self.service.ready.set()
        if self.serving is not None:
            await self.serving.start()
        life.spawn(
            self.gpu_watch.run(self.current.gpu_indexes, self.current.probe_interval_s, self.loop_errors), "gpus"
        )
        life.spawn(self.signals.run(self.current.gpu_indexes, self.loop_errors), "signals")
        for m in self.models.models.values():
            self.models.supervise(m)
        life.spawn(self.travel.run(t.spec for t in self.training.trainers.values()), "checkpoints")
        life.spawn(self.training_policy.initial(), "initial-training")
        life.spawn(self.adapters.run(), "adapters")  # idle until a model declares max_loras (now or by a live apply)
        if slots.source == "declared":
            life.spawn(self.live.follow(), "declarations")

    async def _shutdown(self) -> None:
        self.life.begin_stopping()
        if not self.claim.seq:
            return  # refused or never claimed: nothing of ours runs, and the pid file is another agent's
        reason = self.life.reason or "shutdown"
        # Each step is tried whatever the one before did: a failure is logged with its traceback.
        logger = self.logger
        # What was observed while the log was away goes in before the agent says it stops.
        await on_the_way_out("the backlog", self.append.flush(), logger=logger)
        await on_the_way_out("agent_stopping", self.claim.release(reason), logger=logger)
        await on_the_way_out("the command service", self.service.stop(), logger=logger)
        if self.serving is not None:
            await on_the_way_out("the serving port", self.serving.stop(), logger=logger)
        # Training first: it holds VRAM the runtimes may need, and it is the cheapest to lose.
        for slot in list(self.training.trainers):
            await on_the_way_out(f"training {slot}", self.training.stop(slot), logger=logger)
        # what the trainers checkpointed on their way out goes to the bucket, for whichever domain trains next
        await on_the_way_out(
            "uploading checkpoints", self.travel.sync(t.spec for t in self.training.trainers.values()), logger=logger
        )
        hb = [t for t in self.life.tasks if t.get_name() == "heartbeat"]
        await cancel_and_wait(*(t for t in self.life.tasks if t not in hb))
        if self.life.keep_runtimes:
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
