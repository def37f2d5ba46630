"""One model's supervisor: loads (or adopts) its runtime, watches it, restarts it with backoff, and
puts it to sleep and wakes it when a command asks. One `ModelSupervisor` per admitted model.

    loading   spawn, wait for its port to listen, then poll /health, /v1/models and a one-token completion
              until it answers (never times out: Loading reports progress instead); an exit is waited on, not polled
    watching  a probe every probe interval, classified with the GPU-present bit (gpu_detached,
              evicted, unhealthy); an evicted runtime is restarted
    restarts  exponential backoff (`backoff_s`); on a standby, the training on that GPU is paused for
              the reload and resumed after, and the reloaded runtime is put back to sleep

What it writes, it writes as observations through `ctx.record` (agents/recorder.py -> the decision
table in agents/observe.py). State-changing work on the model is serialized by `m.lock`. It reaches
the rest of the agent only through `SupervisorContext`: the recorder, the GPU watcher, the runtime
files, the role and policy as they are now, and two training callables.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from haru.agents import probes
from haru.agents.adoption import Adoptable
from haru.agents.cause import COMMAND_CAUSE
from haru.agents.errors import RuntimeProblem
from haru.agents.gpu import GpuReading
from haru.agents.gpu_watch import GpuWatcher
from haru.agents.load_queue import LoadQueue
from haru.agents.loops import LoopErrors, survive
from haru.agents.model_slot import RUNTIME_STOP_GRACE_S, ModelSlot
from haru.agents.observe import (
    Adopted,
    Answered,
    Exited,
    GpuGone,
    Observation,
    ProbeFailed,
    Queued,
    Spawned,
    SpawnRefused,
    Vanished,
)
from haru.agents.ports import Outcome
from haru.agents.pulling import needs_pull, pull_for
from haru.agents.runtime_files import RuntimeFiles
from haru.agents.runtime_said import runtime_said
from haru.agents.sleep_wake import SleepWake
from haru.agents.wake_check import WakeCheck
from haru.core.events import Event
from haru.core.restarts import Backoff
from haru.core.specs import Policy, model_gpus

__all__ = ["ModelSupervisor", "SupervisorContext", "RoleNow", "backoff_s"]

# While a model loads, its /health is asked this often (one loopback GET; a 503 or a refused
# connection costs well under a millisecond), so `resident` is recorded within ~this of the runtime
# turning ready. bench/runtime.py measures it against a real llama-server.
LOADING_POLL_S = 0.02
LISTEN_POLL_S = 0.005  # a loading runtime whose port refuses connections: a bare connect this often


def backoff_s(policy: Policy, failures: int) -> float:
    """The pause before restart attempt `failures` (1, 2, ...): doubling from restart_backoff_ms, capped."""
    return Backoff(policy.restart_backoff_ms / 1000, policy.restart_backoff_max_ms / 1000).delay(failures)


class RoleNow(Protocol):
    @property
    def now(self) -> str:
        """`active` or `standby`, as the domain's role is now."""
        ...


@dataclass(frozen=True)
class SupervisorContext:
    """What a model's supervisor may use of the agent around it."""

    domain: str
    record: Callable[[ModelSlot, Observation], Awaitable[Event | None]]
    about: Callable[[ModelSlot], dict[str, Any]]
    gpu: GpuWatcher
    files: RuntimeFiles
    role: RoleNow
    policy: Callable[[], Policy]
    stopping: Callable[[], bool]
    stop_event: asyncio.Event
    spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]]
    make_room: Callable[[int], Awaitable[list[str]]]  # stop the training on a GPU; the slots stopped
    resume_training: Callable[[list[str]], Awaitable[None]]
    errors: LoopErrors
    logger: Any
    # One cold load at a time per GPU, in declaration order (agents/load_queue.py): the agent's, shared.
    loads: LoadQueue = field(default_factory=LoadQueue)
    # Adapters loaded at run time (agents/adapters.py): load what the runtime should hold and does not (a
    # level-2 sleep drops them); returns the runtime names it holds. None: this host loads none.
    restore_adapters: Callable[[ModelSlot], Awaitable[list[str]]] | None = None


class ModelSupervisor:
    def __init__(self, m: ModelSlot, ctx: SupervisorContext, *, found: Adoptable | None = None, away: str = "") -> None:
        """`found`: the live runtime a previous agent left (pid, asleep, endpoint),
        to adopt; `away`: what is
        known of one that died while no agent watched (said once in `lost` before the reload)."""
        self.m = m
        self.ctx = ctx
        self.found = found
        self.away = away
        self.logger = ctx.logger.bind(model=m.name)
        self._rechecking = False
        self.gpus = model_gpus(m.spec)  # a tensor-parallel model's every GPU
        if m.runtime.kind != "external":
            ctx.loads.enroll(m.name, self.gpus)
        # the greedy answers recorded before the runtime last slept: a wake must give the same ones (kept in
        # its identity file, so an agent that adopts it asleep checks its wake too)
        self.verbs = SleepWake(self)  # what a command asks of this model: sleep, wake, probe
        self.wake_check = WakeCheck(
            found.wake_answers if found is not None else None,
            keep=lambda answers: ctx.files.write_wake_answers(m.name, answers),
        )

    def recheck(self) -> None:
        """Probe now (the serving port saw the runtime fail a request), once at a time."""
        if self._rechecking or self.ctx.stopping():
            return
        self._rechecking = True

        async def run() -> None:
            try:
                await self.check()  # records the loss; restarting an evicted one is the periodic probe's job
            finally:
                self._rechecking = False

        self.ctx.spawn(run(), f"recheck:{self.m.name}")

    def read_gpu(self) -> GpuReading:
        """The model's GPU as it reads now; for a model across GPUs, the first one that is absent (a detach
        of any of them is the model's `gpu_detached`), else the first."""
        readings = [self.ctx.gpu.read(i) for i in self.gpus]
        return next((r for r in readings if r.present is False), readings[0])

    def gpu_went_away(self) -> bool:
        return any(self.ctx.gpu.went_away(i) for i in self.gpus)

    async def _pause(self, seconds: float) -> bool:
        """Sleep unless the agent stops first; True if it is stopping."""
        if self.ctx.stopping():
            return True
        try:
            async with asyncio.timeout(seconds):
                await self.ctx.stop_event.wait()
            return True
        except TimeoutError:
            return self.ctx.stopping()

    async def run(self) -> None:
        """Load (or adopt) the model, watch it, and restart it with backoff, until the agent stops. An
        attempt that raises (a bug) is logged with its traceback and counted (`errors["supervise"]`);
        what it started is stopped, and the next attempt comes after the backoff."""
        try:
            await self._run()
        finally:
            self.ctx.loads.withdraw(self.m.name)  # retired or stopping: it holds no GPU's turn

    async def _run(self) -> None:
        m = self.m
        adopted = self.found is not None
        if not adopted and m.runtime.kind != "external":
            # Its runtime is gone (it died while no agent watched, or an agent before issue 14 took it
            # along): if the chain says live, it says so, once, before we reload.
            why = self.away or "the previous agent stopped without unloading it"
            self.away = ""
            await survive(
                lambda: self.ctx.record(m, Vanished(**self.ctx.about(m), detail=why)),
                name="supervise",
                errors=self.ctx.errors,
                logger=self.logger,
                model=m.name,
            )
            if m.state_tag == "lost":  # it was live, and is lost: the load that follows is a restart (attempt 2),
                m.attempt = max(m.attempt, 1)  # which the promoter's faster path and the gateway's hold count
        first = True
        while not self.ctx.stopping():
            if not first and await self._pause(backoff_s(self.ctx.policy(), m.failures)):
                return
            try:
                if await self._attempt(first=first, adopted=adopted):
                    return
            except asyncio.CancelledError:
                raise
            except Exception:
                n = self.ctx.errors.count("supervise")
                self.logger.exception("supervision attempt failed; retrying after the backoff", errors=n)
                m.settled.set()
                if m.runtime.kind != "external" and m.runtime.alive():
                    m.on_purpose = True
                    await m.runtime.stop(RUNTIME_STOP_GRACE_S)
            adopted = first = False
            if self.ctx.stopping():
                return
            # Consecutive failures double the backoff; a runtime that stayed up for a while starts afresh.
            if m.resident_at and time.monotonic() - m.resident_at >= self.ctx.policy().restart_backoff_max_ms / 1000:
                m.failures = 1
            else:
                m.failures += 1
            m.resident_at = 0.0
            if m.runtime.kind == "external":
                m.failures = max(m.failures, 1)

    async def _attempt(self, *, first: bool, adopted: bool) -> bool:
        """One load (or adoption) of `m`, watched until its runtime is gone. True if the agent stops."""
        m = self.m
        if await self._wait_for_gpu():
            return True
        paused: list[str] = []
        if self.ctx.role.now == "standby" and not first:
            answering = COMMAND_CAUSE.set(m.seq)  # the loss this restart answers: what the pause cites
            try:
                for index in self.gpus:  # a model across GPUs: the training on each of them
                    paused += await self.ctx.make_room(index)
            finally:
                COMMAND_CAUSE.reset(answering)
        if adopted:
            self.ctx.loads.release(m.name)  # nothing to load: it stands aside for those declared after it
        try:
            # The GPU's turn (taken in _load) covers the standby's sleep after the load: a sleep frees
            # memory, which a neighbour's start-up profiling must not see either.
            ready = await (self._adopt() if adopted else self._load())
            if ready and self.ctx.role.now == "standby" and m.runtime.can_sleep:
                async with m.lock:
                    if m.state_tag == "resident":
                        try:
                            await self.verbs.sleep_one(1)
                        except RuntimeProblem as exc:
                            self.logger.warning(
                                "could not put the standby runtime to sleep", model=m.name, error=str(exc)
                            )
        finally:
            if paused:
                await self.ctx.resume_training(paused)
            self.ctx.loads.release(m.name)
            if first:
                m.settled.set()
        if ready:
            await self._watch()
        return False

    async def _wait_for_gpu(self) -> bool:
        """A detached GPU cannot load anything: wait for it to come back. True if the agent stops."""
        m = self.m
        if m.runtime.kind == "external":
            return False
        while self.gpu_went_away():
            m.settled.set()
            self.ctx.loads.release(m.name)  # it cannot load: it holds back nobody declared after it
            if await self._pause(self.ctx.policy().probe_interval_ms / 1000):
                return True
        return False

    async def _load(self) -> bool:
        """Spawn (or re-attach to) the runtime and wait until it is resident or gone. Never times out."""
        m = self.m
        if needs_pull(m.runtime.spec.source, m.runtime.kind):
            self.ctx.loads.release(m.name)  # a pull takes no GPU: those declared after it load meanwhile
            if not await pull_for(m, self.ctx.record, self.ctx.about):
                return False  # a layout's reference: pulled first (`pulling`), or failed in the registry's words
        if m.runtime.kind != "external":
            await self.ctx.loads.acquire(m.name, on_wait=self._queued)
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
                await self.ctx.record(
                    m, Spawned(**self.ctx.about(m), endpoint=m.runtime.base_url, pid=0, attempt=m.attempt)
                )
                await self.ctx.record(m, SpawnRefused(**self.ctx.about(m), said=str(exc)))
                return False
            await self.ctx.record(
                m,
                Spawned(
                    **self.ctx.about(m),
                    endpoint=m.runtime.base_url,
                    pid=m.runtime.pid or 0,
                    attempt=m.attempt,
                    sleep_mode=getattr(m.runtime, "sleep_mode", ""),
                ),
            )
            self.ctx.files.write_identity(m.name, m.runtime)
            if m.runtime.kind != "external":
                self.ctx.spawn(self._exit_waiter(m.generation), f"exit:{m.name}:{m.generation}")
        timeout = self.ctx.policy().probe_timeout_ms / 1000
        polls = 0
        while not self.ctx.stopping():
            if m.exited.is_set():
                return False
            # Until its port takes connections, a bare connect every LISTEN_POLL_S; then the HTTP probe
            # every LOADING_POLL_S (docs/agent.md, "A real llama-server": where the time from /health 200 goes).
            poll = LOADING_POLL_S
            listening = await m.runtime.listening()
            probe = await probes.ready(m.runtime, timeout_s=timeout, check_sleep=False) if listening else None
            polls += 1
            if probe is not None and probe.ok:
                async with m.lock:
                    if m.exited.is_set() or m.state_tag != "loading":
                        return False
                    m.last_probe = probe
                    warmup = int((time.monotonic() - started) * 1000)
                    answered = time.perf_counter()
                    await self.ctx.record(
                        m,
                        Answered(
                            **self.ctx.about(m),
                            endpoint=m.runtime.base_url,
                            sleeps=m.runtime.can_sleep,
                            warmup_ms=warmup,
                        ),
                    )
                    m.resident_at = time.monotonic()
                self.logger.info(
                    "first probe answered",
                    polls=polls,
                    health_ms=probe.health_ms,
                    models_ms=probe.models_ms,
                    completion_ms=probe.completion_ms,
                    record_ms=round((time.perf_counter() - answered) * 1000, 1),
                )
                return True
            if not listening:
                poll = LISTEN_POLL_S
            # the GPU is read no more often than before the bare connects (every LOADING_POLL_S)
            if m.runtime.kind != "external" and (listening or polls % 4 == 0) and self.gpu_went_away():
                async with m.lock:
                    await self.ctx.record(
                        m, GpuGone(**self.ctx.about(m), detail="the GPU went away while the model was loading")
                    )
                    m.on_purpose = True
                    await m.runtime.stop(RUNTIME_STOP_GRACE_S)
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                async with asyncio.timeout(poll):
                    await m.exited.wait()
        return False

    async def _queued(self, waiting_for: str) -> None:
        """It must wait for its GPU's turn: `loading`, with what it waits for (not stuck, queued)."""
        m = self.m
        self.logger.info("waiting for the GPU's turn to load", waiting_for=waiting_for)
        async with m.lock:
            await self.ctx.record(m, Queued(**self.ctx.about(m), waiting_for=waiting_for, attempt=m.attempt + 1))

    async def _exit_waiter(self, generation: int) -> None:
        m = self.m
        code = await m.runtime.wait_exit()
        if generation != m.generation:
            return
        m.exit_code = code
        try:
            if m.on_purpose or self.ctx.stopping():
                await self.ctx.record(m, Exited(**self.ctx.about(m), code=code, expected=True))
            else:
                # A nonzero exit before it ever answered is the runtime refusing the model (a corrupt or
                # truncated file, an unknown architecture): `failed`, in its own words (the table decides);
                # the supervisor retries with the growing backoff, never in a tight loop.
                output = m.runtime.output_tail(65536)  # vLLM's refusal is a long traceback
                said = runtime_said(output, code) if code is not None and code > 0 else ""
                learned = m.runtime.learn_from_exit(output)  # e.g. a vLLM refusing sleep mode: next launch without
                if learned:
                    said = f"{said} ({learned})"
                tail = m.runtime.output_tail(600).strip().splitlines()
                detail = (
                    f"the runtime exited with code {code}"
                    if code is not None
                    else f"the adopted runtime (pid {m.runtime.pid}) exited; its exit status went to its reaper"
                )
                if tail:
                    detail += f"; last output: {tail[-1][:300]}"
                await self.ctx.record(m, Exited(**self.ctx.about(m), code=code, said=said, detail=detail))
        finally:
            self.ctx.files.drop_identity(m.name)  # it is gone: nothing to adopt
            m.exited.set()

    async def _watch(self) -> None:
        """Probe a loaded runtime every probe interval until its process is gone (or must be restarted)."""
        m = self.m
        interval = self.ctx.policy().probe_interval_ms / 1000
        while not self.ctx.stopping():
            with contextlib.suppress(asyncio.TimeoutError):
                async with asyncio.timeout(interval):
                    await m.exited.wait()
            if m.exited.is_set() or self.ctx.stopping():
                return
            if m.lock.locked():
                continue  # a command is changing it: probe next time
            try:
                restart = await self.check()
            except Exception:  # a bug in one probe must not restart a runtime that serves: probe again next time
                n = self.ctx.errors.count("supervise")
                self.logger.exception("a probe of the runtime failed; watching on", errors=n)
                continue
            if restart:
                async with m.lock:
                    m.on_purpose = True
                    await m.runtime.stop(RUNTIME_STOP_GRACE_S)
                    m.exited.set()
                return

    async def check(self) -> bool:
        """One periodic probe of a model, recording what changed. True = the runtime must be restarted."""
        m = self.m
        async with m.lock:
            if m.exited.is_set():
                return False
            timeout = self.ctx.policy().probe_timeout_ms / 1000
            tag = m.state_tag
            gpu = self.read_gpu() if m.runtime.kind != "external" else None
            if tag == "sleeping":
                if gpu is not None and gpu.present is False:
                    await self.gpu_gone("the GPU went away while the runtime slept")
                    return False
                health = await m.runtime.health(timeout_s=min(timeout, 5.0))
                if not health.ok:
                    alive = self.m.process_alive()
                    if not alive or m.exited.is_set():
                        return False  # the exit waiter records process_exited, with the exit status
                    reason = probes.diagnose(process_alive=alive, gpu=gpu, runtime_holds_model=True)
                    await self.lost(reason, health.detail or f"/health answered {health.status} while asleep")
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
            if tag == "lost" and getattr(m.state, "reason", "") == "gpu_detached":
                return await self._gpu_back()
            started = time.monotonic()
            probe = await probes.ready(m.runtime, timeout_s=timeout)
            m.last_probe = probe
            m.probe_ms = int((time.monotonic() - started) * 1000)
            if probe.ok:
                if tag != "resident" or m.state_tag != "resident":
                    await self.ctx.record(
                        m,
                        Answered(
                            **self.ctx.about(m),
                            endpoint=m.runtime.base_url,
                            sleeps=m.runtime.can_sleep,
                            warmup_ms=probe.latency_ms,
                        ),
                    )
                    m.resident_at = time.monotonic()
                return False
            if m.exited.is_set():
                return False
            if tag == "lost" and probe.step == "sleeping":
                # A lost runtime found healthy but asleep (its GPU came back while it slept): the table has
                # no lost -> sleeping, so it is reloaded (lost -> loading), and a standby puts it back to sleep.
                return True
            alive = self.m.process_alive()
            holds = await probes.holds_model(m.runtime, min(timeout, 5.0)) if probe.step != "listed" else False
            if m.runtime.kind != "external":
                # read again: a GPU that fell off the bus during the probe is why it failed, and the reading
                # taken before the probe would blame the runtime (`unhealthy`) for the provider's doing
                gpu = self.read_gpu()
            reason = probes.diagnose(process_alive=alive, gpu=gpu, runtime_holds_model=holds)
            if not alive:
                return False  # the exit waiter records process_exited
            await self.lost(reason, f"{probe.step}: {probe.detail}"[:500])  # the table: no news if already so
            return reason == "evicted"

    async def _gpu_back(self) -> bool:
        """A model lost with its GPU (gpu_detached): while the GPU is gone there is nothing to probe. Once it
        reads present again, it is proven, not assumed: the GPU's return is recorded first (gpu_observed
        present: true), then the runtime is restarted (True), since a runtime whose GPU fell off the bus
        kept no usable CUDA context; `resident` comes only from the reload's real completion. Caller holds
        m.lock."""
        readings = [self.ctx.gpu.read(i) for i in self.gpus]
        if any(r.present is False for r in readings):
            return False
        for i in self.gpus:
            await self.ctx.gpu.observe(i)  # recorded before the reload: the log says the GPU came back first
        self.logger.info("the GPU came back: reloading the model lost with it", gpus=self.gpus)
        return True

    async def lost(self, reason: str, detail: str) -> None:
        """A probe's diagnosis: `lost{reason}`, unless the loss is recorded for that reason already (a
        loss for another reason is refined: unhealthy, then gpu_detached)."""
        m = self.m
        recorded = await self.ctx.record(m, ProbeFailed(**self.ctx.about(m), reason=reason, detail=detail))  # type: ignore[arg-type]
        if recorded is not None and reason == "gpu_detached":
            self._check_the_gpu()

    async def gpu_gone(self, detail: str) -> None:
        """The GPU is gone: a live model is lost{gpu_detached}; one already lost (for any reason) stays so."""
        m = self.m
        if await self.ctx.record(m, GpuGone(**self.ctx.about(m), detail=detail)) is not None:
            self._check_the_gpu()

    def _check_the_gpu(self) -> None:
        """Record the GPU's absence now: that checks the other models on it (GpuWatcher's on_gone)."""
        index = self.read_gpu().index
        self.ctx.spawn(self.ctx.gpu.observe(index), f"gpu-check:{index}")

    # The commands' verbs (agents/sleep_wake.py): sleep, wake and probe this model.

    async def sleep(self, level: int) -> Outcome:
        """Idempotent sleep."""
        return await self.verbs.sleep(level)

    async def wake(self) -> Outcome:
        """Idempotent wake, verified by /is_sleeping and a real one-token completion (`took_ms`)."""
        return await self.verbs.wake()

    async def probe(self) -> Outcome:
        """A real one-token completion of a resident model (`latency_ms`); a failed one is news."""
        return await self.verbs.probe()

    async def _adopt(self) -> bool:
        """Take over the runtime `_find_runtimes` found: `model_adopted`, then watch it like one we loaded."""
        m = self.m
        found, self.found = self.found, None
        assert found is not None
        async with m.lock:
            m.generation += 1
            m.exited.clear()
            m.exit_code = None
            m.on_purpose = False
            if not found.asleep and self.wake_check.armed:
                # Woken by an agent that died before it checked the wake: checked now, before it may serve.
                changed = await self.wake_check.changed(m.runtime, self.ctx.policy().probe_timeout_ms / 1000)
                if changed:
                    self.logger.warning(
                        "a runtime woken by the previous agent answers otherwise than before its "
                        "sleep; not adopted, reloaded",
                        changed=changed,
                    )
                    await self.verbs.wrong_after_wake(m.generation, changed)
                    return True  # stopped and `exited`: the supervisor reloads it
            level = getattr(m.state, "level", 1) or 1
            await self.ctx.record(
                m,
                Adopted(
                    **self.ctx.about(m),
                    pid=found.pid,
                    endpoint=found.endpoint,
                    asleep=found.asleep,
                    level=level,
                    sleeps=m.runtime.can_sleep,
                    detail="kept serving through the agent's restart",
                ),
            )
            self.ctx.spawn(self._exit_waiter(m.generation), f"exit:{m.name}:{m.generation}")
            if not found.asleep:
                m.resident_at = time.monotonic()
        return True
