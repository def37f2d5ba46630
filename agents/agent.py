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
import json
import os
import re
import socket
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path

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
from agents.gpu import GpuReading, Gpus, Owner, account, open_gpus, process_tree, read_parents
from agents.pulling import needs_pull, pull_for
from agents.runtimes import Runtime, make_runtime
from agents.runtimes.base import runtimes_die_with_agent
from agents.training import Ended, Trainer
from agents.commands import COMMAND_CAUSE
from haru import causes, procfs, subjects
from haru.commands import Command, ErrorInfo, Heartbeat, Reply, heartbeat_decoder
from haru.errors import ConfigError, Conflict, IllegalTransition, LogUnavailable
from haru.eventlog import EventLog
from haru.events import (
    AgentStarted,
    AgentStopping,
    Event,
    GpuObserved,
    ModelFailed,
    ModelLoading,
    ModelLost,
    ModelResident,
    ModelSleeping,
    ModelAdopted,
    ModelStopped,
    ModelWaking,
    RouteMoved,
    TrainingStarted,
    TrainingStopped,
)
from haru.events import tag_of
from haru.residency import UNKNOWN, Residency, evolve, is_legal, event_key, state_name, to_state
from haru.specs import MiB, ModelSpec, TrainingSpec
from haru.children import alive as proc_alive
from haru.children import stop_group
from haru.tasks import cancel_and_wait

__all__ = ["Agent", "ModelSlot", "resolve_slots", "VERSION"]

VERSION = "0.1.0"
GPU_USED_THRESHOLD = 64 * MiB  # memory moves smaller than this are noise, not an observation
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


class ModelSlot:
    """One admitted model on this host: its runtime, its residency as recorded, its lock."""

    def __init__(self, spec: ModelSpec, runtime: Runtime, subject: str) -> None:
        self.spec = spec
        self.runtime = runtime
        self.subject = subject
        self.seq = 0  # the subject's last sequence, as this agent knows it
        self.state: Residency = UNKNOWN
        self.lock = asyncio.Lock()  # state-changing work: supervisor transitions, sleep, wake
        self.append_lock = asyncio.Lock()
        self.generation = 0  # bumped per spawn; an exit of an older generation is old news
        self.attempt = 0
        self.failures = 0
        self.resident_at = 0.0
        self.exited = asyncio.Event()
        self.exit_code: int | None = None
        self.on_purpose = False  # the agent is stopping this runtime itself
        self.settled = asyncio.Event()  # the first load attempt has come to rest
        self.probe_ms = 0
        self.last_probe: probes.Probe | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def state_tag(self) -> str:
        return state_name(self.state)


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
        self.gpu_seq: dict[int, int] = {}
        self.gpu_last: dict[int, GpuObserved | None] = {}
        self.gpu_seen: set[int] = set()
        self.gpu_lock = asyncio.Lock()
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
        self._swept_training: dict[str, str] = await asyncio.to_thread(self._sweep_orphans)
        self._spawn_task(self._heartbeat_loop(), "heartbeat")
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
        for index in self.slots.gpu_indexes():
            rec = await self.log.last(subjects.gpu(self.fleet, self.domain, index))
            self.gpu_seq[index] = rec.seq if rec is not None else 0
            self.gpu_last[index] = rec.event if rec is not None and isinstance(rec.event, GpuObserved) else None
        from agents.commands import CommandService
        from agents.serving import ServingProxy

        self._service = CommandService(self)
        await self._service.start()
        if self.config.serving.enabled and not self.direct:
            self._serving = ServingProxy(self)
            await self._serving.start()
            self.serving_url = self._serving.url
        self._spawn_task(self._gpu_loop(), "gpus")
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
                await self._stop_training_slot(slot)
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
            with contextlib.suppress(Exception):
                await self._record(m, ModelStopped(at=now(), domain=self.domain, model=m.name,
                                                   detail="agent shutdown during the pull (the next start resumes it)"))
            return
        was_alive = m.runtime.alive()
        m.on_purpose = True
        await m.runtime.stop(RUNTIME_STOP_GRACE_S)
        self._drop_identity(m.name)
        if was_alive and m.state_tag in LIVE_STATES | {"lost"}:
            with contextlib.suppress(Exception):
                await self._record(m, ModelStopped(at=now(), domain=self.domain, model=m.name, detail="agent shutdown"))

    # ----------------------------------------------------------------------------- pid file sweep

    def _children_path(self) -> Path:
        return self.state_dir / "children.json"

    def _write_children(self) -> None:
        """The trainers' pid file (runtimes have identity files of their own: they outlive the agent)."""
        kids = []
        for t in self.trainers.values():
            if t.running() and t.pgid:
                kids.append({"pid": t.pgid, "start": _start_time(t.pgid), "what": f"training:{t.spec.slot}",
                             "grace_ms": t.grace_ms})
        with contextlib.suppress(OSError):
            tmp = self._children_path().with_suffix(".tmp")
            tmp.write_text(json.dumps(kids))
            os.replace(tmp, self._children_path())

    def _sweep_orphans(self) -> dict[str, str]:
        """Stop the trainers a previous agent on this host left running (their parent-death SIGTERM did not
        end them), with their grace: training is never left unsupervised. Returns slot -> how it ended.
        (A pid file from an agent before issue 14 also lists runtimes: they are stopped the same way.)"""
        swept: dict[str, str] = {}
        try:
            kids = json.loads(self._children_path().read_text())
        except (OSError, ValueError):
            return swept
        for kid in kids:
            pid = int(kid.get("pid", 0))
            start = kid.get("start")
            if pid > 1 and start and _start_time(pid) == start:
                grace = int(kid.get("grace_ms") or self.policy.training_grace_ms) / 1000
                ended = stop_group(pid, int(start), grace)
                what = str(kid.get("what", ""))
                if what.startswith("training:"):
                    swept[what.split(":", 1)[1]] = "killed" if ended == "killed" else "terminated"
                self.logger.warning("stopped a child the previous agent left", pid=pid, what=what, how=ended)
        return swept

    # ------------------------------------------------------------- runtimes that outlive the agent

    def _identity_dir(self) -> Path:
        return self.state_dir / "runtimes"

    def _identity_path(self, name: str) -> Path:
        return self._identity_dir() / f"{_file_token(name)}.json"

    def _write_identity(self, m: ModelSlot) -> None:
        """Record who the runtime is (pid, kernel start time, argv, port, model, plan), for the next agent."""
        identity = getattr(m.runtime, "identity", None)
        doc = identity() if identity is not None else None
        if doc is None:
            return
        with contextlib.suppress(OSError):
            self._identity_dir().mkdir(parents=True, exist_ok=True)
            path = self._identity_path(m.name)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, path)

    def _drop_identity(self, name: str) -> None:
        with contextlib.suppress(OSError):
            self._identity_path(name).unlink()

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
            verdict, why = runtime_on_start(doc, m.runtime if m else None, m.spec if m else None)
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
        if m is not None:
            if m.state_tag in LIVE_STATES | {"lost"}:
                await self._record(m, ModelStopped(at=now(), domain=self.domain, model=name, detail=why))
            return
        subject = subjects.model(self.fleet, self.domain, name)
        rec = await self.log.last(subject)
        if rec is None or rec.event is None:
            return
        with contextlib.suppress(IllegalTransition):
            if state_name(to_state(rec.event, rec.seq)) in LIVE_STATES | {"lost"}:
                await self._append(subject, ModelStopped(at=now(), domain=self.domain, model=name, detail=why), rec.seq)

    async def _adopt(self, m: ModelSlot) -> bool:
        """Take over the runtime `_find_runtimes` found: `model_adopted`, then watch it like one we loaded."""
        found = self.adoptable.pop(m.name)
        async with m.lock:
            m.generation += 1
            m.exited.clear()
            m.exit_code = None
            m.on_purpose = False
            level = getattr(m.state, "level", 1) or 1
            await self._record(m, ModelAdopted(at=now(), domain=self.domain, model=m.name, pid=found["pid"],
                                               endpoint=found["endpoint"], asleep=found["asleep"], level=level,
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
                except Exception as exc:  # the log went away for a while: keep what runs
                    self.logger.warning("declaration follower interrupted", error=str(exc))
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

    async def apply_declared(self, decl_seq: int, timeout_s: float) -> tuple[bool, str, str, dict]:
        """The `apply_layout` verb (a rolling change's apply steps): bring this host to the declarations
        (at least up to `decl_seq`) now rather than when the follower gets to them; on the standby, also
        replace the changes that waited while this domain was the active one; then wait, at most
        `timeout_s`, until every model has come to rest. Idempotent: run twice, it changes nothing the
        second time and waits the same way. Returns (ok, error code, detail, data)."""
        if self.slots.source != "declared":
            return (False, "layout_not_declared",
                    f"the agent of {self.domain} reads its slots from its {self.slots.source} file, not from `haru apply`'s "
                    f"declarations: change that file and restart the agent (its runtimes are adopted)", {})
        records = await self.log.history(subjects.decl(self.fleet))
        last = records[-1].seq if records else 0
        if last < decl_seq:
            return (False, "declarations_behind",
                    f"the decl subject ends at seq {last}, before seq {decl_seq} the operation rolls out", {})
        new = fold_declarations(self.fleet, self.domain, [r.event for r in records if r.event is not None])
        if new is None:
            return False, "domain_retired", f"domain {self.domain} is no longer declared in fleet {self.fleet}", {}
        # The diff is against what the runtimes run, so on the standby it replaces what waited too.
        done = await self.apply_slots(new)
        if self.pending:
            return (False, "domain_active",
                    f"{self.domain} is the active domain: its changes to {', '.join(sorted(self.pending))} wait until it is "
                    f"the standby", {"pending_layout": sorted(self.pending)})
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    waiting = [m for m in self.models.values() if not m.settled.is_set()]
                    if not waiting:
                        break
                    await asyncio.gather(*(m.settled.wait() for m in waiting))
        except TimeoutError:
            loading = sorted(m.name for m in self.models.values() if not m.settled.is_set())
            return (False, "timeout", f"still loading after {timeout_s:.0f} s (policy apply_timeout_ms): {', '.join(loading)}",
                    {"decl_seq": last})
        unready = {name: f"{m.state_tag}" + (f" ({getattr(m.state, 'detail', '') or getattr(m.state, 'reason', '')})"
                                              if m.state_tag in ("failed", "lost") else "")
                   for name, m in self.models.items() if m.state_tag not in ("resident", "sleeping", "waking")}
        data = {"decl_seq": last, **{k: v for k, v in done.items() if v},
                "models": {name: m.state_tag for name, m in self.models.items()}}
        if unready:
            return (False, "model_not_ready", "; ".join(f"{n} {s}" for n, s in sorted(unready.items())), data)
        changed = [f"{k} {', '.join(v)}" for k, v in done.items() if v and k != "pending"]
        return True, "", (("; ".join(changed) + "; ") if changed else "") + f"declarations up to seq {last} applied", data

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
            if (was_alive or m.runtime.kind == "external") and m.state_tag in LIVE_STATES | {"lost"}:
                await self._record(m, ModelStopped(at=now(), domain=self.domain, model=name, detail=why))
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

    async def _append(self, subject: str, event: Event, expect: int) -> int:
        """Append with the expected sequence. The truth is recorded late rather than never: while NATS is
        unreachable the append is retried (bounded only when the agent is stopping)."""
        tries = 0
        while True:
            tries += 1
            try:
                return await self._append_once(subject, event, expect)
            except LogUnavailable as exc:
                if self.stopping and tries >= 3:
                    raise
                self.logger.warning("event log unavailable; retrying the append", subject=subject, error=str(exc))
                await asyncio.sleep(min(0.5 * tries, 5.0))

    async def _append_once(self, subject: str, event: Event, expect: int) -> int:
        try:
            return await self.log.append(subject, event, expect=expect)
        except Conflict as exc:
            # Nobody else writes this domain's subjects (the claim made sure): a stale tip of our own.
            self.logger.error("subject moved under the agent; continuing from its tip", subject=subject,
                              expected=expect, current=exc.current)
            return await self.log.append(subject, event, expect=await self.log.last_seq_of(subject))

    async def _record(self, m: ModelSlot, event: Event) -> None:
        if isinstance(event, ModelLost) and event.reason == "gpu_detached" and not self._gpu_gone_seq(m):
            # Record the GPU's absence first, so the loss can cite the observation that showed it.
            with contextlib.suppress(Exception):
                await self.observe_gpu(m.spec.gpu_index)
        async with m.append_lock:
            event = causes.with_cause(event, causes.residency_cause(
                event, prev_tag=m.state_tag, prev_seq=m.seq, command=COMMAND_CAUSE.get(), gpu_gone=self._gpu_gone_seq(m),
                agent=self.agent_seq, stopping=self.stopping))
            key = event_key(event)
            if not is_legal(m.state_tag, key):
                self.logger.error("residency transition outside the table", model=m.name, state=m.state_tag, event=key)
            m.seq = await self._append(m.subject, event, m.seq)
            try:
                m.state = evolve(m.state, event, seq=m.seq, subject=m.subject)
            except IllegalTransition:
                m.state = to_state(event, m.seq)
        self.logger.info(key, model=m.name, **{k: v for k, v in msgspec.to_builtins(event).items()
                                                if k in ("reason", "detail", "attempt", "warmup_ms", "exit_code", "pid")})

    async def _append_training(self, slot: str, event: Event) -> None:
        subject = subjects.training(self.fleet, self.domain, slot)
        event = causes.with_cause(event, causes.training_cause(event, command=COMMAND_CAUSE.get(), agent=self.agent_seq,
                                                               stopping=self.stopping))
        self.training_seq[slot] = await self._append(subject, event, self.training_seq.get(slot, 0))

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
            except Exception as exc:  # the log went away for a while: keep the last known role
                self.logger.warning("route follower interrupted", error=str(exc))
                await asyncio.sleep(1.0)

    @property
    def role(self) -> str:
        if self.config.role != "auto":
            return self.config.role
        active = self.active_domain or self.slots.first_domain
        return "active" if active == self.domain else "standby"

    # ------------------------------------------------------------------------------------ heartbeat

    def heartbeat(self) -> Heartbeat:
        states = {name: m.state_tag for name, m in self.models.items()}
        running = [slot for slot, t in self.trainers.items() if t.running()]
        counts: dict[str, int] = {}
        for s in states.values():
            counts[s] = counts.get(s, 0) + 1
        summary = f"{self.role}; " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        if running:
            summary += f"; training {', '.join(running)}"
        return Heartbeat(fleet=self.fleet, domain=self.domain, at=now(), summary=summary, models=states,
                         training=running, pid=self.pid)

    async def _heartbeat_loop(self) -> None:
        subject = subjects.heartbeat(self.fleet, self.domain)
        encoder = msgspec.json.Encoder()
        while True:
            with contextlib.suppress(Exception):
                await self.log.nc.publish(subject, encoder.encode(self.heartbeat()))
            await asyncio.sleep(self.config.heartbeat_ms / 1000)

    # ----------------------------------------------------------------------------------------- GPUs

    def read_gpu(self, index: int) -> GpuReading:
        r = self.gpus.read(index)
        if r.present:
            self.gpu_seen.add(index)
        return r

    def gpu_went_away(self, index: int) -> bool:
        """The GPU was there (this agent saw it) and now is not: the provider took it."""
        return self.read_gpu(index).present is False and index in self.gpu_seen

    async def _gpu_loop(self) -> None:
        while True:
            for index in self.slots.gpu_indexes():
                with contextlib.suppress(Exception):
                    await self.observe_gpu(index)
            await asyncio.sleep(self.policy.probe_interval_ms / 1000)

    async def observe_gpu(self, index: int) -> GpuReading:
        async with self.gpu_lock:  # the GPU loop and verify_gpu both observe: one append per change
            return await self._observe_gpu(index)

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
        """(usage, foreign) for a reading: empty when it carries no per-process figures."""
        if not r.present or not r.accounted:
            return [], []
        return account(r.processes, self.owners(r.index), exclude=frozenset({self.pid}))

    async def _observe_gpu(self, index: int) -> GpuReading:
        r = self.read_gpu(index)
        last = self.gpu_last.get(index)
        usage, foreign = self.gpu_accounting(r)
        if last is None or _gpu_changed(last, r, usage, foreign):
            for u in usage:
                if u.over_plan and not any(x.name == u.name and x.over_plan for x in (last.usage if last else [])):
                    self.logger.warning("over_plan", gpu=index, owner=u.name, kind=u.kind, used_bytes=u.used_bytes,
                                        planned_bytes=u.planned_bytes, pids=u.pids)
            event = GpuObserved(at=now(), domain=self.domain, index=index, present=r.present, name=r.name,
                                memory_total_bytes=r.memory_total_bytes, memory_used_bytes=r.memory_used_bytes,
                                processes=list(r.processes), mig=r.mig, usage=usage, foreign=foreign,
                                accounted=r.accounted)
            self.gpu_seq[index] = await self._append(subjects.gpu(self.fleet, self.domain, index), event,
                                                     self.gpu_seq.get(index, 0))
            self.gpu_last[index] = event
            if last is not None and last.present and not r.present:
                # The provider took the GPU: say so for every model on it now, not at each one's next
                # probe, before a failover's demotion can ask one of them to sleep.
                for m in self.models.values():
                    if m.spec.gpu_index == index and m.runtime.kind != "external":
                        self._spawn_task(self.check(m), f"gpu-gone:{m.name}")
        return r

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
        log = self.logger.bind(model=m.name)
        adopted = m.name in self.adoptable
        if not adopted and m.state_tag in LIVE_STATES and m.runtime.kind != "external":
            # Its runtime is gone (it died while no agent watched, or an agent before issue 14 took it
            # along): the chain says so, once, before we reload.
            await self._record(m, ModelLost(at=now(), domain=self.domain, model=m.name, reason="process_exited",
                                            detail=self.away.pop(m.name, "the previous agent stopped without unloading it")))
        first = True
        while not self.stopping:
            if not first and await self._pause(self._backoff_s(m.failures)):
                return
            if await self._wait_for_gpu(m):
                return
            paused: list[str] = []
            standby = self.role == "standby"
            if standby and not first:
                answering = COMMAND_CAUSE.set(m.seq)  # the loss this restart answers: what the pause cites
                try:
                    paused = await self._make_room(m.spec.gpu_index)
                finally:
                    COMMAND_CAUSE.reset(answering)
            try:
                ready = await (self._adopt(m) if adopted else self._load(m))
                adopted = False
                if ready and self.role == "standby" and m.runtime.can_sleep:
                    async with m.lock:
                        if m.state_tag == "resident":
                            try:
                                await self._sleep_one(m, 1)
                            except RuntimeProblem as exc:
                                log.warning("could not put the standby runtime to sleep", error=str(exc))
            finally:
                if paused:
                    await self._resume_training(paused)
                if first:
                    m.settled.set()
                    first = False
            if ready:
                await self._watch(m)
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
        if needs_pull(m.runtime.spec.source, m.runtime.kind) and not await pull_for(self, m):
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
                await self._record(m, ModelLoading(at=now(), domain=self.domain, model=m.name,
                                                   endpoint=m.runtime.base_url, pid=0, attempt=m.attempt))
                await self._record(m, ModelFailed(at=now(), domain=self.domain, model=m.name, runtime_said=str(exc)))
                return False
            await self._record(m, ModelLoading(at=now(), domain=self.domain, model=m.name, endpoint=m.runtime.base_url,
                                               pid=m.runtime.pid or 0, attempt=m.attempt))
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
                    await self._record(m, ModelResident(at=now(), domain=self.domain, model=m.name,
                                                        endpoint=m.runtime.base_url, warmup_ms=warmup))
                    m.resident_at = time.monotonic()
                return True
            if m.runtime.kind != "external" and self.gpu_went_away(m.spec.gpu_index):
                async with m.lock:
                    await self._record(m, ModelLost(at=now(), domain=self.domain, model=m.name, reason="gpu_detached",
                                                    detail="the GPU went away while the model was loading"))
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
        if not m.on_purpose and not self.stopping and m.state_tag == "loading" and code is not None and code > 0:
            # It quit on its own before it ever answered: it refused the model (a corrupt or truncated
            # file, an unknown architecture). That is `failed`, in the runtime's own words; the
            # supervisor retries with the growing backoff, never in a tight loop.
            said = runtime_said(m.runtime.output_tail(8000), code)
            await self._record(m, ModelFailed(at=now(), domain=self.domain, model=m.name, runtime_said=said))
        elif not m.on_purpose and not self.stopping:
            tail = m.runtime.output_tail(600).strip().splitlines()
            detail = (f"the runtime exited with code {code}" if code is not None else
                      f"the adopted runtime (pid {m.runtime.pid}) exited; its exit status went to its reaper")
            if tail:
                detail += f"; last output: {tail[-1][:300]}"
            await self._record(m, ModelLost(at=now(), domain=self.domain, model=m.name, reason="process_exited",
                                            detail=detail, exit_code=code))
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
                    await self._lost(m, "gpu_detached", "the GPU went away while the runtime slept")
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
                    await self._record(m, ModelResident(at=now(), domain=self.domain, model=m.name,
                                                        endpoint=m.runtime.base_url, warmup_ms=probe.latency_ms))
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
            prior = m.state
            if not (state_name(prior) == "lost" and getattr(prior, "reason", "") == reason):
                await self._lost(m, reason, f"{probe.step}: {probe.detail}"[:500])
            return reason == "evicted"

    def _gpu_gone_seq(self, m: ModelSlot) -> int:
        """The recorded observation that the model's GPU is gone (0 = none)."""
        last = self.gpu_last.get(m.spec.gpu_index)
        return self.gpu_seq.get(m.spec.gpu_index, 0) if last is not None and last.present is False else 0

    async def _lost(self, m: ModelSlot, reason: str, detail: str) -> None:
        await self._record(m, ModelLost(at=now(), domain=self.domain, model=m.name, reason=reason, detail=detail))  # type: ignore[arg-type]
        if reason == "gpu_detached":
            # Record the GPU's absence now: that checks the other models on it (see _observe_gpu).
            self._spawn_task(self.observe_gpu(m.spec.gpu_index), f"gpu-check:{m.spec.gpu_index}")

    # ---------------------------------------------------------------------------- sleep and wake

    async def _sleep_one(self, m: ModelSlot, level: int) -> None:
        """Put a resident runtime to sleep (caller holds m.lock). Verified through /is_sleeping."""
        before = self.read_gpu(m.spec.gpu_index)
        await m.runtime.sleep(level, self.policy.wake_timeout_ms / 1000)
        after = self.read_gpu(m.spec.gpu_index)
        freed = max(0, before.memory_used_bytes - after.memory_used_bytes) if before.present and after.present else 0
        await self._record(m, ModelSleeping(at=now(), domain=self.domain, model=m.name, level=level, freed_bytes=freed))

    async def sleep_model(self, m: ModelSlot, level: int) -> tuple[bool, str, str]:
        """Idempotent sleep. Returns (ok, error code, detail)."""
        if not m.runtime.can_sleep:
            return True, "", f"a {m.runtime.kind} runtime has no sleep mode; it stays {m.state_tag}"
        async with m.lock:
            if self.gpu_went_away(m.spec.gpu_index):
                # A runtime may well answer /sleep on a GPU that is gone; its weights are not in VRAM to free.
                if m.state_tag != "lost":
                    await self._lost(m, "gpu_detached", "the GPU went away; asked to sleep")
                return False, "gpu_detached", f"GPU {m.spec.gpu_index} is gone (the provider took it): {m.name} is lost, not asleep"
            tag = m.state_tag
            if tag == "sleeping":
                try:
                    if await m.runtime.is_sleeping() is True:
                        return True, "", "already asleep"
                except RuntimeProblem as exc:
                    return False, exc.code, str(exc)
            elif tag not in ("resident", "waking"):
                return False, "not_resident", f"{m.name} is {tag}; only a resident model can be put to sleep"
            try:
                await self._sleep_one(m, level)
            except RuntimeProblem as exc:
                return False, exc.code, str(exc)
            return True, "", "asleep (verified by /is_sleeping)"

    async def wake_model(self, m: ModelSlot) -> tuple[bool, str, str, int]:
        """Idempotent wake, verified by /is_sleeping and a real one-token completion.

        Returns (ok, error code, detail, took_ms)."""
        started = time.monotonic()
        timeout = self.policy.probe_timeout_ms / 1000
        async with m.lock:
            tag = m.state_tag
            if tag == "resident" or not m.runtime.can_sleep:
                if tag != "resident":
                    return False, "not_resident", f"{m.name} is {tag}", 0
                probe = await probes.ready(m.runtime, timeout_s=timeout)
                if probe.ok:
                    return True, "", "already awake; probe answered", int((time.monotonic() - started) * 1000)
                return False, "probe_failed", f"awake but the probe failed at {probe.step}: {probe.detail}", 0
            if tag not in ("sleeping", "waking"):
                return False, "not_sleeping", f"{m.name} is {tag}; there is nothing to wake", 0
            if tag == "sleeping":
                await self._record(m, ModelWaking(at=now(), domain=self.domain, model=m.name))
            gen = m.generation
            try:
                await m.runtime.wake(self.policy.wake_timeout_ms / 1000)
            except OutOfMemory as exc:
                await self._after_failed_wake(m, gen)
                return False, "out_of_memory", str(exc), int((time.monotonic() - started) * 1000)
            except RuntimeProblem as exc:
                await self._after_failed_wake(m, gen)
                return False, exc.code, str(exc), int((time.monotonic() - started) * 1000)
            probe = await probes.ready(m.runtime, timeout_s=timeout)
            took = int((time.monotonic() - started) * 1000)
            if gen != m.generation or m.exited.is_set():
                return False, "process_exited", f"{m.name}'s runtime exited while waking", took
            if not probe.ok:
                code = "out_of_memory" if "out of memory" in probe.detail.lower() else "probe_failed"
                await self._after_failed_wake(m, gen, probe=probe)
                return False, code, f"woke but the probe failed at {probe.step}: {probe.detail}", took
            m.last_probe = probe
            await self._record(m, ModelResident(at=now(), domain=self.domain, model=m.name, endpoint=m.runtime.base_url,
                                                warmup_ms=took))
            m.resident_at = time.monotonic()
            return True, "", f"awake (verified by /is_sleeping and a probe in {probe.latency_ms} ms)", took

    async def _after_failed_wake(self, m: ModelSlot, gen: int, probe: probes.Probe | None = None) -> None:
        """Record the truth after a wake failed: still asleep, or lost (and why)."""
        if gen != m.generation or m.exited.is_set() or m.state_tag != "waking":
            return
        try:
            asleep = await m.runtime.is_sleeping()
        except RuntimeProblem:
            asleep = None
        if asleep is True:
            await self._record(m, ModelSleeping(at=now(), domain=self.domain, model=m.name, level=1))
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

    async def start_training_slot(self, slot: str, *, force: bool = False) -> tuple[bool, str, str]:
        t = self.trainers[slot]
        async with self.training_lock:
            if t.running():
                return True, "", f"already running (pid {t.pid})"
            if self.role == "active" and not force:
                await self._read_route()  # the pointer may have just moved (a settle right after a flip)
            if self.role == "active" and not force:
                return False, "domain_active", (f"domain {self.domain!r} is the active domain (route revision "
                                                f"{self.route_revision}); training runs only on a standby")
            busy = self.gpu_busy_with_inference(t.spec)
            if busy and not force:
                return False, "gpu_busy", (f"GPU {t.spec.gpu_index} holds awake models ({', '.join(busy)}); put them to "
                                           f"sleep first (training runs only in VRAM the sleeping runtimes freed)")
            try:
                pid = await t.start()
            except TrainingProblem as exc:
                return False, exc.code, str(exc)
            await self._append_training(slot, TrainingStarted(at=now(), domain=self.domain, slot=slot, pid=pid,
                                                              gpu_index=t.spec.gpu_index))
            self._write_children()
        self.logger.info("training_started", slot=slot, pid=pid)
        return True, "", f"started (pid {pid})"

    async def _stop_training_slot(self, slot: str) -> Ended | None:
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
                await self._stop_training_slot(slot)
                stopped.append(slot)
        return stopped

    async def _resume_training(self, slots: list[str]) -> None:
        if self.role != "standby":
            return
        for slot in slots:
            ok, code, detail = await self.start_training_slot(slot)
            if not ok:
                self.logger.warning("could not resume training", slot=slot, code=code, detail=detail)

    async def refresh_route(self, revision: int) -> None:
        """A command decided against a newer route than we have seen: read the pointer now."""
        if revision > self.route_revision:
            await self._read_route()

    async def _initial_training(self) -> None:
        await asyncio.gather(*(m.settled.wait() for m in self.models.values()))
        if not self.config.auto_training or self.role != "standby" or self.stopping:
            return
        for slot in self.trainers:
            ok, code, detail = await self.start_training_slot(slot)
            if not ok:
                self.logger.warning("standby training not started", slot=slot, code=code, detail=detail)

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

    def verify_gpu_data(self, models: list[ModelSlot]) -> tuple[bool, ErrorInfo | None, dict]:
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
                alive = sorted(p for p in trainer_pids if _pid_alive(p))
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
            return False, ErrorInfo(code=problems[0][0], message="; ".join(p[1] for p in problems)), data
        return True, None, data


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


def _gpu_changed(last: GpuObserved, r: GpuReading, usage: list | None = None, foreign: list | None = None) -> bool:
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


def runtime_on_start(doc: dict | None, runtime, spec: ModelSpec | None) -> tuple[str, str]:
    """What a starting agent does with the runtime an identity file names: ("adopt" | "replace" | "stop" |
    "start", why). `runtime` is the model's Runtime under the current layout (None: the layout dropped
    it). Whether the adopted process answers is checked at start, not here."""
    if doc is None:
        return "start", "no runtime of a previous agent"
    pid, start, port = int(doc.get("pid", 0)), doc.get("start"), int(doc.get("port", 0))
    if not proc_alive(pid, start):
        reused = _start_time(pid) not in ("", str(start))
        return "start", (f"the runtime (pid {pid}) exited while no agent was watching it"
                         + ("; its pid now belongs to an unrelated process, left alone" if reused else ""))
    if runtime is None or spec is None:
        return "stop", "the layout no longer has this model"
    planned = getattr(runtime, "planned_argv", lambda _p: None)(port)
    if runtime.kind != doc.get("runtime") or planned != doc.get("argv") or (spec.port and spec.port != port):
        return "replace", f"the layout changed this model (pid {pid} runs another command line)"
    return "adopt", f"pid {pid} still runs the planned command line on port {port}"


def read_identities(state_dir: Path) -> dict[str, tuple[Path, dict | None]]:
    """model -> (identity file, its document or None if unreadable)."""
    out: dict[str, tuple[Path, dict | None]] = {}
    try:
        files = sorted((state_dir / "runtimes").glob("*.json"))
    except OSError:
        return out
    for path in files:
        try:
            doc = json.loads(path.read_text())
            int(doc["pid"]), int(doc["start"]), int(doc["port"])
            out[str(doc["model"])] = (path, doc)
        except (OSError, ValueError, KeyError, TypeError):
            out[f"?{path.name}"] = (path, None)
    return out


def _file_token(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:100]


def _pid_alive(pid: int) -> bool:
    """The OS still has the process (a zombie counts as gone: its memory is released)."""
    st = procfs.stat(pid)
    return st is not None and not st.zombie


def _start_time(pid: int) -> str:
    """The process's start time as identity files record it ('' when it is gone)."""
    st = procfs.stat(pid)
    return str(st.start) if st is not None else ""


def reply(ok: bool, detail: str = "", *, took_ms: int = 0, error: ErrorInfo | None = None, data: dict | None = None) -> Reply:
    return Reply(ok=ok, detail=detail, took_ms=took_ms, error=error, data=data or {})
