"""A small in-test agent on nats.micro: the agent seam's contract as the promoter relies on it.

It answers the eight verbs on `haru.cmd.<fleet>.<domain>.<verb>` with `haru.core.commands.Reply` (on nats.micro against
a real server, as the real agent does; on the bus against an in-memory log, `FakeAgent(None, ...,
log=memory_log.connect(...))`), publishes heartbeats on the bus, and appends the residency and training events a real
agent would (sleeping, waking, resident; training started/stopped), each with the subject's expected sequence. Faults:
`oom_on_wake`, `fail_probe`, `hang` (no heartbeats, no replies: the agent is gone), per-verb delays.

The promoter is also tested against the real agent and simulator (tests/integration/test_promoter_sim.py);
this fake keeps the saga's own tests independent of them and fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import msgspec
from nats.micro import add_service
from nats.micro.service import EndpointConfig, ServiceConfig

from haru.core import subjects
from haru.core.commands import ErrorInfo, Heartbeat, Reply, command_decoder
from haru.core.events import (
    GpuObserved,
    ModelLost,
    ModelResident,
    ModelSleeping,
    ModelWaking,
    TrainingStarted,
    TrainingStopped,
)
from haru.core.layout import parse_layout
from haru.host.tasks import cancel_and_wait
from haru.log.eventlog import EventLog
from tests.support.clock import now

_pids = itertools.count(40_000)


def layout(
    fleet: str = "default",
    *,
    models=("m1", "m2"),
    heartbeat_timeout_ms=800,
    degraded_grace_ms=300,
    auto_failover=True,
    command_timeout_ms=2000,
    wake_timeout_ms=2000,
    probe_timeout_ms=2000,
    domains="ab",
):
    """A fleet of `domains` (one letter each; two by default) with short policy bounds for tests."""

    def domain(name: str, port0: int) -> dict:
        return {
            "name": name,
            "serving_url": f"http://127.0.0.1:{port0}",
            "gpus": [{"index": 0, "memory": "24GiB", "reserve": "2GiB"}],
            "slots": [
                {
                    "name": "chat",
                    "gpu": 0,
                    "models": [
                        {"name": m, "runtime": "vllm", "vram": "4GiB", "port": port0 + 1 + i, "source": m}
                        for i, m in enumerate(models)
                    ],
                },
                {
                    "name": "lora",
                    "kind": "training",
                    "gpu": 0,
                    "command": ["true"],
                    "checkpoint_dir": "/tmp/haru-test-ckpt",
                    "vram": "4GiB",
                },
            ],
        }

    return parse_layout(
        {
            "fleet": fleet,
            "policy": {
                "auto_failover": auto_failover,
                "heartbeat_timeout_ms": heartbeat_timeout_ms,
                "degraded_grace_ms": degraded_grace_ms,
                "training_grace_ms": 200,
                "command_timeout_ms": command_timeout_ms,
                "wake_timeout_ms": wake_timeout_ms,
                "probe_timeout_ms": probe_timeout_ms,
            },
            "domains": [domain(name, 19100 + 100 * i) for i, name in enumerate(domains)],
        }
    )


class FakeAgent:
    """One fake domain agent. `async with FakeAgent(url, fleet, domain, models) as agent: ...`"""

    def __init__(
        self,
        url: str,
        fleet: str,
        domain: str,
        models: list[str],
        *,
        slots=("lora",),
        start: str = "resident",
        hb_interval: float = 0.1,
        log=None,
    ) -> None:
        self.url = url
        self._given_log = log  # an in-memory log (haru.log.memory): served on its bus instead of nats.micro
        self.fleet = fleet
        self.domain = domain
        self.models = {m: start for m in models}
        self.slots = list(slots)
        self.training: dict[str, int] = {}
        self.hb_interval = hb_interval
        self.oom_on_wake = False
        self.fail_probe = False
        self.hang = False
        self.delay_s: dict[str, float] = {}
        self.hold: dict[str, asyncio.Event] = {}  # a verb waits for its event to be set before answering
        self.calls: list[tuple[str, str]] = []  # (verb, op_id)
        self.gpu_present = True
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> FakeAgent:
        if self._given_log is not None:
            self.log = self._given_log
        else:
            self.log = await EventLog.open([self.url], writer=f"agent:{self.fleet}/{self.domain}@fake")
        await self.announce()
        await self.serve()
        self._tasks.append(asyncio.create_task(self._beat()))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)
        self._tasks.clear()
        with contextlib.suppress(Exception):
            await self.service.stop()
        if self._given_log is None:
            await self.log.close()

    async def serve(self) -> None:
        if self._given_log is not None:
            self.service = _BusService(self)
            await self.service.start()
            return
        self.service = await add_service(self.log.nc, ServiceConfig(name=f"haru-agent-{self.domain}", version="0.0.1"))
        for verb in subjects.COMMAND_VERBS:
            await self.service.add_endpoint(
                EndpointConfig(
                    name=verb, subject=subjects.command(self.fleet, self.domain, verb), handler=self._handler(verb)
                )
            )

    async def unserve(self) -> None:
        """The agent process is gone: no responders, no heartbeats."""
        await self.service.stop()
        self.hang = True

    async def append(self, subject: str, event) -> int:
        return await self.log.append(subject, event, expect=await self.log.last_seq_of(subject))

    async def announce(self) -> None:
        await self.append(
            subjects.gpu(self.fleet, self.domain, 0),
            GpuObserved(at=now(), domain=self.domain, index=0, present=True, memory_total_bytes=24 * 2**30),
        )
        for m, state in self.models.items():
            event = (ModelResident if state == "resident" else ModelSleeping)(at=now(), domain=self.domain, model=m)
            await self.append(subjects.model(self.fleet, self.domain, m), event)

    async def _beat(self) -> None:
        while True:
            if not self.hang:
                hb = Heartbeat(
                    fleet=self.fleet,
                    domain=self.domain,
                    at=now(),
                    models=dict(self.models),
                    training=list(self.training),
                )
                await self.log.bus.publish(subjects.heartbeat(self.fleet, self.domain), msgspec.json.encode(hb))
            await asyncio.sleep(self.hb_interval)

    async def lose(self, model: str, reason: str) -> None:
        self.models[model] = "lost"
        await self.append(
            subjects.model(self.fleet, self.domain, model),
            ModelLost(at=now(), domain=self.domain, model=model, reason=reason),
        )

    async def detach_gpu(self) -> None:
        self.gpu_present = False
        await self.append(
            subjects.gpu(self.fleet, self.domain, 0), GpuObserved(at=now(), domain=self.domain, index=0, present=False)
        )
        for m in self.models:
            await self.lose(m, "gpu_detached")

    async def attach_gpu(self) -> None:
        self.gpu_present = True
        await self.append(
            subjects.gpu(self.fleet, self.domain, 0),
            GpuObserved(at=now(), domain=self.domain, index=0, present=True, memory_total_bytes=24 * 2**30),
        )
        for m in self.models:
            self.models[m] = "resident"
            await self.append(
                subjects.model(self.fleet, self.domain, m), ModelResident(at=now(), domain=self.domain, model=m)
            )

    def _handler(self, verb: str):
        async def handle(req) -> None:
            if self.hang:
                return
            cmd = command_decoder.decode(req.data) if req.data else None
            self.calls.append((verb, cmd.op_id if cmd else ""))
            if self.delay_s.get(verb):
                await asyncio.sleep(self.delay_s[verb])
            if verb in self.hold:
                await self.hold[verb].wait()
            reply = await getattr(self, f"do_{verb}")()
            await req.respond(msgspec.json.encode(reply))

        return handle

    def _fail(self, code: str, message: str) -> Reply:
        return Reply(ok=False, error=ErrorInfo(code=code, message=message))

    async def do_status(self) -> Reply:
        return Reply(ok=True, data={"models": dict(self.models), "training": list(self.training)})

    async def do_stop_training(self) -> Reply:
        for slot in list(self.training):
            self.training.pop(slot)
            await self.append(
                subjects.training(self.fleet, self.domain, slot),
                TrainingStopped(at=now(), domain=self.domain, slot=slot, how="terminated"),
            )
        return Reply(ok=True, detail="training stopped")

    async def do_verify_gpu(self) -> Reply:
        if not self.gpu_present:
            return self._fail("gpu_detached", "GPU 0 is not present")
        return Reply(ok=True, detail="22 GiB free", data={"free_bytes": 22 * 2**30})

    async def do_wake(self) -> Reply:
        if not self.gpu_present:
            return self._fail("gpu_detached", "GPU 0 is not present")
        for m, state in self.models.items():
            if state == "sleeping":
                await self.append(
                    subjects.model(self.fleet, self.domain, m), ModelWaking(at=now(), domain=self.domain, model=m)
                )
                if self.oom_on_wake:
                    return self._fail("out_of_memory", f"{m}: CUDA error: out of memory")
                self.models[m] = "resident"
                await self.append(
                    subjects.model(self.fleet, self.domain, m), ModelResident(at=now(), domain=self.domain, model=m)
                )
        return Reply(ok=True, detail="awake")

    async def do_probe(self) -> Reply:
        if self.fail_probe:
            return self._fail("probe_failed", "m1: completion returned 500")
        bad = [m for m, s in self.models.items() if s != "resident"]
        if bad:
            return self._fail("not_resident", f"{', '.join(bad)} not resident")
        return Reply(ok=True, detail=f"{len(self.models)} models answered")

    async def do_sleep(self) -> Reply:
        if not self.gpu_present:
            return self._fail("gpu_detached", "GPU 0 is not present")
        for m, state in self.models.items():
            if state == "resident":
                self.models[m] = "sleeping"
                await self.append(
                    subjects.model(self.fleet, self.domain, m), ModelSleeping(at=now(), domain=self.domain, model=m)
                )
            elif state != "sleeping":
                return self._fail("not_resident", f"{m} is {state}")
        return Reply(ok=True, detail="asleep")

    async def do_apply_layout(self) -> Reply:
        # The fake runs no runtimes: its models are as declared already (a rolling change's apply steps).
        return Reply(ok=True, detail="declarations applied")

    async def do_start_training(self) -> Reply:
        for slot in self.slots:
            if slot not in self.training:
                self.training[slot] = next(_pids)
                await self.append(
                    subjects.training(self.fleet, self.domain, slot),
                    TrainingStarted(at=now(), domain=self.domain, slot=slot, pid=self.training[slot], gpu_index=0),
                )
        return Reply(ok=True, detail="training running")


class _BusService:
    """The fake agent's verbs on a bus (haru.log.bus.Bus) rather than nats.micro: a request's reply goes
    to its reply subject, as nats.micro's `respond` does."""

    def __init__(self, agent: FakeAgent) -> None:
        self.agent = agent
        self.subs: list = []

    async def start(self) -> None:
        bus = self.agent.log.bus
        for verb in subjects.COMMAND_VERBS:
            handle = self.agent._handler(verb)

            async def on(msg, handle=handle) -> None:
                await handle(_Request(bus, msg))

            self.subs.append(await bus.subscribe(subjects.command(self.agent.fleet, self.agent.domain, verb), on))

    async def stop(self) -> None:
        for sub in self.subs:
            await sub.unsubscribe()
        self.subs = []


class _Request:
    def __init__(self, bus, msg) -> None:
        self.bus, self.data, self.reply = bus, msg.data, msg.reply

    async def respond(self, data: bytes) -> None:
        await self.bus.publish(self.reply, data)
