"""The agent's command service: one endpoint per verb, served on the bus (a `nats.micro` service on NATS).

    haru.cmd.<fleet>.<domain>.<verb>      body: haru.core.commands.Command (JSON; empty = all defaults)
                                          reply: haru.core.commands.Reply {ok, detail, took_ms, error, data}

Verbs (all idempotent; `models`/`slots` in the command restrict them, empty = all admitted):

    status          data: the agent's view (role, models and states, training, GPUs)
    sleep           put resident vLLM runtimes to sleep (level `level`), verified by /is_sleeping
    wake            wake sleeping runtimes, verified by /is_sleeping and a one-token completion;
                    CUDA out of memory -> ok=false, error.code="out_of_memory"
    probe           a real one-token completion (and /is_sleeping false) per resident model
    stop_training   SIGTERM, SIGKILL after the grace; data.slots[slot] = {how, exit_code, ran_ms}
    start_training  start training slots (refused with gpu_busy while models on that GPU are awake)
    verify_gpu      free VRAM covers what the asleep models need to wake; no trainer pid on the GPU
    apply_layout    apply the declarations (at least up to `decl_seq`) now, and on the standby the
                    changes that waited while the domain was active; answer once every model has
                    come to rest (a rolling change's apply steps); policy apply_timeout_ms bounds it

The service is named `haru-agent` with metadata fleet/domain, so `$SRV.PING.haru-agent` finds every
agent. Each request runs in its own task, so a long wake never delays a `status`. The service starts
with the heartbeat, before the agent has adopted its runtimes: a command that comes that early (the
promoter heard the beat) waits for the boot to end (`ready`) rather than finding nobody to answer it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import msgspec
import structlog

from haru.agents.cause import COMMAND_CAUSE, VERSION
from haru.agents.model_slot import ModelSlot
from haru.agents.ports import Applied, GpuVerdict, Identity, Outcome, Selection
from haru.agents.training import Ended
from haru.core import subjects
from haru.core.commands import Command, ErrorInfo, Reply, command_decoder
from haru.core.errors import HaruError
from haru.log.bus import Bus, Endpoint, Served, Service

__all__ = [
    "CommandService",
    "SERVICE_NAME",
    "COMMAND_CAUSE",
    "Drain",
    "LayoutVerbs",
    "ModelActions",
    "ModelVerbs",
    "RouteVerbs",
    "StatusVerbs",
    "TrainingVerbs",
]

SERVICE_NAME = "haru-agent"
_encoder = msgspec.json.Encoder()

# The serving port's requests in flight to these models finish (drain_ms at most); how many were cut.
Drain = Callable[[list[str]], Awaitable[int]]


# What the command service asks of the agent's parts, each verb's part declared here (agents/agent.py hands
# the real parts in; agents/sim/hosts.py hands a simulated host in).


class ModelActions(Protocol):
    """One model's supervisor, as a verb sees it."""

    async def sleep(self, level: int) -> Outcome: ...
    async def wake(self) -> Outcome: ...
    async def probe(self) -> Outcome: ...


class ModelVerbs(Protocol):
    """The host's model slots: sleep, wake and probe go to each named model's supervisor."""

    @property
    def models(self) -> Mapping[str, ModelSlot]: ...
    def selected(self, command: Command) -> Selection: ...
    def supervisor(self, m: ModelSlot) -> ModelActions: ...


class TrainingVerbs(Protocol):
    """The host's training slots, behind the policy of when one may start."""

    def slot_names(self) -> list[str]: ...
    def pid(self, slot: str) -> int | None: ...
    async def start(self, slot: str) -> Outcome: ...
    async def stop(self, slot: str) -> Ended | None: ...


class RouteVerbs(Protocol):
    """The domain's role: a command decided against a newer route makes it read the pointer first."""

    async def refresh(self, revision: int) -> None: ...


class LayoutVerbs(Protocol):
    """Layouts applied live: `apply_layout` brings the host to the declarations now."""

    async def apply_layout(self, decl_seq: int) -> Applied: ...


class StatusVerbs(Protocol):
    """What the agent says of itself: the `status` data and the GPUs' verdict."""

    def data(self) -> dict[str, Any]: ...
    async def verify_gpus(self, models: list[ModelSlot]) -> GpuVerdict: ...


class CommandService:
    """Answers each verb with the agent's part that does it: the model slots (sleep, wake, probe), the
    training policy, the role, the live apply and the status answer; served on the bus (haru/log/bus.py)."""

    def __init__(
        self,
        bus: Bus,
        identity: Identity,
        *,
        models: ModelVerbs,
        training: TrainingVerbs,
        role: RouteVerbs,
        live: LayoutVerbs,
        status: StatusVerbs,
        drain: Drain | None = None,
    ) -> None:
        self.bus = bus  # the bus the service answers on
        self.identity = identity
        self.drain = drain  # the serving port's requests in flight to these models finish (drain_ms at most)
        self.models = models
        self.training = training
        self.role = role
        self.live = live
        self.answer = status
        self.fleet, self.domain = identity.fleet, identity.domain
        self._served: Served | None = None
        # Set once the agent has booted (adopted its runtimes, read its tips): a command that came sooner waits
        # for it rather than finding nothing to answer it (the heartbeat starts first, so the promoter may ask).
        self.ready = asyncio.Event()
        self.logger = structlog.get_logger("haru.agent.commands").bind(fleet=self.fleet, domain=self.domain)
        self.verbs: dict[str, Callable[[Command], Awaitable[Reply]]] = {
            "status": self.status,
            "sleep": self.sleep,
            "wake": self.wake,
            "probe": self.probe,
            "stop_training": self.stop_training,
            "start_training": self.start_training,
            "verify_gpu": self.verify_gpu,
            "apply_layout": self.apply_layout,
        }

    async def start(self, *, booting: bool = False) -> None:
        """Serve every verb. `booting`: the agent is still booting, and commands wait until it sets `ready`."""
        if not booting:
            self.ready.set()
        a = self.identity
        service = Service(
            name=SERVICE_NAME,
            version=VERSION,
            description=f"Haru agent for {a.fleet}/{a.domain}",
            metadata={"fleet": a.fleet, "domain": a.domain, "host": a.host, "pid": str(a.pid)},
            # Each agent answers its own subjects; no queue sharing with a (refused) second agent.
            queue_group=f"haru-agent-{a.fleet}-{a.domain}",
        )
        endpoints = [
            Endpoint(verb, subjects.command(a.fleet, a.domain, verb), self._answer(verb))
            for verb in subjects.COMMAND_VERBS
        ]
        self._served = await self.bus.serve(service, endpoints)

    async def stop(self) -> None:
        if self._served is not None:
            await self._served.stop()

    def _answer(self, verb: str) -> Callable[[bytes], Awaitable[bytes]]:
        async def answer(data: bytes) -> bytes:
            return _encoder.encode(await self._run(verb, data))

        return answer

    async def _run(self, verb: str, data: bytes) -> Reply:
        started = time.monotonic()
        op_id = ""
        try:
            command = command_decoder.decode(data) if data.strip() else Command()
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            reply = Reply(
                ok=False,
                detail="bad command body",
                error=ErrorInfo(code="invalid_command", message=f"not a haru.core.commands.Command: {exc}"),
            )
        else:
            op_id = command.op_id
            COMMAND_CAUSE.set(command.cause)
            try:
                await self.ready.wait()  # a boot that never ends: `stop` cancels this answer with the others
                reply = await self.verbs[verb](command)
            except asyncio.CancelledError:
                raise
            except HaruError as exc:
                reply = Reply(
                    ok=False, detail=str(exc), error=ErrorInfo(code=getattr(exc, "code", "failed"), message=str(exc))
                )
            except Exception as exc:  # a bug must still answer: the promoter waits for a reply
                self.logger.exception("command failed", verb=verb)
                reply = Reply(ok=False, detail="internal error", error=ErrorInfo(code="internal", message=repr(exc)))
        took = int((time.monotonic() - started) * 1000)
        reply = msgspec.structs.replace(reply, took_ms=took)
        self.logger.info(
            "command", verb=verb, op_id=op_id, ok=reply.ok, code=reply.error.code if reply.error else "", took_ms=took
        )
        return reply

    # ------------------------------------------------------------------------------------- verbs

    async def status(self, command: Command) -> Reply:
        data = self.answer.data()
        states = [m["state"] for m in data["models"].values()]
        return Reply(
            ok=True, detail=f"{data['role']}: " + ", ".join(f"{k} {v}" for k, v in _count(states).items()), data=data
        )

    def _unknown(self, unknown: list[str]) -> Reply:
        return Reply(
            ok=False,
            detail="unknown models",
            error=ErrorInfo(
                code="model_not_found",
                message=f"domain {self.domain!r} runs no admitted model {', '.join(map(repr, unknown))}",
            ),
        )

    async def sleep(self, command: Command) -> Reply:
        selection = self.models.selected(command)
        models = selection.models
        if selection.unknown:
            return self._unknown(selection.unknown)
        if self.drain is not None:  # after a planned flip this is the old active: what it answers finishes first
            cut = await self.drain([m.name for m in models])
            if cut:
                self.logger.warning("sleeping with requests still in flight after drain_ms", in_flight=cut)
        results = await asyncio.gather(*(self.models.supervisor(m).sleep(command.level or 1) for m in models))
        return _combine("sleep", dict(zip((m.name for m in models), results, strict=True)), self.models)

    async def wake(self, command: Command) -> Reply:
        selection = self.models.selected(command)
        models = selection.models
        if selection.unknown:
            return self._unknown(selection.unknown)
        results = await asyncio.gather(*(self.models.supervisor(m).wake() for m in models))
        reply = _combine("wake", dict(zip((m.name for m in models), results, strict=True)), self.models)
        for m, outcome in zip(models, results, strict=True):
            reply.data["models"][m.name]["took_ms"] = outcome.took_ms
        return reply

    async def probe(self, command: Command) -> Reply:
        selection = self.models.selected(command)
        models = selection.models
        if selection.unknown:
            return self._unknown(selection.unknown)
        results = await asyncio.gather(*(self.models.supervisor(m).probe() for m in models))
        reply = _combine("probe", dict(zip((m.name for m in models), results, strict=True)), self.models)
        for m, outcome in zip(models, results, strict=True):
            reply.data["models"][m.name]["latency_ms"] = outcome.latency_ms
        return reply

    def _slots(self, command: Command) -> tuple[list[str], list[str]]:
        trainers = self.training.slot_names()
        names = command.slots or trainers
        return [s for s in names if s in trainers], [s for s in names if s not in trainers]

    async def stop_training(self, command: Command) -> Reply:
        slots, unknown = self._slots(command)
        if unknown:
            return Reply(
                ok=False, error=ErrorInfo(code="slot_not_found", message=f"no admitted training slot {unknown}")
            )
        out = {}
        for slot in slots:
            ended = await self.training.stop(slot)
            out[slot] = (
                {"how": ended.how, "exit_code": ended.exit_code, "ran_ms": ended.ran_ms, "was_running": True}
                if ended
                else {"was_running": False}
            )
        detail = ", ".join(f"{s} {v['how']}" if v["was_running"] else f"{s} not running" for s, v in out.items())
        data: dict[str, Any] = {"slots": out}
        if command.then_verify:  # the GPUs read once training is gone: the promoter's verify_gpu step
            t0 = time.monotonic()
            verified = await self.verify_gpu(command)
            took = verified.took_ms or int((time.monotonic() - t0) * 1000)
            data["verify_gpu"] = msgspec.to_builtins(msgspec.structs.replace(verified, took_ms=took))
        return Reply(ok=True, detail=detail or "no training slots", data=data)

    async def start_training(self, command: Command) -> Reply:
        await self.role.refresh(command.route_revision)
        slots, unknown = self._slots(command)
        if unknown:
            return Reply(
                ok=False, error=ErrorInfo(code="slot_not_found", message=f"no admitted training slot {unknown}")
            )
        out = {}
        first_error: ErrorInfo | None = None
        for slot in slots:
            started = await self.training.start(slot)
            out[slot] = {"ok": started.ok, "detail": started.detail, "pid": self.training.pid(slot)}
            if not started.ok and first_error is None:
                first_error = ErrorInfo(code=started.code, message=f"{slot}: {started.detail}")
        ok = first_error is None
        return Reply(
            ok=ok,
            detail="; ".join(f"{s}: {v['detail']}" for s, v in out.items()) or "no training slots",
            error=first_error,
            data={"slots": out},
        )

    async def verify_gpu(self, command: Command) -> Reply:
        selection = self.models.selected(command)
        models = selection.models
        if selection.unknown:
            return self._unknown(selection.unknown)
        verdict = await self.answer.verify_gpus(models)
        if not verdict.ok:
            detail = verdict.error.message if verdict.error else ""
        elif verdict.data.get("unverified"):
            detail = "; ".join(verdict.data["unverified"])
        else:
            detail = "VRAM verified: enough free to wake, no trainer on the GPUs"
        took = verdict.data.get("settle_ms")
        if verdict.ok and took is not None:
            detail += (
                f" (read {verdict.data.get('reads', 1)} times; the memory was back after {took} ms, within the "
                f"{verdict.data.get('settle_bound_ms', 0)} ms settle window)"
            )
        return Reply(ok=verdict.ok, detail=detail, error=verdict.error, data=verdict.data)

    async def apply_layout(self, command: Command) -> Reply:
        await self.role.refresh(command.route_revision)
        applied = await self.live.apply_layout(command.decl_seq)
        return Reply(
            ok=applied.ok,
            detail=applied.detail,
            data=applied.data,
            error=None if applied.ok else ErrorInfo(code=applied.code, message=applied.detail),
        )


def _count(states: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in states:
        out[s] = out.get(s, 0) + 1
    return out


def _combine(verb: str, per: dict[str, Outcome], slots: ModelVerbs) -> Reply:
    data = {
        "models": {
            name: {
                "ok": o.ok,
                "state": slots.models[name].state_tag,
                "detail": o.detail,
                **({"code": o.code} if o.code else {}),
            }
            for name, o in per.items()
        }
    }
    failed = {name: o for name, o in per.items() if not o.ok}
    if not per:
        return Reply(ok=True, detail=f"{verb}: no models", data=data)
    if failed:
        first = next(iter(failed.values()))
        message = "; ".join(f"{n}: {o.detail}" for n, o in failed.items())
        return Reply(
            ok=False,
            detail=f"{verb} failed for {', '.join(failed)}",
            error=ErrorInfo(code=first.code or "failed", message=message),
            data=data,
        )
    return Reply(ok=True, detail="; ".join(f"{name}: {o.detail}" for name, o in per.items()), data=data)
