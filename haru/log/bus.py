"""The bus: core NATS publish, subscribe and request/reply, for what is not history (heartbeats,
liveness beats, commands to agents), behind one small interface.

    bus = log.bus                                    # NatsBus over the log's connection
    await bus.publish(subjects.heartbeat(fleet, domain), body)
    sub = await bus.subscribe(subjects.heartbeats("*"), on_msg)     # on_msg(Msg), plain or async
    msg = await bus.request(subject, body, timeout=5.0)              # NoResponders, RequestTimeout
    reply = await send(bus, "default", "b", "wake", Command(op_id=...), timeout=120.0)
    served = await bus.serve(Service(name="haru-agent", ...), [Endpoint("status", subject, answer)])
    await served.stop()                                              # answer(body) -> reply body

`serve` answers requests: each endpoint's `answer` is called with a request's body in a task of its own
(so a slow answer never delays another) and its return value is the reply. On NATS it is a `nats.micro`
service, so `$SRV.PING.<name>` finds it; `stop()` stops answering and cancels the answers in flight.

`NatsBus` is the real one; `haru.log.memory.MemoryBus` is the in-memory one, and
tests/integration/test_log_contract.py runs one suite against both. nats-py errors never escape
this module: they become `haru.core.errors.BusError`s.

`send` is the one way to command an agent (the promoter, the CLI and the tests use it):

- nothing subscribed to the verb's subject, or no reply within `timeout`: `AgentGone`;
- a `nats.micro` error reply (headers `Nats-Service-Error` / `Nats-Service-Error-Code`, either one):
  a `Reply(ok=False)` with that code and text (the Reply in the body when it carries an error);
- a body that is not a `Reply`: `Reply(ok=False)` with code `bad_reply`;
- otherwise the agent's `Reply`, `ok` or not: the caller decides what a failure means.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import nats.errors
import nats.micro
from nats.micro.request import Request

from haru.core import subjects
from haru.core.commands import Command, ErrorInfo, Reply, command_encoder, reply_decoder
from haru.core.errors import AgentGone, BusError, CommandError, NoResponders, RequestTimeout

__all__ = [
    "Answer",
    "Answering",
    "Bus",
    "Endpoint",
    "Msg",
    "NatsBus",
    "Served",
    "Service",
    "Subscription",
    "send",
    "SERVICE_ERROR",
    "SERVICE_ERROR_CODE",
]

SERVICE_ERROR = "Nats-Service-Error"
SERVICE_ERROR_CODE = "Nats-Service-Error-Code"


class Msg(msgspec.Struct, frozen=True):
    """A message on the bus: its subject, body, headers and the subject to reply to ("" for none)."""

    subject: str
    data: bytes
    headers: dict[str, str] | None = None
    reply: str = ""


Handler = Callable[[Msg], Awaitable[None] | None]


class Subscription(Protocol):
    async def unsubscribe(self) -> None: ...


Answer = Callable[[bytes], Awaitable[bytes]]
"""A served endpoint's answer: the request's body in, the reply's body out. It must not raise (a request
whose answer raised gets no reply: its requester times out)."""


@dataclass(frozen=True)
class Service:
    """What a served service says of itself (`$SRV.INFO` on NATS) and the queue group its endpoints share."""

    name: str
    version: str
    description: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    queue_group: str = ""


@dataclass(frozen=True)
class Endpoint:
    """One request subject a service answers, and how."""

    name: str
    subject: str
    answer: Answer


class Served(Protocol):
    async def stop(self) -> None:
        """Stop answering; the answers in flight are cancelled (their requesters get no reply)."""
        ...


class Answering:
    """The answers in flight of one served service: each in its own task, all cancelled by `stop`. Both
    buses serve through it, so a slow answer delays no other on either."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, answer: Answer, data: bytes, respond: Callable[[bytes], Awaitable[object]]) -> None:
        task = asyncio.ensure_future(self._answer(answer, data, respond))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _answer(answer: Answer, data: bytes, respond: Callable[[bytes], Awaitable[object]]) -> None:
        reply = await answer(data)
        with contextlib.suppress(Exception):  # the requester went away, or the link did
            await respond(reply)

    async def stop(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Bus(Protocol):
    """Core NATS for Haru: what heartbeats and commands need, nothing more."""

    @property
    def connected(self) -> bool: ...

    async def publish(
        self, subject: str, data: bytes, *, headers: dict[str, str] | None = None, reply: str = ""
    ) -> None: ...

    async def subscribe(self, subject: str, handler: Handler) -> Subscription: ...

    async def request(
        self, subject: str, data: bytes, *, timeout: float, headers: dict[str, str] | None = None
    ) -> Msg: ...

    async def serve(self, service: Service, endpoints: Sequence[Endpoint]) -> Served: ...


class NatsBus:
    """The bus over a nats-py connection."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc

    @property
    def connected(self) -> bool:
        return bool(self.nc.is_connected)

    async def publish(
        self, subject: str, data: bytes, *, headers: dict[str, str] | None = None, reply: str = ""
    ) -> None:
        try:
            await self.nc.publish(subject, data, reply=reply, headers=headers)
        except nats.errors.Error as exc:
            raise BusError(f"publishing on {subject}: {exc or type(exc).__name__}") from exc

    async def subscribe(self, subject: str, handler: Handler) -> Subscription:
        is_async = inspect.iscoroutinefunction(handler)

        async def on_msg(m: Any) -> None:
            msg = Msg(m.subject, m.data, m.headers, m.reply or "")
            if is_async:
                await handler(msg)  # type: ignore[misc]
            else:
                handler(msg)

        try:
            sub: Subscription = await self.nc.subscribe(subject, cb=on_msg)
            return sub
        except nats.errors.Error as exc:
            raise BusError(f"subscribing to {subject}: {exc or type(exc).__name__}") from exc

    async def request(self, subject: str, data: bytes, *, timeout: float, headers: dict[str, str] | None = None) -> Msg:
        try:
            m = await self.nc.request(subject, data, timeout=timeout, headers=headers)
        except nats.errors.NoRespondersError as exc:
            raise NoResponders(f"nothing is subscribed to {subject}") from exc
        except (TimeoutError, nats.errors.TimeoutError) as exc:
            raise RequestTimeout(f"no reply on {subject} within {timeout:g} s") from exc
        except nats.errors.Error as exc:
            raise BusError(f"requesting on {subject}: {exc or type(exc).__name__}") from exc
        return Msg(m.subject, m.data, m.headers, m.reply or "")

    async def serve(self, service: Service, endpoints: Sequence[Endpoint]) -> Served:
        """A `nats.micro` service (so `$SRV.PING.<name>` finds it), one endpoint per `Endpoint`."""
        answering = Answering()
        try:
            micro = await nats.micro.add_service(
                self.nc,
                name=service.name,
                version=service.version,
                description=service.description,
                metadata=dict(service.metadata),
                queue_group=service.queue_group or None,
            )
            for ep in endpoints:
                await micro.add_endpoint(name=ep.name, subject=ep.subject, handler=_micro_handler(answering, ep.answer))
        except ValueError as exc:  # nats.micro's own checks: a name, version (semver) or subject it refuses
            raise BusError(f"serving {service.name!r} version {service.version!r}: {exc}") from exc
        except nats.errors.Error as exc:
            raise BusError(f"serving {service.name}: {exc or type(exc).__name__}") from exc
        return _MicroServed(micro, answering)


def _micro_handler(answering: Answering, answer: Answer) -> Callable[[Request], Coroutine[Any, Any, None]]:
    async def handle(request: Request) -> None:
        answering.start(answer, request.data, request.respond)

    return handle


class _MicroServed:
    def __init__(self, micro: nats.micro.Service, answering: Answering) -> None:
        self.micro, self.answering = micro, answering

    async def stop(self) -> None:
        with contextlib.suppress(nats.errors.Error):  # the link is gone: nothing is served on it any more
            await self.micro.stop()
        await self.answering.stop()


async def send(
    bus: Bus, fleet: str, domain: str, verb: str, command: Command | None = None, *, timeout: float = 30.0
) -> Reply:
    """Send one command to a domain's agent and return its typed reply (see the module docstring)."""
    subject = subjects.command(fleet, domain, verb)
    try:
        msg = await bus.request(subject, command_encoder.encode(command or Command()), timeout=max(timeout, 0.001))
    except NoResponders as exc:
        raise AgentGone(
            f"no agent answers {verb} for {fleet}/{domain} (nothing subscribed to {subject}): is it running?"
        ) from exc
    except RequestTimeout as exc:
        raise AgentGone(f"the agent of {fleet}/{domain} did not answer {verb} within {timeout:.1f} s") from exc
    except BusError as exc:
        raise CommandError(f"sending {verb} to {fleet}/{domain}: {exc}", code="nats_error") from exc
    headers = msg.headers or {}
    if SERVICE_ERROR in headers or SERVICE_ERROR_CODE in headers:
        code = headers.get(SERVICE_ERROR_CODE, "") or "service_error"
        text = headers.get(SERVICE_ERROR, "")
        with contextlib.suppress(msgspec.DecodeError):
            reply = reply_decoder.decode(msg.data)
            if reply.error is not None:
                return reply
        return Reply(ok=False, error=ErrorInfo(code=str(code), message=text or f"{verb} failed"))
    try:
        return reply_decoder.decode(msg.data)
    except msgspec.DecodeError as exc:
        return Reply(
            ok=False,
            error=ErrorInfo(
                code="bad_reply",
                message=f"the agent of {fleet}/{domain} answered {verb} with something that is not a Reply: {exc}",
            ),
        )
