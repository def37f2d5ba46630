"""Sending a command to an agent: what the promoter and the CLI use.

    reply = await send(nc, "default", "b", "wake", Command(op_id="..."), timeout=30.0)

No responders or no reply in time is `AgentGone`: the agent is not there (or did not answer).
A reply with ok=false is returned as is: the caller decides (the code says what failed).
"""

from __future__ import annotations

import asyncio

import msgspec
import nats.errors

from haru import subjects
from haru.commands import Command, Reply, command_encoder, reply_decoder
from haru.errors import AgentGone, CommandError

__all__ = ["send"]


async def send(nc, fleet: str, domain: str, verb: str, command: Command | None = None, timeout: float = 30.0) -> Reply:
    subject = subjects.command(fleet, domain, verb)
    body = command_encoder.encode(command or Command())
    try:
        msg = await nc.request(subject, body, timeout=timeout)
    except nats.errors.NoRespondersError as exc:
        raise AgentGone(f"no agent answers for domain {domain!r} of fleet {fleet!r} ({subject}): is it running?") from exc
    except (nats.errors.TimeoutError, asyncio.TimeoutError) as exc:
        raise AgentGone(f"the agent for domain {domain!r} did not answer {verb!r} within {timeout:.1f}s") from exc
    headers = msg.headers or {}
    if "Nats-Service-Error-Code" in headers:
        raise CommandError(f"agent {domain!r} failed {verb!r}: {headers.get('Nats-Service-Error', '')}",
                           code=str(headers.get("Nats-Service-Error-Code")))
    try:
        return reply_decoder.decode(msg.data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise CommandError(f"agent {domain!r} answered {verb!r} with something that is not a Reply: {exc}",
                           code="bad_reply") from exc
