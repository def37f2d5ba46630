"""Many simulated GPU hosts in one process, speaking the agents' real protocol: the load for scale runs.

    async with SimHosts(log, fleets=100) as hosts:      # 100 fleets x 2 domains x 3 models
        await hosts.apply()                              # `haru apply` of every fleet's layout
        await hosts.start()                              # every host claims its domain and loads
        await hosts.detach_gpu("f007", "a")              # faults, as `haru sim` injects them
        ...

A real agent is a process with runtimes as children (agents/agent.py); a hundred fleets of two hosts
would be two hundred agents and six hundred runtimes, which no 2-core machine runs. A `SimHost` stands in
for one agent with the agent's own parts wherever they do not need a GPU or a runtime process:

- events: `agents.recorder.Recorder` (the observation table `agents.observe.observe`, causes, the
  model's recorded state moved by the fleet's table) appending through `agents.appender.Appender`, so
  every residency event carries the subject's expected sequence, as an agent's does; `agent_started`
  and `gpu_observed` are appended with their subjects' expected sequences too;
- heartbeats: `agents.heartbeat.Heartbeats` / `heartbeat_of` on `haru.hb.<fleet>.<domain>`, every
  `heartbeat_ms`;
- commands: `agents.commands.CommandService` (the `nats.micro` service `haru-agent`, one endpoint per
  verb, `$SRV.PING` finds it), answering with the host as its `CommandTarget`: sleep, wake and probe
  take `sleep_ms`/`wake_ms`/`probe_ms` and record `slept`/`wake_begun`/`answered` like the real
  supervisor; verify_gpu says whether the simulated GPU is present;
- serving: one loopback port per host (its domain's serving URL) answering `/v1/chat/completions`
  and `/v1/models` in OpenAI's shape, with the answering fleet/domain in `system_fingerprint`.

What is simulated is only what lies below the agent: the runtime (a model "loads" in `load_ms` and
answers), the GPU (present or detached), and training (no training slots are declared). The faults
are `bench/growth.py`'s: detach/attach the GPU, kill a runtime, kill the agent (silence, then a
restart that adopts its runtimes).

All hosts share the `EventLog`'s NATS connection (one per process, as one agent has one).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

import msgspec
import structlog
from aiohttp import web

from haru.agents.appender import Appender
from haru.agents.commands import CommandService
from haru.agents.heartbeat import Heartbeats, heartbeat_of
from haru.agents.loops import LoopErrors
from haru.agents.model_slot import ModelSlot
from haru.agents.observe import Adopted, Answered, Exited, GpuGone, Observation, Slept, Spawned, WakeBegun
from haru.agents.ports import Applied, GpuVerdict, Identity, Outcome, Selection
from haru.agents.recorder import Recorder
from haru.agents.training import Ended
from haru.core import subjects
from haru.core.commands import Command, ErrorInfo, Heartbeat
from haru.core.errors import LogUnavailable
from haru.core.events import AgentStarted, Event, GpuObserved
from haru.core.layout import parse_layout
from haru.core.residency import Resident, Sleeping, Waking, state_name
from haru.core.sizes import GiB
from haru.core.specs import ModelSpec, Policy
from haru.host.tasks import cancel_and_wait
from haru.log.apply import apply as apply_layout
from haru.log.seam import Log

__all__ = ["SimHost", "SimHosts", "fleet_layout", "fleet_name"]

DOMAINS = ("a", "b")
MODELS = ("chat-8b", "code-7b", "embed-1b")


def fleet_name(i: int) -> str:
    return f"f{i:03d}"


def fleet_layout(fleet: str, ports: Mapping[str, int], *, heartbeat_timeout_ms: int) -> dict[str, Any]:
    """A `haru apply` layout: two domains of one 80 GiB GPU, three vLLM models each (no training slot)."""
    domains = []
    for d in DOMAINS:
        models = [
            {
                "name": m,
                "runtime": "vllm",
                "vram": "8GiB",
                "source": f"sim/{m}",
                "binary": ["python", "-m", "haru.agents.sim.vllm"],
            }
            for m in MODELS
        ]  # never launched here: the simulator form, which the layout accepts
        domains.append(
            {
                "name": d,
                "serving_url": f"http://127.0.0.1:{ports[d]}",
                "gpus": [{"index": 0, "memory": "80GiB", "reserve": "2GiB"}],
                "slots": [{"name": "chat", "gpu": 0, "models": models}],
            }
        )
    return {
        "fleet": fleet,
        "domains": domains,
        "policy": {
            "heartbeat_timeout_ms": heartbeat_timeout_ms,
            "degraded_grace_ms": 60_000,
            "restart_backoff_ms": 200,
            "probe_interval_ms": 5_000,
        },
    }


class _NoRuntime:
    """What a `ModelSlot` holds in place of a runtime process (nothing reads it here)."""


class _SimGpu:
    """The simulated GPU 0 of a host: present or detached, observed as `gpu_observed` on change."""

    def __init__(self, host: SimHost) -> None:
        self.host = host
        self.present = True
        self.seq = 0  # the gpu subject's last sequence
        self.gone = 0  # the sequence of the observation that showed it absent (0: present)

    def gone_seq(self, index: int) -> int:
        return self.gone

    async def observe(self, index: int) -> None:
        h = self.host
        used = sum(8 * GiB for m in h.models.values() if isinstance(m.state, (Resident, Waking)))
        event = GpuObserved(
            at=_now(),
            domain=h.domain,
            index=0,
            present=self.present,
            memory_total_bytes=80 * GiB,
            memory_used_bytes=used if self.present else 0,
            by=h.writer,
        )
        self.seq = await h.append(subjects.gpu(h.fleet, h.domain, 0), event, self.seq)
        self.gone = 0 if self.present else self.seq


def _now() -> datetime:
    return datetime.now(UTC)


class _Training:
    """The command service's training verbs on a host with no training slot."""

    def slot_names(self) -> list[str]:
        return []

    def pid(self, slot: str) -> int | None:
        return None

    async def start(self, slot: str) -> Outcome:
        return Outcome(ok=True, detail="no training slot here")

    async def stop(self, slot: str) -> Ended | None:
        return None


class _Supervisor:
    """One model's sleep, wake and probe, as the command service asks the agent's supervisor."""

    def __init__(self, host: SimHost, m: ModelSlot) -> None:
        self.host, self.m = host, m

    async def sleep(self, level: int) -> Outcome:
        return await self.host.sleep_model(self.m, level)

    async def wake(self) -> Outcome:
        return await self.host.wake_model(self.m)

    async def probe(self) -> Outcome:
        return await self.host.probe_model(self.m)


class SimHost:
    """One simulated agent. To the real command service (agents/commands.py) it is the agent's parts, typed
    against the same Protocols: its model slots (`models`, `selected`, `supervisor`), its role (`refresh`),
    its live apply (`apply_layout`) and its status (`data`, `verify_gpus`); training is `_Training`, no slots."""

    def __init__(
        self,
        log: Log,
        fleet: str,
        domain: str,
        specs: list[ModelSpec],
        *,
        policy: Policy,
        serving_url: str,
        heartbeat_ms: int,
        load_ms: int,
        wake_ms: int,
        sleep_ms: int,
        probe_ms: int,
        acked: list[tuple[str, int]] | None = None,
    ) -> None:
        self.log = log
        self.fleet = fleet
        self.domain = domain
        self.host = f"sim-{fleet}-{domain}"
        self.pid = os.getpid()
        self.writer = f"agent:{self.host}"
        self.serving_url = serving_url
        self._policy = policy
        self.heartbeat_ms = heartbeat_ms
        self.load_ms, self.wake_ms, self.sleep_ms, self.probe_ms = load_ms, wake_ms, sleep_ms, probe_ms
        self.logger = structlog.get_logger("haru.sim.hosts").bind(fleet=fleet, domain=domain)
        self._models = {s.name: ModelSlot(s, _NoRuntime(), subjects.model(fleet, domain, s.name)) for s in specs}  # type: ignore[arg-type]
        self.gpu = _SimGpu(self)
        self._appender = Appender(log, stopping=lambda: False, logger=self.logger)
        self.acked = acked  # (subject, seq) of every append acknowledged, when the caller keeps them
        self.agent_seq = 0
        self.recorder = Recorder(
            domain=domain,
            append=self.append,
            gpu=self.gpu,  # type: ignore[arg-type]
            agent_seq=lambda: self.agent_seq,
            stopping=lambda: False,
            logger=self.logger,
        )
        self.service: CommandService | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self.running = False
        self.heartbeats_sent = 0
        self.loop_errors = LoopErrors()

    async def append(self, subject: str, event: Event, expect: int) -> int:
        """The agent's append (agents/appender.py: expected sequence, retried while the log is away)."""
        seq = await self._appender(subject, event, expect)
        if self.acked is not None:
            self.acked.append((subject, seq))
        return seq

    # ------------------------------------------------------------- what the command service asks

    @property
    def models(self) -> Mapping[str, ModelSlot]:
        return self._models

    @property
    def policy(self) -> Policy:
        return self._policy

    def supervisor(self, m: ModelSlot) -> _Supervisor:
        return _Supervisor(self, m)

    async def refresh(self, revision: int) -> None:
        return None

    def data(self) -> dict:
        return {
            "role": "sim",
            "models": {n: {"state": m.state_tag} for n, m in self._models.items()},
            "training": {},
            "gpus": [{"index": 0, "present": self.gpu.present}],
        }

    def selected(self, command: Command) -> Selection:
        names = command.models or list(self._models)
        return Selection(
            models=[self._models[n] for n in names if n in self._models],
            unknown=[n for n in names if n not in self._models],
        )

    async def sleep_model(self, m: ModelSlot, level: int) -> Outcome:
        async with m.lock:
            if isinstance(m.state, Sleeping):
                return Outcome(ok=True, detail="already asleep")
            if not isinstance(m.state, (Resident, Waking)):
                return Outcome(ok=False, code="not_resident", detail=f"{m.name} is {m.state_tag}")
            await asyncio.sleep(self.sleep_ms / 1000)
            await self.record(m, Slept, level=level, freed_bytes=8 * GiB)
            return Outcome(ok=True, detail="asleep (level 1), 8.0 GiB freed")

    async def wake_model(self, m: ModelSlot) -> Outcome:
        t0 = time.monotonic()
        async with m.lock:
            if isinstance(m.state, Resident):
                return Outcome(ok=True, detail="already awake")
            if not self.gpu.present:
                return Outcome(ok=False, code="gpu_detached", detail="the GPU is detached")
            if not isinstance(m.state, (Sleeping, Waking)):
                return Outcome(ok=False, code="not_asleep", detail=f"{m.name} is {m.state_tag}")
            await self.record(m, WakeBegun)
            await asyncio.sleep(self.wake_ms / 1000)
            await self.record(m, Answered, endpoint=self.serving_url)
            took = int((time.monotonic() - t0) * 1000)
            return Outcome(ok=True, detail=f"awake in {took} ms", took_ms=took)

    async def probe_model(self, m: ModelSlot) -> Outcome:
        await asyncio.sleep(self.probe_ms / 1000)
        if not isinstance(m.state, Resident) or not self.gpu.present:
            return Outcome(ok=False, code="not_ready", detail=f"{m.name} is {m.state_tag}")
        return Outcome(ok=True, detail="one token", latency_ms=self.probe_ms)

    async def verify_gpus(self, models: list[ModelSlot]) -> GpuVerdict:
        if not self.gpu.present:
            return GpuVerdict(ok=False, error=ErrorInfo(code="gpu_detached", message="GPU 0 is detached"))
        return GpuVerdict(ok=True, data={"gpus": {"0": {"free_bytes": 80 * GiB}}})

    async def apply_layout(self, decl_seq: int) -> Applied:
        return Applied(ok=True, detail="the simulated host runs the declarations it started with")

    # ---------------------------------------------------------------------------- life cycle

    async def record(self, m: ModelSlot, kind: type[Observation], **fields: Any) -> None:
        await self.recorder.record(m, kind(at=_now(), domain=self.domain, model=m.name, **fields))

    def heartbeat(self) -> Heartbeat:
        self.heartbeats_sent += 1
        return heartbeat_of(
            fleet=self.fleet,
            domain=self.domain,
            role="sim",
            models={n: m.state_tag for n, m in self._models.items()},
            training=[],
            pid=self.pid,
            at=_now(),
        )

    async def start(self, *, adopt: bool = False) -> None:
        """Claim the domain (`agent_started` with the subject's expected sequence), observe the GPU, answer
        commands, beat, and load every model (or, after a restart, adopt the runtimes as they are)."""
        subject = subjects.agent(self.fleet, self.domain)
        started = AgentStarted(
            at=_now(),
            domain=self.domain,
            host=self.host,
            pid=self.pid,
            version="sim",
            serving_url=self.serving_url,
            by=self.writer,
        )
        self.agent_seq = await self.append(subject, started, await self.log.last_seq_of(subject))
        if not adopt:
            self.gpu.seq = await self.log.last_seq_of(subjects.gpu(self.fleet, self.domain, 0))
            await self.gpu.observe(0)
            for m in self._models.values():
                m.seq = await self.log.last_seq_of(m.subject)
        self.service = CommandService(
            self.log.bus,
            Identity(fleet=self.fleet, domain=self.domain, host=self.host, pid=self.pid),
            models=self,
            training=_Training(),
            role=self,
            live=self,
            status=self,
        )
        await self.service.start()
        beats = Heartbeats(
            functools.partial(self.log.bus.publish, subjects.heartbeat(self.fleet, self.domain)),
            self.heartbeat,
            interval_s=self.heartbeat_ms / 1000,
            errors=self.loop_errors,
            logger=self.logger,
        )
        self._tasks = [asyncio.create_task(beats.run(), name=f"hb-{self.host}")]
        self.running = True
        for m in self._models.values():
            if adopt:
                if state_name(m.state) in ("resident", "sleeping", "waking"):
                    await self.record(m, Adopted, asleep=isinstance(m.state, Sleeping))
            else:
                self._tasks.append(asyncio.create_task(self.load(m), name=f"load-{self.host}-{m.name}"))

    async def load(self, m: ModelSlot) -> None:
        """A load attempt: `model_loading`, then `model_resident` after `load_ms` (if the GPU is there)."""
        async with m.lock:
            m.attempt += 1
            await self.record(m, Spawned, endpoint=self.serving_url, pid=self.pid, attempt=m.attempt)
            await asyncio.sleep(self.load_ms / 1000)
            if self.gpu.present:
                await self.record(m, Answered, endpoint=self.serving_url, warmup_ms=self.load_ms)

    async def stop(self) -> None:
        """As SIGKILL: the heartbeats and the command service stop, nothing is recorded."""
        self.running = False
        await cancel_and_wait(*self._tasks)
        self._tasks = []
        if self.service is not None:
            with contextlib.suppress(Exception):
                await self.service.stop()
            self.service = None

    # -------------------------------------------------------------------------------- faults

    async def detach_gpu(self) -> None:
        """The provider takes the GPU: observed absent, every live model on it lost (gpu_detached)."""
        self.gpu.present = False
        await self.gpu.observe(0)
        for m in self._models.values():
            async with m.lock:
                await self.record(m, GpuGone, detail="the simulated GPU was detached")

    async def attach_gpu(self) -> None:
        """The GPU is back: observed present, and every model reloaded (loading -> resident)."""
        self.gpu.present = True
        await self.gpu.observe(0)
        await asyncio.gather(*(self.load(m) for m in self._models.values()))

    async def kill_runtime(self, model: str) -> None:
        """A runtime dies (SIGKILL): the model is lost (process_exited), then reloaded."""
        m = self._models[model]
        async with m.lock:
            await self.record(m, Exited, code=None, detail="killed by signal 9")
        await self.load(m)

    async def restart(self, down_s: float, *, give_up_s: float = 120.0) -> None:
        """The agent is SIGKILLed, silent for `down_s`, then started again, adopting its runtimes; a start
        that finds the log away (a cluster electing a leader) is tried again, as its supervisor would."""
        await self.stop()
        await asyncio.sleep(down_s)
        deadline = time.monotonic() + give_up_s
        while True:
            try:
                await self.start(adopt=True)
                return
            except LogUnavailable:
                await self.stop()
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1.0)


class SimHosts:
    """`fleets` fleets of two simulated hosts each, their serving ports, and the faults.

    Fleets can be added while running (`grow`), so one run measures 1, then 10, then 100 fleets.
    """

    def __init__(
        self,
        log: Log,
        *,
        heartbeat_ms: int = 1000,
        heartbeat_timeout_ms: int = 3000,
        load_ms: int = 300,
        wake_ms: int = 200,
        sleep_ms: int = 50,
        probe_ms: int = 20,
        keep_acks: bool = False,
    ) -> None:
        self.log = log
        self.acked: list[tuple[str, int]] | None = [] if keep_acks else None  # every agent append acknowledged
        self.heartbeat_ms = heartbeat_ms
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.timing = dict(load_ms=load_ms, wake_ms=wake_ms, sleep_ms=sleep_ms, probe_ms=probe_ms)
        self.hosts: dict[tuple[str, str], SimHost] = {}
        self.fleets: list[str] = []
        self._runner: web.AppRunner | None = None
        self._by_port: dict[int, tuple[str, str]] = {}  # serving port -> (fleet, domain)
        self.chats = 0

    async def __aenter__(self) -> SimHosts:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(*(h.stop() for h in self.hosts.values()), return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()

    def host(self, fleet: str, domain: str) -> SimHost:
        return self.hosts[(fleet, domain)]

    async def grow(self, count: int) -> list[str]:
        """Add fleets up to `count` in all: serving ports, `haru apply` of each layout, every host started.
        Returns the fleets added."""
        added = [fleet_name(i) for i in range(len(self.fleets), count)]
        for fleet in added:
            ports = {}
            for d in DOMAINS:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.bind(("127.0.0.1", 0))  # a free port, known before the site starts on it
                ports[d] = sock.getsockname()[1]
                site = web.SockSite(self._runner, sock)  # type: ignore[arg-type]
                await site.start()
                self._by_port[ports[d]] = (fleet, d)
            layout = parse_layout(fleet_layout(fleet, ports, heartbeat_timeout_ms=self.heartbeat_timeout_ms))
            await apply_layout(self.log, layout, _now())
            for dom in layout.domains:
                self.hosts[(fleet, dom.spec.name)] = SimHost(
                    self.log,
                    fleet,
                    dom.spec.name,
                    list(dom.models),
                    policy=layout.policy,
                    serving_url=dom.spec.serving_url,
                    heartbeat_ms=self.heartbeat_ms,
                    acked=self.acked,
                    **self.timing,
                )
            self.fleets.append(fleet)
        await asyncio.gather(*(self.hosts[(f, d)].start() for f in added for d in DOMAINS))
        return added

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.read()
        model = msgspec.json.decode(body).get("model", "") if body else ""
        port = request.transport.get_extra_info("sockname")[1] if request.transport else 0
        fleet, domain = self._by_port.get(port, ("", ""))
        self.chats += 1
        return web.json_response(
            {
                "id": "chatcmpl-sim",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model,
                "system_fingerprint": f"{fleet}/{domain}",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in MODELS]})

    def steady(self, views: Mapping[str, Any], fleets: Iterable[str] | None = None) -> list[str]:
        """The fleets (of `fleets`) not yet steady in `views` (FleetViews): a route, no operation, the
        active's models resident and the standby's asleep."""
        out = []
        for f in fleets if fleets is not None else self.fleets:
            v = views.get(f)
            if v is None or not v.active or v.operation is not None:
                out.append(f)
                continue
            standby = "b" if v.active == "a" else "a"
            act, sb = v.domains.get(v.active), v.domains.get(standby)
            if (
                act is None
                or sb is None
                or not all(isinstance(m.residency, Resident) for m in act.models.values())
                or not all(isinstance(m.residency, Sleeping) for m in sb.models.values())
            ):
                out.append(f)
        return out
