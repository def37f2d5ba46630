"""Sending a command to an agent: `haru.log.bus.send`, here where callers of the agent look for it.

    reply = await send(log.bus, "default", "b", "wake", Command(op_id="..."), timeout=30.0)

No responders or no reply in time is `AgentGone`; a reply with ok=false (a `nats.micro` error reply
included) is returned as a `Reply`: the caller decides. One semantics, written once in haru/log/bus.py.
"""

from __future__ import annotations

from haru.log.bus import send

__all__ = ["send"]
