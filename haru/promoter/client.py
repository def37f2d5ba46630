"""Commands to agents over core NATS request/reply: the promoter's side of the agent seam.

    reply = await send(nc, "default", "b", "wake", Command(op_id=...), timeout_ms=120_000)

No responders, or no reply within the bound, raises `AgentGone`; an agent's own failure comes back
as a `Reply` with `ok=False` and an error code (a `nats.micro` error reply, with the
`Nats-Service-Error`/`-Code` headers, is turned into one). nats-py errors never escape this module.
"""

from __future__ import annotations

import asyncio

import msgspec
import nats.errors

from haru import subjects
from haru.commands import Command, ErrorInfo, Reply, command_encoder, reply_decoder
from haru.errors import AgentGone, CommandError


async def send(nc, fleet: str, domain: str, verb: str, command: Command, *, timeout_ms: int) -> Reply:
    """Send one command to a domain's agent and return its typed reply."""
    subject = subjects.command(fleet, domain, verb)
    try:
        msg = await nc.request(subject, command_encoder.encode(command), timeout=max(timeout_ms, 1) / 1000)
    except nats.errors.NoRespondersError as exc:
        raise AgentGone(f"no agent answers {verb} for {fleet}/{domain} (nothing subscribed to {subject})") from exc
    except (nats.errors.TimeoutError, asyncio.TimeoutError) as exc:
        raise AgentGone(f"the agent of {fleet}/{domain} did not answer {verb} within {timeout_ms} ms") from exc
    except nats.errors.Error as exc:
        raise CommandError(f"sending {verb} to {fleet}/{domain}: {exc}", code="nats_error") from exc
    headers = msg.headers or {}
    if "Nats-Service-Error" in headers:
        code = headers.get("Nats-Service-Error-Code", "") or "service_error"
        text = headers.get("Nats-Service-Error", "")
        try:
            reply = reply_decoder.decode(msg.data)
            if reply.error is not None:
                return reply
        except msgspec.DecodeError:
            pass
        return Reply(ok=False, error=ErrorInfo(code=str(code), message=text or f"{verb} failed"))
    try:
        return reply_decoder.decode(msg.data)
    except msgspec.DecodeError as exc:
        return Reply(ok=False, error=ErrorInfo(code="bad_reply", message=f"{verb} reply is not a Haru Reply: {exc}"))
