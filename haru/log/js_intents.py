"""The intents part of the JetStream log: route intents on stream HARU_ROUTE (`haru.route.<fleet>`),
published with the fleet subject's expected sequence, read last, and watched."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from nats.js import api

from haru.core import subjects
from haru.log.jetstream import JetStreamClient, parse_ack_reply, translated
from haru.log.record import msg_id

__all__ = ["JetStreamIntents"]


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
        """The last intent of each matching fleet, then every new one, in order: (fleet, body, seq)."""
        subject = "haru.route.*" if fleet == "*" else subjects.intent(fleet)
        queue: asyncio.Queue[tuple[str, bytes, int]] = asyncio.Queue()

        async def on_msg(msg: Any) -> None:
            seq, _, _ = parse_ack_reply(msg.reply)
            queue.put_nowait((msg.subject.rsplit(".", 1)[1], msg.data, seq))

        with translated(f"watching route intents on {subject}"):
            sub = await self.js.subscribe(
                subject,
                cb=on_msg,
                stream=subjects.ROUTE_STREAM,
                ordered_consumer=True,
                deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
                pending_msgs_limit=-1,
                pending_bytes_limit=-1,
            )
        try:
            last_seq = 0
            while True:
                item = await queue.get()
                if item[2] <= last_seq:
                    continue  # redelivery after an ordered-consumer reset
                last_seq = item[2]
                yield item
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
