"""Commands to agents over core NATS request/reply: the promoter's side of the agent seam.

    reply = await send(log.bus, "default", "b", "wake", Command(op_id=...), timeout=120.0)

`haru.log.bus.send`, the one implementation (its docstring says what each outcome becomes): no
responders, or no reply within the bound, raises `AgentGone`; an agent's own failure comes back as a
`Reply` with `ok=False` and an error code (a `nats.micro` error reply, with the
`Nats-Service-Error`/`-Code` headers, is turned into one). nats-py errors never escape it.
"""

from __future__ import annotations

from haru.log.bus import send

__all__ = ["send"]
