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

Residency: a model is `loading` from the spawn until health passes, `/v1/models` lists it and a
one-token completion answers (warm-up measured); `resident` then. A child's exit is `lost
{process_exited}` at once (the exit waiter, not a poll). Periodic probes classify a failure with the
GPU-present bit (`gpu_detached`, `evicted`, `unhealthy`). Loading never times out. An exited (or
evicted) runtime is restarted with exponential backoff, every attempt a new `model_loading`; on a
standby the agent stops the training on that GPU first, reloads, puts the runtime to sleep, and
resumes the training. State-changing work on a model (supervisor, commands) is serialized by the
model's lock.

Role: the active domain is the `active` of the fleet's last `route_moved`; before any, the first
declared domain is active (config `role` may pin it). A standby sleeps its runtimes after they load.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone

import aiohttp
import msgspec
import nats.errors
import structlog

from agents import probes
from agents.config import (
    AgentConfig,
    HostSlots,
    diff_models,
    fold_declarations,
    load_layout_slots,
    slots_from_host_entry,
)
from agents.errors import AgentRefused, OutOfMemory, RuntimeProblem, TrainingProblem
from agents.gpu import GpuReading, Gpus, Owner, open_gpus, process_tree, read_parents
from agents.pulling import needs_pull, pull_for
from agents.runtimes import make_runtime
from agents.runtimes.base import runtimes_die_with_agent
from agents.training import Ended, Trainer
from agents.appender import Appender
from agents.cause import COMMAND_CAUSE, VERSION
from agents.gpu_watch import GPU_USED_THRESHOLD, GpuWatcher
from agents.gpu_watch import gpu_changed as _gpu_changed
from agents.heartbeat import Heartbeats, heartbeat_of
from agents.loops import LoopErrors, survive
from agents.commands import CommandService
from agents.model_slot import ModelSlot
from agents.ports import GpuVerdict, Outcome
from agents.runtime_files import RuntimeFiles, pid_alive, read_identities, runtime_on_start
from agents.serving import ServingProxy
from haru import causes, subjects
from haru.commands import Command, ErrorInfo, Heartbeat, Reply, heartbeat_decoder
from haru.errors import ConfigError, Conflict, IllegalTransition
from haru.eventlog import EventLog
from agents.observe import (
    Adopted,
    Answered,
    Exited,
    GpuGone,
    Observation,
    ProbeFailed,
    PullInterrupted,
    Slept,
    Spawned,
    SpawnRefused,
    StillAsleep,
    Unloaded,
    Vanished,
    WakeBegun,
    observe,
)
from haru.events import (
    AgentStarted,
    AgentStopping,
    Event,
    RouteMoved,
    TrainingStarted,
    TrainingStopped,
)
from haru.events import tag_of
from haru.residency import evolve, event_key, to_state
from haru.specs import ModelSpec, TrainingSpec
from haru.children import stop_group
from haru.tasks import cancel_and_wait

# GPU_USED_THRESHOLD, _gpu_changed: kept importable from here (agents/gpu_watch.py has them)
__all__ = ["Agent", "ModelSlot", "resolve_slots", "VERSION", "GPU_USED_THRESHOLD", "_gpu_changed"]

RUNTIME_STOP_GRACE_S = 15.0
LIVE_STATES = frozenset({"loading", "resident", "sleeping", "waking"})
# While a model loads, its /health is asked this often (one loopback GET; a 503 or a refused
# connection costs well under a millisecond), so `resident` is recorded within ~this of the runtime
# turning ready. bench/runtime.py measures it against a real llama-server.
LOADING_POLL_S = 0.02
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
        self._rechecking: set[str] = set()  # models the serving port asked to probe now
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
        self.trainers: dict[str, Trainer] = {}
        self.training_seq: dict[str, int] = {}
        self.training_lock = asyncio.Lock()
        for t in slots.admitted_training:
            self.trainers[t.slot] = Trainer(t, grace_ms=self.policy.training_grace_ms, log_dir=self.state_dir,
                                            on_exit=self._training_exited_factory(t.slot))
        self.files = RuntimeFiles(self.state_dir, logger=self.logger)
        self.loop_errors = LoopErrors()  # haru_agent_loop_errors_total{loop}
        self.append = Appender(log, stopping=lambda: self.stopping, logger=self.logger)
        self.gpu_watch = GpuWatcher(fleet=self.fleet, domain=self.domain, gpus=gpus, append=self.append, owners=self.owners,
                                    on_gone=self._gpu_went_away, exclude_pid=self.pid, logger=self.logger)
        self.active_domain = ""
        self.route_revision = 0
        self.stopping = False
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._service = None
        self._serving = None
        self.serving_url = ""
        self.keep_runtimes = False
        self.supervisors: dict[str, asyncio.Task] = {}  # model -> its supervisor task
        self.pending: dict[str, ModelSpec] = {}  # changes applied live that wait for this domain to be standby
        self._reconcile_lock = asyncio.Lock()
        self.adoptable: dict[str, dict] = {}  # model -> the identity of a live runtime found at boot
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

    def recheck(self, m: "ModelSlot") -> None:
        """Probe `m` now (the serving port saw its runtime fail a request), once at a time."""
        if m.name in self._rechecking or self.stopping:
            return
        self._rechecking.add(m.name)

        async def run() -> None:
            try:
                await self.check(m)  # records the loss; restarting an evicted one is the periodic probe's job
            finally:
                self._rechecking.discard(m.name)

        self._spawn_task(run(), f"recheck:{m.name}")

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
        if rec is not None and rec.event is not None and type(rec.event).__struct_config__.tag == "agent_started":
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
        nc = self.log.nc
        try:
            await nc.request(subjects.command(self.fleet, self.domain, "status"), b"{}", timeout=1.0)
            return True
        except nats.errors.NoRespondersError:
            pass
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            return True  # subscribed but slow: someone is there
        seen = asyncio.Event()

        async def on_hb(msg) -> None:
            try:
                hb = heartbeat_decoder.decode(msg.data)
            except msgspec.DecodeError:
                return
            if hb.pid != self.pid:
                seen.set()

        sub = await nc.subscribe(subjects.heartbeat(self.fleet, self.domain), cb=on_hb)
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
        heartbeats = Heartbeats(lambda data: self.log.nc.publish(heartbeat_subject, data), self.heartbeat,
                                interval_s=self.config.heartbeat_ms / 1000, errors=self.loop_errors, logger=self.logger)
        self._spawn_task(heartbeats.run(), "heartbeat")
        await self._read_route()
        self._spawn_task(self._follow_route(), "route")
        # The tips of every subject this agent writes: it continues their chains.
        for m in self.models.values():
            rec = await self.log.last(m.subject)
            if rec is not None:
                m.seq = rec.seq
                if rec.event is not None:
                    with contextlib.suppress(IllegalTransition):
                        m.state = to_state(rec.event, rec.seq)
        await self._find_runtimes()
        for slot in self.trainers:
            rec = await self.log.last(subjects.training(self.fleet, self.domain, slot))
            self.training_seq[slot] = rec.seq if rec is not None else 0
            if rec is not None and rec.event is not None and isinstance(rec.event, TrainingStarted):
                # The previous agent died with it running: it got SIGTERM then (its parent-death signal),
                # and the sweep above stopped whatever ignored it, with the slot's grace; say so.
                how = self._swept_training.get(slot, "terminated")
                await self._append_training(slot, TrainingStopped(
                    at=now(), domain=self.domain, slot=slot, how=how, exit_code=None, ran_ms=0))  # type: ignore[arg-type]
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
            self.supervisors[m.name] = self._spawn_task(self._supervise(m), f"model:{m.name}")
        self._spawn_task(self._initial_training(), "initial-training")
        if self.slots.source == "declared":
            self._spawn_task(self._follow_declarations(), "declarations")

    async def _shutdown(self) -> None:
        self.stopping = True
        if not self.agent_seq:
            return  # refused or never claimed: nothing of ours runs, and the pid file is another agent's
        reason = getattr(self, "_stop_reason", "") or "shutdown"
        if self.agent_seq:
            with contextlib.suppress(Exception):
                self.agent_seq = await self.log.append(
                    self.agent_subject, AgentStopping(at=now(), domain=self.domain, reason=reason), expect=self.agent_seq)
        if self._service is not None:
            with contextlib.suppress(Exception):
                await self._service.stop()
        if self._serving is not None:
            with contextlib.suppress(Exception):
                await self._serving.stop()
        # Training first: it holds VRAM the runtimes may need, and it is the cheapest to lose.
        for slot in list(self.trainers):
            with contextlib.suppress(Exception):
                await self.stop_training_slot(slot)
        hb = [t for t in self._tasks if t.get_name() == "heartbeat"]
        await cancel_and_wait(*(t for t in self._tasks if t not in hb))
        if self.keep_runtimes:
            # A restart: every runtime keeps serving; its identity file stays for the next agent.
            for m in self.models.values():
                self._write_identity(m)
            self.logger.info("runtimes kept for the next agent", models=[m.name for m in self.models.values()
                                                                         if m.runtime.alive() and m.runtime.pid])
        else:
            await asyncio.gather(*(self._unload(m) for m in self.models.values()), return_exceptions=True)
        await cancel_and_wait(*hb)
        self._write_children()
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

    async def _record_on_the_way_out(self, m: ModelSlot, observation: Observation) -> None:
        """Record while stopping: a failure (the log gone) is logged with its traceback, never raised."""
        try:
            await self._record(m, observation)
        except Exception:
            self.logger.exception("could not record on the way out", model=m.name, observation=type(observation).__name__)

    # ------------------------------------------------------------- runtimes that outlive the agent

    def _write_children(self) -> None:
        self.files.write_children(self.trainers.values())

    def _write_identity(self, m: ModelSlot) -> None:
        self.files.write_identity(m.name, m.runtime)

    def _drop_identity(self, name: str) -> None:
        self.files.drop_identity(name)

    async def _find_runtimes(self) -> None:
        """Read the identity files a previous agent left: adopt what still matches the layout and answers,
        stop what the layout no longer wants, and note what died while no agent watched (recorded `lost`
        once, by the model's supervisor). A pid now held by another process is never touched."""
        for name, (path, doc) in read_identities(self.state_dir).items():
            if doc is None:
                self.logger.warning("unreadable runtime identity file; ignored", path=str(path))
                path.unlink(missing_ok=True)
                continue
            pid, start, port = int(doc["pid"]), int(doc["start"]), int(doc["port"])
            log = self.logger.bind(model=name, pid=pid)
            m = self.models.get(name)
            on_start = runtime_on_start(doc, m.runtime if m else None, m.spec if m else None)
            verdict, why = on_start.action, on_start.why
            if verdict == "start":
                # Gone while no agent watched (or its pid now belongs to someone else: never adopted, never
                # signalled).
                self.away[name] = why
                path.unlink(missing_ok=True)
                log.warning("runtime died while no agent watched it", why=why)
                continue
            if verdict in ("stop", "replace"):
                log.info("stopping a runtime the layout no longer wants", why=why)
                await asyncio.to_thread(stop_group, pid, start, RUNTIME_STOP_GRACE_S)
                path.unlink(missing_ok=True)
                await self._record_unwanted(name, why)
                continue
            assert m is not None
            if not m.runtime.adopt(pid, start, port, list(doc.get("argv") or [])):  # type: ignore[attr-defined]
                self.away[name] = f"the runtime (pid {pid}) exited while the agent was starting"
                path.unlink(missing_ok=True)
                continue
            timeout = self.policy.probe_timeout_ms / 1000
            health = await m.runtime.health(timeout_s=min(timeout, 5.0))
            listed = False
            asleep: bool | None = None
            if health.ok:
                with contextlib.suppress(RuntimeProblem):
                    listed = m.name in await m.runtime.list_models(timeout_s=min(timeout, 5.0))
                with contextlib.suppress(RuntimeProblem):
                    asleep = await m.runtime.is_sleeping(timeout_s=min(timeout, 5.0))
            if not (health.ok and listed):
                why = health.detail or f"/health answered {health.status}" if not health.ok else "it no longer lists the model"
                log.warning("not adopting a runtime that does not answer; stopping it", why=why)
                m.on_purpose = True
                await m.runtime.stop(RUNTIME_STOP_GRACE_S)
                m.on_purpose = False
                path.unlink(missing_ok=True)
                self.away[name] = f"the runtime (pid {pid}) outlived its agent but did not answer ({why[:200]}); stopped"
                continue
            self.adoptable[name] = {"pid": pid, "asleep": bool(asleep), "endpoint": m.runtime.base_url}

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

    async def _adopt(self, m: ModelSlot) -> bool:
        """Take over the runtime `_find_runtimes` found: `model_adopted`, then watch it like one we loaded."""
        found = self.adoptable.pop(m.name)
        async with m.lock:
            m.generation += 1
            m.exited.clear()
            m.exit_code = None
            m.on_purpose = False
            level = getattr(m.state, "level", 1) or 1
            await self._record(m, Adopted(**self._about(m), pid=found["pid"], endpoint=found["endpoint"],
                                          asleep=found["asleep"], level=level,
                                          detail="kept serving through the agent's restart"))
            self._spawn_task(self._exit_waiter(m, m.generation), f"exit:{m.name}:{m.generation}")
            if not found["asleep"]:
                m.resident_at = time.monotonic()
        return True

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
            while not self.stopping:
                events.clear()
                try:
                    await self.log.replay(on, from_seq=1, subject_filter=subjects.decl(self.fleet), follow=True)
                except asyncio.CancelledError:
                    raise
                except Exception:  # the log went away for a while (or a bug): keep what runs
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
            diff = diff_models(self.slots.admitted_models, new.admitted_models)
            self.slots, self.policy = new, new.policy
            done: dict[str, list[str]] = {"started": [], "stopped": [], "replaced": [], "pending": []}
            for name in diff.removed:
                self.pending.pop(name, None)
                await self._retire(name, "the layout no longer has this model")
                done["stopped"].append(name)
            for spec in diff.added:
                m = self.models[spec.name] = self._new_slot(spec)
                rec = await self.log.last(m.subject)
                if rec is not None:
                    m.seq = rec.seq
                    if rec.event is not None:
                        with contextlib.suppress(IllegalTransition):
                            m.state = to_state(rec.event, rec.seq)
                self.supervisors[spec.name] = self._spawn_task(self._supervise(m), f"model:{spec.name}")
                done["started"].append(spec.name)
            for spec in diff.changed:
                if self.role == "active" and self.models[spec.name].state_tag in LIVE_STATES:
                    self.pending[spec.name] = spec
                    done["pending"].append(spec.name)
                else:
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
        task = self.supervisors.pop(name, None)
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
        rec = await self.log.last(m.subject)
        if rec is not None:
            m.seq = rec.seq
            if rec.event is not None:
                with contextlib.suppress(IllegalTransition):
                    m.state = to_state(rec.event, rec.seq)
        self.supervisors[spec.name] = self._spawn_task(self._supervise(m), f"model:{spec.name}")

    # --------------------------------------------------------------------------------------- writes

    def _about(self, m: ModelSlot) -> dict:
        """The fields every observation of `m` carries: when, which domain, which model."""
        return {"at": now(), "domain": self.domain, "model": m.name}

    async def _record(self, m: ModelSlot, observation: Observation) -> Event | None:
        """Ask the decision table (agents/observe.py) what `observation` means for `m` as recorded, and
        append that event (None: nothing to write). A pair the table refuses raises IllegalObservation:
        nothing is appended."""
        if isinstance(observation, GpuGone) and not self._gpu_gone_seq(m):
            # Record the GPU's absence first, so the loss can cite the observation that showed it.
            try:
                await self.observe_gpu(m.spec.gpu_index)
            except Exception:
                self.logger.exception("could not record the GPU's absence before the loss", model=m.name)
        async with m.append_lock:
            event = observe(m.state, observation)
            if event is None:
                return None
            event = causes.with_cause(event, causes.residency_cause(
                event, prev_tag=m.state_tag, prev_seq=m.seq, command=COMMAND_CAUSE.get(), gpu_gone=self._gpu_gone_seq(m),
                agent=self.agent_seq, stopping=self.stopping))
            m.seq = await self.append(m.subject, event, m.seq)
            m.state = evolve(m.state, event, seq=m.seq, subject=m.subject)  # the table wrote only legal events
        self.logger.info(event_key(event), model=m.name, **{k: v for k, v in msgspec.to_builtins(event).items()
                                                            if k in ("reason", "detail", "attempt", "warmup_ms", "exit_code", "pid")})
        return event

    async def _append_training(self, slot: str, event: Event) -> None:
        subject = subjects.training(self.fleet, self.domain, slot)
        event = causes.with_cause(event, causes.training_cause(event, command=COMMAND_CAUSE.get(), agent=self.agent_seq,
                                                               stopping=self.stopping))
        self.training_seq[slot] = await self.append(subject, event, self.training_seq.get(slot, 0))

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
                await self.log.replay(on, from_seq=max(1, self.route_revision), subject_filter=subjects.route(self.fleet),
                                      follow=True)
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
        ms = self.policy.restart_backoff_ms * (2 ** max(0, failures - 1))
        return min(ms, self.policy.restart_backoff_max_ms) / 1000

    async def _pause(self, seconds: float) -> bool:
        """Sleep unless the agent stops first; True if it is stopping."""
        if self.stopping:
            return True
        try:
            async with asyncio.timeout(seconds):
                await self._stop.wait()
            return True
        except asyncio.TimeoutError:
            return self.stopping

    async def _supervise(self, m: ModelSlot) -> None:
        """Load (or adopt) the model, watch it, and restart it with backoff, until the agent stops. An
        attempt that raises (a bug) is logged with its traceback and counted (`loop_errors["supervise"]`);
        what it started is stopped, and the next attempt comes after the backoff."""
        adopted = m.name in self.adoptable
        if not adopted and m.runtime.kind != "external":
            # Its runtime is gone (it died while no agent watched, or an agent before issue 14 took it
            # along): if the chain says live, it says so, once, before we reload.
            await survive(lambda: self._record(m, Vanished(**self._about(m), detail=self.away.pop(
                m.name, "the previous agent stopped without unloading it"))), name="supervise",
                errors=self.loop_errors, logger=self.logger, model=m.name)
        first = True
        while not self.stopping:
            if not first and await self._pause(self._backoff_s(m.failures)):
                return
            try:
                if await self._attempt(m, first=first, adopted=adopted):
                    return
            except asyncio.CancelledError:
                raise
            except Exception:
                n = self.loop_errors.count("supervise")
                self.logger.exception("supervision attempt failed; retrying after the backoff", model=m.name, errors=n)
                m.settled.set()
                if m.runtime.kind != "external" and m.runtime.alive():
                    m.on_purpose = True
                    await m.runtime.stop(RUNTIME_STOP_GRACE_S)
            adopted = first = False
            if self.stopping:
                return
            # Consecutive failures double the backoff; a runtime that stayed up for a while starts afresh.
            if m.resident_at and time.monotonic() - m.resident_at >= self.policy.restart_backoff_max_ms / 1000:
                m.failures = 1
            else:
                m.failures += 1
            m.resident_at = 0.0
            if m.runtime.kind == "external":
                m.failures = max(m.failures, 1)

    async def _attempt(self, m: ModelSlot, *, first: bool, adopted: bool) -> bool:
        """One load (or adoption) of `m`, watched until its runtime is gone. True if the agent stops."""
        if await self._wait_for_gpu(m):
            return True
        paused: list[str] = []
        if self.role == "standby" and not first:
            answering = COMMAND_CAUSE.set(m.seq)  # the loss this restart answers: what the pause cites
            try:
                paused = await self._make_room(m.spec.gpu_index)
            finally:
                COMMAND_CAUSE.reset(answering)
        try:
            ready = await (self._adopt(m) if adopted else self._load(m))
            if ready and self.role == "standby" and m.runtime.can_sleep:
                async with m.lock:
                    if m.state_tag == "resident":
                        try:
                            await self._sleep_one(m, 1)
                        except RuntimeProblem as exc:
                            self.logger.warning("could not put the standby runtime to sleep", model=m.name, error=str(exc))
        finally:
            if paused:
                await self._resume_training(paused)
            if first:
                m.settled.set()
        if ready:
            await self._watch(m)
        return False

    async def _wait_for_gpu(self, m: ModelSlot) -> bool:
        """A detached GPU cannot load anything: wait for it to come back. True if the agent stops."""
        if m.runtime.kind == "external":
            return False
        while self.gpu_went_away(m.spec.gpu_index):
            m.settled.set()
            if await self._pause(self.policy.probe_interval_ms / 1000):
                return True
        return False

    async def _load(self, m: ModelSlot) -> bool:
        """Spawn (or re-attach to) the runtime and wait until it is resident or gone. Never times out."""
        if needs_pull(m.runtime.spec.source, m.runtime.kind) and not await pull_for(m, self._record, self._about):
            return False  # a layout's reference: pulled first (`pulling`), or failed in the registry's words
        async with m.lock:
            m.attempt += 1
            m.generation += 1
            m.exited.clear()
            m.exit_code = None
            m.on_purpose = False
            started = time.monotonic()
            try:
                await m.runtime.start()
            except RuntimeProblem as exc:  # the attempt is recorded, and what the runtime (or the OS) said
                await self._record(m, Spawned(**self._about(m), endpoint=m.runtime.base_url, pid=0, attempt=m.attempt))
                await self._record(m, SpawnRefused(**self._about(m), said=str(exc)))
                return False
            await self._record(m, Spawned(**self._about(m), endpoint=m.runtime.base_url, pid=m.runtime.pid or 0,
                                          attempt=m.attempt))
            self._write_identity(m)
            if m.runtime.kind != "external":
                self._spawn_task(self._exit_waiter(m, m.generation), f"exit:{m.name}:{m.generation}")
        poll = LOADING_POLL_S
        timeout = self.policy.probe_timeout_ms / 1000
        while not self.stopping:
            if m.exited.is_set():
                return False
            probe = await probes.ready(m.runtime, timeout_s=timeout, check_sleep=False)
            if probe.ok:
                async with m.lock:
                    if m.exited.is_set() or m.state_tag != "loading":
                        return False
                    m.last_probe = probe
                    warmup = int((time.monotonic() - started) * 1000)
                    await self._record(m, Answered(**self._about(m), endpoint=m.runtime.base_url, warmup_ms=warmup))
                    m.resident_at = time.monotonic()
                return True
            if m.runtime.kind != "external" and self.gpu_went_away(m.spec.gpu_index):
                async with m.lock:
                    await self._record(m, GpuGone(**self._about(m), detail="the GPU went away while the model was loading"))
                    m.on_purpose = True
                    await m.runtime.stop(RUNTIME_STOP_GRACE_S)
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                async with asyncio.timeout(poll):
                    await m.exited.wait()
        return False

    async def _exit_waiter(self, m: ModelSlot, generation: int) -> None:
        code = await m.runtime.wait_exit()
        if generation != m.generation:
            return
        m.exit_code = code
        try:
            if m.on_purpose or self.stopping:
                await self._record(m, Exited(**self._about(m), code=code, expected=True))
            else:
                # A nonzero exit before it ever answered is the runtime refusing the model (a corrupt or
                # truncated file, an unknown architecture): `failed`, in its own words (the table decides);
                # the supervisor retries with the growing backoff, never in a tight loop.
                said = runtime_said(m.runtime.output_tail(8000), code) if code is not None and code > 0 else ""
                tail = m.runtime.output_tail(600).strip().splitlines()
                detail = (f"the runtime exited with code {code}" if code is not None else
                          f"the adopted runtime (pid {m.runtime.pid}) exited; its exit status went to its reaper")
                if tail:
                    detail += f"; last output: {tail[-1][:300]}"
                await self._record(m, Exited(**self._about(m), code=code, said=said, detail=detail))
        finally:
            self._drop_identity(m.name)  # it is gone: nothing to adopt
            m.exited.set()

    async def _watch(self, m: ModelSlot) -> None:
        """Probe a loaded runtime every probe interval until its process is gone (or must be restarted)."""
        interval = self.policy.probe_interval_ms / 1000
        while not self.stopping:
            with contextlib.suppress(asyncio.TimeoutError):
                async with asyncio.timeout(interval):
                    await m.exited.wait()
            if m.exited.is_set() or self.stopping:
                return
            if m.lock.locked():
                continue  # a command is changing it: probe next time
            restart = await self.check(m)
            if restart:
                async with m.lock:
                    m.on_purpose = True
                    await m.runtime.stop(RUNTIME_STOP_GRACE_S)
                    m.exited.set()
                return

    async def check(self, m: ModelSlot) -> bool:
        """One periodic probe of a model, recording what changed. True = the runtime must be restarted."""
        async with m.lock:
            if m.exited.is_set():
                return False
            timeout = self.policy.probe_timeout_ms / 1000
            tag = m.state_tag
            gpu = self.read_gpu(m.spec.gpu_index) if m.runtime.kind != "external" else None
            if tag == "sleeping":
                if gpu is not None and gpu.present is False:
                    await self._gpu_gone(m, "the GPU went away while the runtime slept")
                    return False
                health = await m.runtime.health(timeout_s=min(timeout, 5.0))
                if not health.ok:
                    alive = m.runtime.alive()
                    reason = probes.diagnose(process_alive=alive, gpu=gpu, runtime_holds_model=True)
                    await self._lost(m, reason, health.detail or f"/health answered {health.status} while asleep")
                    return False
                try:
                    asleep = await m.runtime.is_sleeping(timeout_s=min(timeout, 5.0))
                except RuntimeProblem:
                    asleep = True
                if asleep is False:  # woken behind our back: find out whether it serves
                    tag = "lost"
                else:
                    return False
            if tag not in ("resident", "lost"):
                return False
            started = time.monotonic()
            probe = await probes.ready(m.runtime, timeout_s=timeout)
            m.last_probe = probe
            m.probe_ms = int((time.monotonic() - started) * 1000)
            if probe.ok:
                if tag != "resident" or m.state_tag != "resident":
                    await self._record(m, Answered(**self._about(m), endpoint=m.runtime.base_url,
                                                   warmup_ms=probe.latency_ms))
                    m.resident_at = time.monotonic()
                return False
            if m.exited.is_set():
                return False
            if tag == "lost" and probe.step == "sleeping":
                # A lost runtime found healthy but asleep (its GPU came back while it slept): the table has
                # no lost -> sleeping, so it is reloaded (lost -> loading), and a standby puts it back to sleep.
                return True
            alive = m.runtime.alive()
            holds = await probes.holds_model(m.runtime, min(timeout, 5.0)) if probe.step != "listed" else False
            if gpu is None and m.runtime.kind != "external":
                gpu = self.read_gpu(m.spec.gpu_index)
            reason = probes.diagnose(process_alive=alive, gpu=gpu, runtime_holds_model=holds)
            if not alive:
                return False  # the exit waiter records process_exited
            await self._lost(m, reason, f"{probe.step}: {probe.detail}"[:500])  # the table: no news if already so
            return reason == "evicted"

    def _gpu_gone_seq(self, m: ModelSlot) -> int:
        """The recorded observation that the model's GPU is gone (0 = none)."""
        return self.gpu_watch.gone_seq(m.spec.gpu_index)

    async def _lost(self, m: ModelSlot, reason: str, detail: str) -> None:
        if reason == "gpu_detached":
            await self._gpu_gone(m, detail)
            return
        await self._record(m, ProbeFailed(**self._about(m), reason=reason, detail=detail))  # type: ignore[arg-type]

    async def _gpu_gone(self, m: ModelSlot, detail: str) -> None:
        if await self._record(m, GpuGone(**self._about(m), detail=detail)) is not None:
            # Record the GPU's absence now: that checks the other models on it (see _observe_gpu).
            self._spawn_task(self.observe_gpu(m.spec.gpu_index), f"gpu-check:{m.spec.gpu_index}")

    # ---------------------------------------------------------------------------- sleep and wake

    async def _sleep_one(self, m: ModelSlot, level: int) -> None:
        """Put a resident runtime to sleep (caller holds m.lock). Verified through /is_sleeping."""
        before = self.read_gpu(m.spec.gpu_index)
        await m.runtime.sleep(level, self.policy.wake_timeout_ms / 1000)
        after = self.read_gpu(m.spec.gpu_index)
        freed = max(0, before.memory_used_bytes - after.memory_used_bytes) if before.present and after.present else 0
        await self._record(m, Slept(**self._about(m), level=level, freed_bytes=freed))

    async def sleep_model(self, m: ModelSlot, level: int) -> Outcome:
        """Idempotent sleep."""
        if not m.runtime.can_sleep:
            return Outcome(ok=True, detail=f"a {m.runtime.kind} runtime has no sleep mode; it stays {m.state_tag}")
        async with m.lock:
            if self.gpu_went_away(m.spec.gpu_index):
                # A runtime may well answer /sleep on a GPU that is gone; its weights are not in VRAM to free.
                await self._gpu_gone(m, "the GPU went away; asked to sleep")  # the table: no news if already lost
                return Outcome(ok=False, code="gpu_detached", detail=f"GPU {m.spec.gpu_index} is gone (the provider took it): {m.name} is lost, not asleep")
            tag = m.state_tag
            if tag == "sleeping":
                try:
                    if await m.runtime.is_sleeping() is True:
                        return Outcome(ok=True, detail="already asleep")
                except RuntimeProblem as exc:
                    return Outcome(ok=False, code=exc.code, detail=str(exc))
            elif tag not in ("resident", "waking"):
                return Outcome(ok=False, code="not_resident", detail=f"{m.name} is {tag}; only a resident model can be put to sleep")
            try:
                await self._sleep_one(m, level)
            except RuntimeProblem as exc:
                return Outcome(ok=False, code=exc.code, detail=str(exc))
            return Outcome(ok=True, detail="asleep (verified by /is_sleeping)")

    async def wake_model(self, m: ModelSlot) -> Outcome:
        """Idempotent wake, verified by /is_sleeping and a real one-token completion (`took_ms`)."""
        started = time.monotonic()
        timeout = self.policy.probe_timeout_ms / 1000
        async with m.lock:
            tag = m.state_tag
            if tag == "resident" or not m.runtime.can_sleep:
                if tag != "resident":
                    return Outcome(ok=False, code="not_resident", detail=f"{m.name} is {tag}", took_ms=0)
                probe = await probes.ready(m.runtime, timeout_s=timeout)
                if probe.ok:
                    return Outcome(ok=True, detail="already awake; probe answered", took_ms=int((time.monotonic() - started) * 1000))
                return Outcome(ok=False, code="probe_failed", detail=f"awake but the probe failed at {probe.step}: {probe.detail}", took_ms=0)
            if tag not in ("sleeping", "waking"):
                return Outcome(ok=False, code="not_sleeping", detail=f"{m.name} is {tag}; there is nothing to wake", took_ms=0)
            await self._record(m, WakeBegun(**self._about(m)))  # sleeping -> waking; a retried wake: no news
            gen = m.generation
            try:
                await m.runtime.wake(self.policy.wake_timeout_ms / 1000)
            except OutOfMemory as exc:
                await self._after_failed_wake(m, gen)
                return Outcome(ok=False, code="out_of_memory", detail=str(exc), took_ms=int((time.monotonic() - started) * 1000))
            except RuntimeProblem as exc:
                await self._after_failed_wake(m, gen)
                return Outcome(ok=False, code=exc.code, detail=str(exc), took_ms=int((time.monotonic() - started) * 1000))
            probe = await probes.ready(m.runtime, timeout_s=timeout)
            took = int((time.monotonic() - started) * 1000)
            if gen != m.generation or m.exited.is_set():
                return Outcome(ok=False, code="process_exited", detail=f"{m.name}'s runtime exited while waking", took_ms=took)
            if not probe.ok:
                code = "out_of_memory" if "out of memory" in probe.detail.lower() else "probe_failed"
                await self._after_failed_wake(m, gen, probe=probe)
                return Outcome(ok=False, code=code, detail=f"woke but the probe failed at {probe.step}: {probe.detail}", took_ms=took)
            m.last_probe = probe
            await self._record(m, Answered(**self._about(m), endpoint=m.runtime.base_url, warmup_ms=took))
            m.resident_at = time.monotonic()
            return Outcome(ok=True, detail=f"awake (verified by /is_sleeping and a probe in {probe.latency_ms} ms)", took_ms=took)

    async def probe_model(self, m: ModelSlot) -> Outcome:
        """A real one-token completion of a resident model (`latency_ms`); a failed one is news: the
        supervisor's diagnosis records it now."""
        if m.state_tag != "resident":
            return Outcome(ok=False, code="not_resident", detail=f"{m.name} is {m.state_tag}")
        p = await probes.ready(m.runtime, timeout_s=self.policy.probe_timeout_ms / 1000)
        if p.ok:
            return Outcome(ok=True, detail=f"answered in {p.latency_ms} ms", latency_ms=p.latency_ms)
        await self.check(m)
        return Outcome(ok=False, code="probe_failed", detail=f"{p.step}: {p.detail}")

    async def _after_failed_wake(self, m: ModelSlot, gen: int, probe: probes.Probe | None = None) -> None:
        """Record the truth after a wake failed: still asleep, or lost (and why)."""
        if gen != m.generation or m.exited.is_set() or m.state_tag != "waking":
            return
        try:
            asleep = await m.runtime.is_sleeping()
        except RuntimeProblem:
            asleep = None
        if asleep is True:
            await self._record(m, StillAsleep(**self._about(m), level=1))
            return
        gpu = self.read_gpu(m.spec.gpu_index)
        holds = await probes.holds_model(m.runtime, min(self.policy.probe_timeout_ms / 1000, 5.0))
        reason = probes.diagnose(process_alive=m.runtime.alive(), gpu=gpu, runtime_holds_model=holds)
        if reason != "process_exited":
            detail = f"wake failed: {probe.step}: {probe.detail}" if probe else "wake failed"
            await self._lost(m, reason, detail[:500])

    # ------------------------------------------------------------------------------------- training

    def _training_exited_factory(self, slot: str):
        async def on_exit(ended: Ended) -> None:
            async with self.training_lock:
                await self._append_training(slot, TrainingStopped(at=now(), domain=self.domain, slot=slot, how=ended.how,
                                                                  exit_code=ended.exit_code, ran_ms=ended.ran_ms))
                self._write_children()
            self.logger.info("training_stopped", slot=slot, how=ended.how, exit_code=ended.exit_code)

        return on_exit

    def gpu_busy_with_inference(self, spec: TrainingSpec) -> list[str]:
        """Models on the training slot's GPU that are not asleep (training there would fight them for VRAM)."""
        return [m.name for m in self.models.values()
                if m.spec.gpu_index == spec.gpu_index and m.runtime.can_sleep
                and m.state_tag in ("resident", "loading", "waking")]

    async def start_training_slot(self, slot: str, *, force: bool = False) -> Outcome:
        t = self.trainers[slot]
        async with self.training_lock:
            if t.running():
                return Outcome(ok=True, detail=f"already running (pid {t.pid})")
            if self.role == "active" and not force:
                await self._read_route()  # the pointer may have just moved (a settle right after a flip)
            if self.role == "active" and not force:
                return Outcome(ok=False, code="domain_active", detail=f"domain {self.domain!r} is the active domain (route revision "
                                                f"{self.route_revision}); training runs only on a standby")
            busy = self.gpu_busy_with_inference(t.spec)
            if busy and not force:
                return Outcome(ok=False, code="gpu_busy", detail=f"GPU {t.spec.gpu_index} holds awake models ({', '.join(busy)}); put them to "
                                           f"sleep first (training runs only in VRAM the sleeping runtimes freed)")
            try:
                pid = await t.start()
            except TrainingProblem as exc:
                return Outcome(ok=False, code=exc.code, detail=str(exc))
            await self._append_training(slot, TrainingStarted(at=now(), domain=self.domain, slot=slot, pid=pid,
                                                              gpu_index=t.spec.gpu_index))
            self._write_children()
        self.logger.info("training_started", slot=slot, pid=pid)
        return Outcome(ok=True, detail=f"started (pid {pid})")

    async def stop_training_slot(self, slot: str) -> Ended | None:
        t = self.trainers[slot]
        async with self.training_lock:
            ended = await t.stop()
            if ended is not None:
                await self._append_training(slot, TrainingStopped(at=now(), domain=self.domain, slot=slot, how=ended.how,
                                                                  exit_code=ended.exit_code, ran_ms=ended.ran_ms))
                self._write_children()
                self.logger.info("training_stopped", slot=slot, how=ended.how, exit_code=ended.exit_code)
        return ended

    async def _make_room(self, gpu_index: int) -> list[str]:
        stopped = []
        for slot, t in self.trainers.items():
            if t.spec.gpu_index == gpu_index and t.running():
                await self.stop_training_slot(slot)
                stopped.append(slot)
        return stopped

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

    def selected(self, command: Command) -> tuple[list[ModelSlot], list[str]]:
        if not command.models:
            return list(self.models.values()), []
        found = [self.models[n] for n in command.models if n in self.models]
        unknown = [n for n in command.models if n not in self.models]
        return found, unknown

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
        """Free VRAM on each inference GPU covers what its asleep models need to wake, and no trainer
        pid is left on the GPU.

        On a host without NVML (present None) the VRAM cannot be read: what can be verified is, and the
        rest is said in `data["unverified"]` instead of aborting every promotion. The trainers' processes
        must be gone as the OS reports it (/proc), since the driver frees an exited process's device memory.
        """
        trainer_pids: set[int] = set()
        for t in self.trainers.values():
            trainer_pids |= t.group_pids()
            if t.ended is not None:
                trainer_pids.add(t.ended.pid)
        running = [slot for slot, t in self.trainers.items() if t.running()]
        per_gpu: dict[int, list[ModelSlot]] = {}
        for m in models:
            if m.runtime.kind != "external":
                per_gpu.setdefault(m.spec.gpu_index, []).append(m)
        out: dict[str, dict] = {}
        problems: list[tuple[str, str]] = []
        unverified: list[str] = []
        residual = self.policy.sleep_residual_bytes
        for index, ms in sorted(per_gpu.items()):
            r = self.read_gpu(index)
            needed = sum(max(0, m.spec.vram_bytes - (residual if m.runtime.can_sleep else 0))
                         for m in ms if m.state_tag in ("sleeping", "waking"))
            on_gpu = sorted(p.pid for p in r.processes if p.pid in trainer_pids)
            out[str(index)] = {"present": r.present, "free_bytes": r.memory_free_bytes, "needed_bytes": needed,
                               "total_bytes": r.memory_total_bytes, "trainer_pids": on_gpu,
                               "models": [m.name for m in ms]}
            if r.present is False:
                problems.append(("gpu_detached", f"GPU {index} is gone (the provider took it)"))
            elif r.present is None:
                alive = sorted(p for p in trainer_pids if pid_alive(p))
                out[str(index)].update(nvml=False, trainer_pids=alive)
                if alive:
                    problems.append(("gpu_busy", f"trainer processes {alive} still run (GPU {index} cannot be read: "
                                                  f"no NVML on this host)"))
                else:
                    unverified.append(f"GPU {index}: NVML absent on this host, so free VRAM is unverified "
                                      f"(needed {needed} bytes to wake); trainer processes gone as the OS reports it")
            else:
                if on_gpu:
                    problems.append(("gpu_busy", f"GPU {index} still has trainer processes {on_gpu}"))
                if r.memory_free_bytes < needed:
                    problems.append(("gpu_busy", f"GPU {index} has {r.memory_free_bytes} bytes free; its sleeping models "
                                                  f"need {needed} to wake (short by {needed - r.memory_free_bytes})"))
        if running:
            problems.insert(0, ("training_running", f"training still runs: {', '.join(running)}; stop_training first"))
        data = {"gpus": out, "training_running": running, "unverified": unverified}
        if problems:
            return GpuVerdict(ok=False, error=ErrorInfo(code=problems[0][0], message="; ".join(p[1] for p in problems)),
                              data=data)
        return GpuVerdict(ok=True, data=data)


_LOG_PREFIX = re.compile(r"^[\d.:]+\s+[A-Z]\s+")
_ERROR_MARKERS = ("error", "failed", "invalid", "cannot", "unable", "exception", "not found", "no such")


def runtime_said(output: str, code: int, limit: int = 1000) -> str:
    """What a runtime that exited while loading said: its error lines from this attempt's output."""
    attempt = output.rsplit("--- haru agent starting:", 1)[-1]
    lines = [ln.strip() for ln in attempt.splitlines()[1:] if ln.strip()]
    picked: list[str] = []
    for ln in (ln for ln in lines if any(m in ln.lower() for m in _ERROR_MARKERS)):
        ln = _LOG_PREFIX.sub("", ln)  # llama.cpp's "0.00.002.891 E " timestamp and level
        if ln not in picked:
            picked.append(ln)
    # The first errors say what went wrong, the last one how it ended.
    said = " | ".join(picked[:2] + picked[-1:] if len(picked) > 3 else picked or lines[-3:])
    return f"exited with code {code} while loading: {said}"[:limit] if said else f"exited with code {code} while loading"


def reply(ok: bool, detail: str = "", *, took_ms: int = 0, error: ErrorInfo | None = None, data: dict | None = None) -> Reply:
    return Reply(ok=ok, detail=detail, took_ms=took_ms, error=error, data=data or {})
