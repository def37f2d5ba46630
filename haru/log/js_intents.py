"""The intents part of the JetStream log: route intents on stream HARU_ROUTE (`haru.route.<fleet>`),
published with the fleet subject's expected sequence, read last, and watched."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import structlog
from nats.js import api

from haru.core import subjects
from haru.core.receipts import reading
from haru.log.jetstream import JetStreamClient, parse_ack_reply, translated
from haru.log.record import msg_id

__all__ = ["JetStreamIntents"]

_log = structlog.get_logger("haru.log.intents")


class JetStreamIntents(JetStreamClient):
    """The route intents' stream (`haru.log.seam.IntentStore`)."""

    async def publish_intent(self, fleet: str, data: bytes, *, expect: int) -> int:
        """Publish a route intent on haru.route.<fleet> if the last one is at `expect` (0 = none yet)."""
        subject = subjects.intent(fleet)
        return await self._publish_checked(subjects.ROUTE_STREAM, subject, data, expect, msg_id(subject, expect, data))

    async def last_intent(self, fleet: str) -> tuple[bytes, int] | None:
        last = await self._last_raw(subjects.ROUTE_STREAM, subjects.intent(fleet))
        if last is None:
            return None
        return last[1], last[0]

    async def watch_intents(self, fleet: str = "*") -> AsyncIterator[tuple[str, bytes, int]]:
        """The last intent of each matching fleet, then every new one, in order: (fleet, body, seq).

        A redelivery of the intent last yielded for a fleet is dropped; an intent at a lower sequence, or
        at the same one with other content, is yielded: the intents' stream went backwards (a store that
        lost power before it fsynced), and the one yielded before is a pointer the log forgot
        (`haru.core.receipts.reading`). After the connection comes back the watch starts again from
        each fleet's last intent, so such a rewind is seen at once."""
        subject = "haru.route.*" if fleet == "*" else subjects.intent(fleet)
        queue: asyncio.Queue[tuple[str, bytes, int] | None] = asyncio.Queue()

        async def on_msg(msg: Any) -> None:
            seq, _, _ = parse_ack_reply(msg.reply)
            queue.put_nowait((msg.subject.rsplit(".", 1)[1], msg.data, seq))

        was_down = False

        def on_link(up: bool) -> None:
            nonlocal was_down
            if not up:
                was_down = True
            elif was_down:
                was_down = False
                queue.put_nowait(None)  # subscribe again: deliver each fleet's last intent as the log has it now

        async def subscribe() -> Any:
            with translated(f"watching route intents on {subject}"):
                return await self.js.subscribe(
                    subject,
                    cb=on_msg,
                    stream=subjects.ROUTE_STREAM,
                    ordered_consumer=True,
                    deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
                    pending_msgs_limit=-1,
                    pending_bytes_limit=-1,
                )

        forget = self.on_link_change(on_link)
        sub = await subscribe()
        try:
            held: dict[str, tuple[int, bytes]] = {}  # fleet -> (seq, body) last yielded
            while True:
                item = await queue.get()
                if item is None:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
                    sub = await subscribe()
                    continue
                name, data, seq = item
                last = held.get(name)
                if last is not None and reading(last[0], last[1], seq, data) == "same":
                    continue  # a redelivery (an ordered-consumer reset, a new subscription)
                if last is not None and seq <= last[0]:
                    _log.warning("intents.rewound", fleet=name, held_seq=last[0], seq=seq)
                held[name] = (seq, data)
                yield item
        finally:
            forget()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
