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

This module wires the agent's parts (docs/agent.md, "Architecture"): each model's supervisor
(agents/supervisor.py) loads, watches, restarts, sleeps and wakes it, and writes what it sees through
the recorder and the decision table (agents/recorder.py, agents/observe.py); the GPU watcher, the
training slots, the heartbeat, the runtime files and adoption, the command service and the serving port
are units of their own. What stays here: claiming the domain, booting and shutting down, the role (the
route follower), layouts applied live, the status answer, and the training policy (a slot starts only
on a standby whose models on that GPU sleep).

Role: the active domain is the `active` of the fleet's last `route_moved`; before any, the first
declared domain is active (config `role` may pin it). A standby sleeps its runtimes after they load.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone

import aiohttp
import msgspec
import structlog

from agents.adoption import Adoptable, find_runtimes
from agents.appender import Appender
from agents.cause import VERSION
from agents.commands import CommandService
from agents.config import (
    AgentConfig,
    HostSlots,
    diff_models,
    fold_declarations,
    load_layout_slots,
    slots_from_host_entry,
)
from agents.errors import AgentRefused
from agents.gpu import GpuReading, Gpus, Owner, open_gpus, process_tree, read_parents
from agents.gpu_verdict import gpus_of, judge_gpus
from agents.gpu_watch import GPU_USED_THRESHOLD, GpuWatcher
from agents.gpu_watch import gpu_changed as _gpu_changed
from agents.heartbeat import Heartbeats, heartbeat_of
from agents.loops import LoopErrors
from agents.model_slot import RUNTIME_STOP_GRACE_S, ModelSlot
from agents.observe import Observation, PullInterrupted, Unloaded, observe
from agents.ports import Applied, GpuVerdict, Outcome, Selection
from agents.recorder import Recorder
from agents.runtime_files import RuntimeFiles, pid_alive
from agents.runtimes import make_runtime
from agents.runtimes.base import runtimes_die_with_agent
from agents.serving import ServingProxy
from agents.supervisor import ModelSupervisor, SupervisorContext, backoff_s
from agents.training import Ended, Trainer
from agents.training_slots import TrainingSlots
from haru.core import subjects
from haru.core.commands import Command, ErrorInfo, Heartbeat, Reply, heartbeat_decoder
from haru.log.bus import Msg
from haru.core.errors import ConfigError, Conflict, IllegalTransition, NoResponders, RequestTimeout
from haru.log.eventlog import EventLog
from haru.core.events import AgentStarted, AgentStopping, Event, RouteMoved, tag_of
from haru.core.residency import to_state
from haru.core.specs import ModelSpec, TrainingSpec
from haru.host.tasks import cancel_and_wait

# GPU_USED_THRESHOLD, _gpu_changed: kept importable from here (agents/gpu_watch.py has them)
__all__ = ["Agent", "ModelSlot", "resolve_slots", "VERSION", "GPU_USED_THRESHOLD", "_gpu_changed"]

LIVE_STATES = frozenset({"loading", "resident", "sleeping", "waking"})
DECL_SETTLE_S = 0.3  # a live apply waits this long after the last declaration before it folds them


def now() -> datetime:
    return datetime.now(timezone.utc)


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
    def __init__(self, config: AgentConfig, slots: HostSlots, log: EventLog, gpus: Gpus, session: aiohttp.ClientSession) -> None:
        self.config = config
        self.slots = slots
        self.policy = slots.policy
        self.log = log
        self.gpus = gpus
        self.session = session
        self.fleet = config.fleet
        self.domain = config.domain
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.state_dir = config.state_path()
        self.logger = structlog.get_logger("haru.agent").bind(fleet=self.fleet, domain=self.domain)
        self.agent_subject = subjects.agent(self.fleet, self.domain)
        self.agent_seq = 0
        self.models: dict[str, ModelSlot] = {}
        self.direct = slots.domain.spec.serve == "direct"
        bind_host = config.serving.host if self.direct else "127.0.0.1"
        self._bind_host = bind_host
        for spec in slots.admitted_models:
            self.models[spec.name] = self._new_slot(spec)
        self.stopping = False
        self._stop = asyncio.Event()
        self.files = RuntimeFiles(self.state_dir, logger=self.logger)
        self.loop_errors = LoopErrors()  # haru_agent_loop_errors_total{loop}
        self.append = Appender(log, stopping=lambda: self.stopping, logger=self.logger)
        self.gpu_watch = GpuWatcher(fleet=self.fleet, domain=self.domain, gpus=gpus, append=self.append, owners=self.owners,
                                    on_gone=self._gpu_went_away, exclude_pid=self.pid, logger=self.logger)
        self.training = TrainingSlots(slots.admitted_training, fleet=self.fleet, domain=self.domain,
                                      grace_ms=self.policy.training_grace_ms, log_dir=self.state_dir, append=self.append,
                                      files=self.files, agent_seq=lambda: self.agent_seq, stopping=lambda: self.stopping,
                                      logger=self.logger)
        self.recorder = Recorder(domain=self.domain, append=self.append, gpu=self.gpu_watch,
                                 agent_seq=lambda: self.agent_seq, stopping=lambda: self.stopping, logger=self.logger)
        self._supervisor_context = SupervisorContext(
            domain=self.domain, record=self.recorder.record, about=self.recorder.about, gpu=self.gpu_watch,
            files=self.files, role=lambda: self.role, policy=lambda: self.policy, stopping=lambda: self.stopping,
            stop_event=self._stop, spawn=self._spawn_task, make_room=self._make_room,
            resume_training=self._resume_training, errors=self.loop_errors, logger=self.logger)
        self.active_domain = ""
        self.route_revision = 0
        self._tasks: list[asyncio.Task] = []
        self._service: CommandService | None = None
        self._serving: ServingProxy | None = None
        self.serving_url = ""
        self.keep_runtimes = False
        self.supervisors: dict[str, ModelSupervisor] = {}  # model -> its supervisor
        self._supervising: dict[str, asyncio.Task] = {}  # model -> its supervisor's task
        self.pending: dict[str, ModelSpec] = {}  # changes applied live that wait for this domain to be standby
        self._reconcile_lock = asyncio.Lock()
        self.adoptable: dict[str, Adoptable] = {}  # model -> the identity of a live runtime found at boot
        self.away: dict[str, str] = {}  # model -> what is known of a runtime that died while no agent watched

    # ------------------------------------------------------------------------------------ lifecycle

    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, config: AgentConfig) -> AsyncIterator["Agent"]:
        writer = f"agent:{config.fleet}/{config.domain}@{socket.gethostname()}"
        async with EventLog.connect(config.servers(), writer=writer, creds=config.nats_creds) as log:
            slots = await resolve_slots(config, log)
            gpus = open_gpus(config.gpus, config.sim_dir or None)
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
                agent = cls(config, slots, log, gpus, session)
                try:
                    await agent._claim()
                    await agent._boot()
                    yield agent
                finally:
                    await agent._shutdown()
                    gpus.close()

    def request_stop(self, reason: str = "", *, keep_runtimes: bool = False) -> None:
        """Stop. `keep_runtimes`: leave every runtime serving for the next agent to adopt (a restart or an
        upgrade: SIGTERM); otherwise unload them all (SIGINT, `haru up` stopping)."""
        self._stop_reason = reason or "requested"
        self.keep_runtimes = keep_runtimes and not runtimes_die_with_agent()
        self._stop.set()

    async def stopped(self) -> None:
        await self._stop.wait()

    def recheck(self, m: ModelSlot) -> None:
        """Probe `m` now (the serving port saw its runtime fail a request), once at a time."""
        supervisor = self.supervisors.get(m.name)
        if supervisor is not None and supervisor.m is m:
            supervisor.recheck()

    async def check(self, m: ModelSlot) -> bool:
        """One probe of `m` now, recording what changed (its supervisor's). True = it must be restarted."""
        return await self.supervisors[m.name].check()

    def _supervise(self, m: ModelSlot) -> None:
        """Start `m`'s supervisor (adopting the runtime a previous agent left, if one was found)."""
        supervisor = ModelSupervisor(m, self._supervisor_context, found=self.adoptable.pop(m.name, None),
                                     away=self.away.pop(m.name, ""))
        self.supervisors[m.name] = supervisor
        self._supervising[m.name] = self._spawn_task(supervisor.run(), f"model:{m.name}")

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

    async def _claim(self) -> None:
        """Append agent_started with the expected sequence; refuse if another agent runs this domain."""
        rec = await self.log.last(self.agent_subject)
        expect = rec.seq if rec is not None else 0
        if rec is not None and isinstance(rec.event, AgentStarted):
            who = f"{rec.event.host or '?'} pid {rec.event.pid}"
            if await self._someone_answers():
                raise AgentRefused(
                    f"another agent already runs domain {self.domain!r} of fleet {self.fleet!r} ({who}): it answers "
                    f"{subjects.commands(self.fleet, self.domain)}.* and heartbeats; stop it first (two writers would "
                    f"corrupt one history)"
                )
        event = AgentStarted(at=now(), domain=self.domain, host=self.host, pid=self.pid, version=VERSION,
                             serving_url=self._serving_url_guess())
        try:
            self.agent_seq = await self.log.append(self.agent_subject, event, expect=expect)
        except Conflict as exc:
            raise AgentRefused(
                f"another agent started for domain {self.domain!r} of fleet {self.fleet!r} at the same moment and won "
                f"(the agent subject moved to sequence {exc.current}); stop one of them"
            ) from exc
        self.logger.info("agent started", seq=self.agent_seq, source=self.slots.source,
                         models=list(self.models), training=list(self.trainers))

    async def _someone_answers(self) -> bool:
        bus = self.log.bus
        try:
            await bus.request(subjects.command(self.fleet, self.domain, "status"), b"{}", timeout=1.0)
            return True
        except NoResponders:
            pass
        except RequestTimeout:
            return True  # subscribed but slow: someone is there
        seen = asyncio.Event()

        def on_hb(msg: Msg) -> None:
            try:
                hb = heartbeat_decoder.decode(msg.data)
            except msgspec.DecodeError:
                return
            if hb.pid != self.pid:
                seen.set()

        sub = await bus.subscribe(subjects.heartbeat(self.fleet, self.domain), on_hb)
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                async with asyncio.timeout(1.5 * self.config.heartbeat_ms / 1000):
                    await seen.wait()
        finally:
            await sub.unsubscribe()
        return seen.is_set()

    def _serving_url_guess(self) -> str:
        return self.slots.domain.spec.serving_url

    async def _boot(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._swept_training: dict[str, str] = await asyncio.to_thread(self.files.sweep_children,
                                                                        self.policy.training_grace_ms)
        heartbeat_subject = subjects.heartbeat(self.fleet, self.domain)
        heartbeats = Heartbeats(lambda data: self.log.bus.publish(heartbeat_subject, data), self.heartbeat,
                                interval_s=self.config.heartbeat_ms / 1000, errors=self.loop_errors, logger=self.logger)
        self._spawn_task(heartbeats.run(), "heartbeat")
        await self._read_route()
        self._spawn_task(self._follow_route(), "route")
        # The tips of every subject this agent writes: it continues their chains.
        for m in self.models.values():
            await self._load_tip(m)
        await self._find_runtimes()
        await self.training.load_tips(self.log, self._swept_training)
        await self.gpu_watch.load_tips(self.log, self.slots.gpu_indexes())
        self._service = CommandService(self, self.log.nc)
        await self._service.start()
        if self.config.serving.enabled and not self.direct:
            self._serving = ServingProxy(self, host=self.config.serving.host, port=self.config.serving.port,
                                         declared_url=self.slots.domain.spec.serving_url)
            await self._serving.start()
            self.serving_url = self._serving.url
        self._spawn_task(self.gpu_watch.run(self.slots.gpu_indexes, lambda: self.policy.probe_interval_ms / 1000,
                                            self.loop_errors), "gpus")
        for m in self.models.values():
            self._supervise(m)
        self._spawn_task(self._initial_training(), "initial-training")
        if self.slots.source == "declared":
            self._spawn_task(self._follow_declarations(), "declarations")

    async def _shutdown(self) -> None:
        self.stopping = True
        if not self.agent_seq:
            return  # refused or never claimed: nothing of ours runs, and the pid file is another agent's
        reason = getattr(self, "_stop_reason", "") or "shutdown"
        # Each step is tried whatever the one before did: a failure is logged with its traceback.
        async def stopping_append() -> None:
            self.agent_seq = await self.log.append(
                self.agent_subject, AgentStopping(at=now(), domain=self.domain, reason=reason), expect=self.agent_seq)

        await self._on_the_way_out("agent_stopping", stopping_append())
        if self._service is not None:
            await self._on_the_way_out("the command service", self._service.stop())
        if self._serving is not None:
            await self._on_the_way_out("the serving port", self._serving.stop())
        # Training first: it holds VRAM the runtimes may need, and it is the cheapest to lose.
        for slot in list(self.trainers):
            await self._on_the_way_out(f"training {slot}", self.stop_training_slot(slot))
        hb = [t for t in self._tasks if t.get_name() == "heartbeat"]
        await cancel_and_wait(*(t for t in self._tasks if t not in hb))
        if self.keep_runtimes:
            # A restart: every runtime keeps serving; its identity file stays for the next agent.
            for m in self.models.values():
                self._write_identity(m)
            self.logger.info("runtimes kept for the next agent", models=[m.name for m in self.models.values()
                                                                         if m.runtime.alive() and m.runtime.pid])
        else:
            await asyncio.gather(*(self._on_the_way_out(f"unloading {m.name}", self._unload(m))
                                   for m in self.models.values()))
        await cancel_and_wait(*hb)
        self.files.write_children(self.trainers.values())
        self.logger.info("agent stopped", reason=reason)

    async def _unload(self, m: ModelSlot) -> None:
        """Stop a runtime on purpose, and record `model_stopped` when there was something to unload."""
        if m.runtime.kind == "external":
            return
        if m.state_tag == "pulling":  # stopped mid-pull: nothing runs; the .part stays for the next start
            await self._record_on_the_way_out(m, PullInterrupted(
                **self._about(m), detail="agent shutdown during the pull (the next start resumes it)"))
            return
        was_alive = m.runtime.alive()
        m.on_purpose = True
        await m.runtime.stop(RUNTIME_STOP_GRACE_S)
        self._drop_identity(m.name)
        await self._record_on_the_way_out(m, Unloaded(**self._about(m), ran=was_alive, detail="agent shutdown"))

    async def _on_the_way_out(self, what: str, step) -> None:
        """One step of the shutdown: awaited; a failure is logged with its traceback, and the shutdown goes on."""
        try:
            await step
        except Exception:
            self.logger.exception("a shutdown step failed; going on", step=what)

    async def _record_on_the_way_out(self, m: ModelSlot, observation: Observation) -> None:
        """Record while stopping: a failure (the log gone) is logged with its traceback, never raised."""
        try:
            await self._record(m, observation)
        except Exception:
            self.logger.exception("could not record on the way out", model=m.name, observation=type(observation).__name__)

    # ------------------------------------------------------------- runtimes that outlive the agent

    def _write_identity(self, m: ModelSlot) -> None:
        self.files.write_identity(m.name, m.runtime)

    def _drop_identity(self, name: str) -> None:
        self.files.drop_identity(name)

    async def _find_runtimes(self) -> None:
        found = await find_runtimes(self.state_dir, self.models, probe_timeout_s=self.policy.probe_timeout_ms / 1000,
                                    unwanted=self._record_unwanted, logger=self.logger)
        self.adoptable.update(found.adoptable)
        self.away.update(found.away)

    async def _record_unwanted(self, name: str, why: str) -> None:
        """`model_stopped` on the model's subject for a runtime stopped because the layout changed."""
        m = self.models.get(name)
        unloaded = Unloaded(at=now(), domain=self.domain, model=name, ran=True, detail=why)
        if m is not None:
            await self._record(m, unloaded)
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
            await self.append(subject, event, rec.seq)

    # ------------------------------------------------------------------ layouts applied live

    def _new_slot(self, spec: ModelSpec) -> ModelSlot:
        gpu_memory = {g.index: g.memory_bytes for g in self.slots.domain.spec.gpus}
        runtime = make_runtime(spec, session=self.session, log_dir=self.state_dir, bind_host=self._bind_host,
                               gpu_memory_bytes=gpu_memory.get(spec.gpu_index, 0))
        return ModelSlot(spec, runtime, subjects.model(self.fleet, self.domain, spec.name))

    async def _follow_declarations(self) -> None:
        """Follow `haru apply`'s declarations (the agent's slots came from them) and apply a changed
        layout to this host live: a new model started, a removed one stopped, a changed one replaced;
        every other model untouched. A change that would interrupt a model this domain serves as the
        active one waits (`pending`) until the domain is the standby."""
        events: list = []
        changed = asyncio.Event()

        def on(rec) -> None:
            if rec.event is not None:
                events.append(rec.event)
                changed.set()

        async def follow() -> None:
            # haru/log/follow.py: catch-up, stall detection, a fresh replay after a reconnect (each
            # declaration handled once); a LogError is retried there, anything else is a bug
            follower = self.log.follower(on, from_seq=1, subject_filter=subjects.decl(self.fleet), name="declarations")
            while not self.stopping:
                try:
                    await follower.run()  # resumes after the last declaration it handled
                except asyncio.CancelledError:
                    raise
                except Exception:  # a bug in `on` (or one the follower raised): logged, counted, followed again
                    n = self.loop_errors.count("declarations")
                    self.logger.warning("declaration follower interrupted", errors=n, exc_info=True)
                    await asyncio.sleep(1.0)

        follower = asyncio.ensure_future(follow())
        try:
            while not self.stopping:
                await changed.wait()
                await asyncio.sleep(DECL_SETTLE_S)  # `haru apply` appends a batch: fold once it is written
                changed.clear()
                new = fold_declarations(self.fleet, self.domain, list(events))
                if new is not None:
                    await self.apply_slots(new)
        finally:
            await cancel_and_wait(follower)

    async def apply_slots(self, new: HostSlots) -> dict[str, list[str]]:
        """Move this host from its slots to `new` without a restart. Returns what was done, by path."""
        async with self._reconcile_lock:
            # Against what the runtimes run, not the last declarations: a change that waits (`pending`) is
            # still a change, and one changed back before it was applied is none.
            diff = diff_models([m.spec for m in self.models.values()], new.admitted_models)
            self.slots, self.policy = new, new.policy
            done: dict[str, list[str]] = {"started": [], "stopped": [], "replaced": [], "pending": []}
            for name in diff.removed:
                self.pending.pop(name, None)
                await self._retire(name, "the layout no longer has this model")
                done["stopped"].append(name)
            for spec in diff.added:
                m = self.models[spec.name] = self._new_slot(spec)
                await self._load_tip(m)
                self._supervise(m)
                done["started"].append(spec.name)
            for spec in diff.changed:
                if self.role == "active" and self.models[spec.name].state_tag in LIVE_STATES:
                    self.pending[spec.name] = spec
                    done["pending"].append(spec.name)
                else:
                    self.pending.pop(spec.name, None)  # applied now: it waits no more
                    await self._replace(spec)
                    done["replaced"].append(spec.name)
            for name in diff.unchanged:
                self.pending.pop(name, None)  # changed back before it was applied
            if any(done.values()):
                self.logger.info("layout applied live", **{k: v for k, v in done.items() if v})
            if done["pending"]:
                self.logger.warning("changes wait for this domain to be the standby (they would interrupt models it "
                                    "serves as the active domain): promote the other domain to apply them",
                                    models=done["pending"])
            return done

    async def apply_declared(self, decl_seq: int, timeout_s: float) -> Applied:
        """The `apply_layout` verb (a rolling change's apply steps): bring this host to the declarations
        (at least up to `decl_seq`) now rather than when the follower gets to them; on the standby, also
        replace the changes that waited while this domain was the active one; then wait, at most
        `timeout_s`, until every model has come to rest. Idempotent: run twice, it changes nothing the
        second time and waits the same way. """
        if self.slots.source != "declared":
            return Applied(ok=False, code="layout_not_declared",
                           detail=f"the agent of {self.domain} reads its slots from its {self.slots.source} file, not from "
                           f"`haru apply`'s declarations: change that file and restart the agent (its runtimes are adopted)")
        records = await self.log.history(subjects.decl(self.fleet))
        last = records[-1].seq if records else 0
        if last < decl_seq:
            return Applied(ok=False, code="declarations_behind",
                           detail=f"the decl subject ends at seq {last}, before seq {decl_seq} the operation rolls out")
        new = fold_declarations(self.fleet, self.domain, [r.event for r in records if r.event is not None])
        if new is None:
            return Applied(ok=False, code="domain_retired", detail=f"domain {self.domain} is no longer declared in fleet {self.fleet}")
        # The diff is against what the runtimes run, so on the standby it replaces what waited too.
        done = await self.apply_slots(new)
        if self.pending:
            return Applied(ok=False, code="domain_active",
                           detail=f"{self.domain} is the active domain: its changes to {', '.join(sorted(self.pending))} wait "
                           f"until it is the standby", data={"pending_layout": sorted(self.pending)})
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    waiting = [m for m in self.models.values() if not m.settled.is_set()]
                    if not waiting:
                        break
                    await asyncio.gather(*(m.settled.wait() for m in waiting))
        except TimeoutError:
            loading = sorted(m.name for m in self.models.values() if not m.settled.is_set())
            return Applied(ok=False, code="timeout", data={"decl_seq": last},
                           detail=f"still loading after {timeout_s:.0f} s (policy apply_timeout_ms): {', '.join(loading)}")
        unready = {name: f"{m.state_tag}" + (f" ({getattr(m.state, 'detail', '') or getattr(m.state, 'reason', '')})"
                                              if m.state_tag in ("failed", "lost") else "")
                   for name, m in self.models.items() if m.state_tag not in ("resident", "sleeping", "waking")}
        data = {"decl_seq": last, **{k: v for k, v in done.items() if v},
                "models": {name: m.state_tag for name, m in self.models.items()}}
        if unready:
            return Applied(ok=False, code="model_not_ready", detail="; ".join(f"{n} {s}" for n, s in sorted(unready.items())),
                           data=data)
        changed = [f"{k} {', '.join(v)}" for k, v in done.items() if v and k != "pending"]
        return Applied(ok=True, detail=(("; ".join(changed) + "; ") if changed else "") + f"declarations up to seq {last} applied",
                       data=data)

    async def apply_pending(self) -> None:
        """The domain is the standby now: replace the models whose change waited, once the operation that
        moved the route has finished (its last step settles this domain: the change comes after it)."""
        deadline = time.monotonic() + self.policy.command_timeout_ms / 1000 * 6
        while time.monotonic() < deadline and not self.stopping:
            rec = await self.log.last(subjects.op(self.fleet))
            if rec is None or rec.event is None or tag_of(rec.event) in ("operation_completed", "operation_aborted", "failover_declined",
                                                    "eligibility_changed"):
                break
            await asyncio.sleep(0.2)
        async with self._reconcile_lock:
            for name, spec in list(self.pending.items()):
                if self.role != "standby":
                    return
                del self.pending[name]
                await self._replace(spec)

    async def _retire(self, name: str, why: str) -> None:
        m = self.models.get(name)
        if m is None:
            return
        self.supervisors.pop(name, None)
        task = self._supervising.pop(name, None)
        if task is not None:
            await cancel_and_wait(task)
        async with m.lock:
            was_alive = m.runtime.alive()
            m.on_purpose = True
            if m.runtime.kind != "external":
                await m.runtime.stop(RUNTIME_STOP_GRACE_S)
            self._drop_identity(name)
            await self._record(m, Unloaded(**self._about(m), ran=was_alive or m.runtime.kind == "external", detail=why))
        m.exited.set()
        del self.models[name]

    async def _replace(self, spec: ModelSpec) -> None:
        await self._retire(spec.name, "the layout changed this model")
        m = self.models[spec.name] = self._new_slot(spec)
        await self._load_tip(m)
        self._supervise(m)

    async def _load_tip(self, m: ModelSlot) -> None:
        """Continue the model subject's chain from its last event (the sequence the next append expects),
        and take the state it records as the model's last known one."""
        rec = await self.log.last(m.subject)
        if rec is not None:
            m.seq = rec.seq
            if rec.event is not None:
                with contextlib.suppress(IllegalTransition):
                    m.state = to_state(rec.event, rec.seq)

    # --------------------------------------------------------------------------------------- writes

    def _about(self, m: ModelSlot) -> dict:
        return self.recorder.about(m)

    async def _record(self, m: ModelSlot, observation: Observation) -> Event | None:
        return await self.recorder.record(m, observation)

    # ----------------------------------------------------------------------------------------- role

    async def _read_route(self) -> None:
        rec = await self.log.last(subjects.route(self.fleet))
        if rec is not None and isinstance(rec.event, RouteMoved):
            self.active_domain, self.route_revision = rec.event.active, rec.seq

    async def _follow_route(self) -> None:
        def on(rec) -> None:
            if isinstance(rec.event, RouteMoved) and rec.seq >= self.route_revision:
                if rec.event.active != self.active_domain:
                    self.logger.info("route moved", active=rec.event.active, revision=rec.seq)
                self.active_domain, self.route_revision = rec.event.active, rec.seq
                if self.pending and self.role == "standby":
                    self._spawn_task(self.apply_pending(), "apply-pending")

        while not self.stopping:
            try:
                await self.log.follow(on, from_seq=max(1, self.route_revision), subject_filter=subjects.route(self.fleet),
                                      name="agent-route")
            except asyncio.CancelledError:
                raise
            except Exception:  # the log went away for a while (or a bug): keep the last known role
                n = self.loop_errors.count("route")
                self.logger.warning("route follower interrupted", errors=n, exc_info=True)
                await asyncio.sleep(1.0)

    @property
    def role(self) -> str:
        if self.config.role != "auto":
            return self.config.role
        active = self.active_domain or self.slots.first_domain
        return "active" if active == self.domain else "standby"

    # ------------------------------------------------------------------------------------ heartbeat

    def heartbeat(self) -> Heartbeat:
        return heartbeat_of(fleet=self.fleet, domain=self.domain, role=self.role,
                            models={name: m.state_tag for name, m in self.models.items()},
                            training=[slot for slot, t in self.trainers.items() if t.running()], pid=self.pid, at=now())

    # ----------------------------------------------------------------------------------------- GPUs

    def read_gpu(self, index: int) -> GpuReading:
        return self.gpu_watch.read(index)

    def gpu_went_away(self, index: int) -> bool:
        return self.gpu_watch.went_away(index)

    async def observe_gpu(self, index: int) -> GpuReading:
        return await self.gpu_watch.observe(index)

    def _gpu_went_away(self, index: int) -> None:
        """The provider took GPU `index`: say so for every model on it now, not at each one's next probe,
        before a failover's demotion can ask one of them to sleep."""
        for m in self.models.values():
            if m.spec.gpu_index == index and m.runtime.kind != "external":
                self._spawn_task(self.check(m), f"gpu-gone:{m.name}")

    def owners(self, index: int) -> list[Owner]:
        """What Haru started on GPU `index`: each runtime's and trainer's process tree, with its plan.

        A sleeping runtime is planned at the policy's sleep residual (what sleep should leave behind)."""
        parents = read_parents()
        out: list[Owner] = []
        for m in self.models.values():
            if m.spec.gpu_index != index or m.runtime.kind == "external":
                continue
            pid = m.runtime.pid if m.runtime.alive() else None
            asleep = m.runtime.can_sleep and m.state_tag == "sleeping"
            planned = min(self.policy.sleep_residual_bytes, m.spec.vram_bytes) if asleep else m.spec.vram_bytes
            out.append(Owner(name=m.name, kind="model", pids=process_tree({pid} if pid else set(), parents),
                             planned_bytes=planned))
        for slot, t in self.trainers.items():
            if t.spec.gpu_index != index:
                continue
            roots = set(t.group_pids()) | ({t.pid} if t.running() and t.pid else set())
            out.append(Owner(name=slot, kind="training", pids=process_tree(roots, parents), planned_bytes=t.spec.vram_bytes))
        return out

    def gpu_accounting(self, r: GpuReading) -> tuple[list, list]:
        return self.gpu_watch.accounting(r)

    # ---------------------------------------------------------------------------------- supervision

    def _backoff_s(self, failures: int) -> float:
        return backoff_s(self.policy, failures)

    # ---------------------------------------------------------------------------- sleep and wake

    async def sleep_model(self, m: ModelSlot, level: int) -> Outcome:
        """Idempotent sleep, verified by /is_sleeping."""
        return await self.supervisors[m.name].sleep(level)

    async def wake_model(self, m: ModelSlot) -> Outcome:
        """Idempotent wake, verified by /is_sleeping and a real one-token completion (`took_ms`)."""
        return await self.supervisors[m.name].wake()

    async def probe_model(self, m: ModelSlot) -> Outcome:
        """A real one-token completion of a resident model (`latency_ms`); a failure is recorded now."""
        return await self.supervisors[m.name].probe()

    # ------------------------------------------------------------------------------------- training

    def gpu_busy_with_inference(self, spec: TrainingSpec) -> list[str]:
        """Models on the training slot's GPU that are not asleep (training there would fight them for VRAM)."""
        return [m.name for m in self.models.values()
                if m.spec.gpu_index == spec.gpu_index and m.runtime.can_sleep
                and m.state_tag in ("resident", "loading", "waking")]

    @property
    def trainers(self) -> dict[str, Trainer]:
        return self.training.trainers

    async def start_training_slot(self, slot: str, *, force: bool = False) -> Outcome:
        """Start a slot's trainer, unless this domain is the active one or models on its GPU are awake
        (`force`: regardless)."""

        async def admit(spec: TrainingSpec) -> Outcome | None:
            if force:
                return None
            if self.role == "active":
                await self._read_route()  # the pointer may have just moved (a settle right after a flip)
            if self.role == "active":
                return Outcome(ok=False, code="domain_active", detail=f"domain {self.domain!r} is the active domain "
                               f"(route revision {self.route_revision}); training runs only on a standby")
            busy = self.gpu_busy_with_inference(spec)
            if busy:
                return Outcome(ok=False, code="gpu_busy", detail=f"GPU {spec.gpu_index} holds awake models "
                               f"({', '.join(busy)}); put them to sleep first (training runs only in VRAM the sleeping "
                               f"runtimes freed)")
            return None

        return await self.training.start(slot, admit)

    async def stop_training_slot(self, slot: str) -> Ended | None:
        return await self.training.stop(slot)

    async def _make_room(self, gpu_index: int) -> list[str]:
        return await self.training.make_room(gpu_index)

    async def _resume_training(self, slots: list[str]) -> None:
        if self.role != "standby":
            return
        for slot in slots:
            started = await self.start_training_slot(slot)
            if not started.ok:
                self.logger.warning("could not resume training", slot=slot, code=started.code, detail=started.detail)

    async def refresh_route(self, revision: int) -> None:
        """A command decided against a newer route than we have seen: read the pointer now."""
        if revision > self.route_revision:
            await self._read_route()

    async def _initial_training(self) -> None:
        await asyncio.gather(*(m.settled.wait() for m in self.models.values()))
        if not self.config.auto_training or self.role != "standby" or self.stopping:
            return
        for slot in self.trainers:
            started = await self.start_training_slot(slot)
            if not started.ok:
                self.logger.warning("standby training not started", slot=slot, code=started.code, detail=started.detail)

    # ------------------------------------------------------------------------------- verbs (facts)

    def selected(self, command: Command) -> Selection:
        if not command.models:
            return Selection(models=list(self.models.values()))
        return Selection(models=[self.models[n] for n in command.models if n in self.models],
                         unknown=[n for n in command.models if n not in self.models])

    def status_data(self) -> dict:
        models = {}
        for name, m in self.models.items():
            st = msgspec.to_builtins(m.state)
            since = getattr(m.state, "since", None)
            models[name] = {
                "state": m.state_tag,
                "since": st.get("since"),
                "for_ms": int((now() - since).total_seconds() * 1000) if since is not None else 0,
                "seq": m.seq,
                "reason": st.get("reason", ""),
                "detail": st.get("detail", ""),
                "runtime": m.runtime.kind,
                "endpoint": m.runtime.base_url,
                "pid": m.runtime.pid if m.runtime.alive() else None,
                "gpu_index": m.spec.gpu_index,
                "attempt": m.attempt,
                "vram_bytes": m.spec.vram_bytes,
            }
        training = {}
        for slot, t in self.trainers.items():
            ended = t.ended
            training[slot] = {
                "running": t.running(),
                "pid": t.pid,
                "gpu_index": t.spec.gpu_index,
                "ran_ms": t.ran_ms() if t.running() else (ended.ran_ms if ended else 0),
                "last_stop": None if ended is None else {"how": ended.how, "exit_code": ended.exit_code},
            }
        gpus = {}
        for index in self.slots.gpu_indexes():
            r = self.read_gpu(index)
            gpus[str(index)] = {"present": r.present, "name": r.name, "memory_total_bytes": r.memory_total_bytes,
                                "memory_used_bytes": r.memory_used_bytes, "memory_free_bytes": r.memory_free_bytes,
                                "processes": [p.pid for p in r.processes], "mig": r.mig}
            usage, foreign = self.gpu_accounting(r)
            gpus[str(index)].update(accounted=r.accounted, usage=msgspec.to_builtins(usage),
                                    foreign=msgspec.to_builtins(foreign))
        return {
            "fleet": self.fleet,
            "domain": self.domain,
            "role": self.role,
            "active_domain": self.active_domain or self.slots.first_domain,
            "route_revision": self.route_revision,
            "pid": self.pid,
            "host": self.host,
            "serving_url": self.serving_url,
            "source": self.slots.source,
            "models": models,
            # changes applied live that wait for this domain to be the standby (they would interrupt a model
            # it serves as the active domain)
            "pending_layout": sorted(self.pending),
            "not_admitted": dict(self.slots.not_admitted),
            "training": training,
            "gpus": gpus,
        }

    async def verify_gpus(self, models: list[ModelSlot]) -> GpuVerdict:
        """Observe each of the models' GPUs now (recording what changed), then judge them."""
        for index in {m.spec.gpu_index for m in models}:
            await self.observe_gpu(index)
        return self.verify_gpu_data(models)

    def verify_gpu_data(self, models: list[ModelSlot]) -> GpuVerdict:
        """The judgment on the models' GPUs as they read now (agents/gpu_verdict.py)."""
        readings = {index: self.read_gpu(index) for index in gpus_of(models)}
        return judge_gpus(models, self.trainers, readings, residual_bytes=self.policy.sleep_residual_bytes,
                          pid_alive=pid_alive)

def reply(ok: bool, detail: str = "", *, took_ms: int = 0, error: ErrorInfo | None = None, data: dict | None = None) -> Reply:
    return Reply(ok=ok, detail=detail, took_ms=took_ms, error=error, data=data or {})
