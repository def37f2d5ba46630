"""The control plane's own heartbeats: projectors and promoters say they are alive.

    task = asyncio.create_task(beat(log.bus, "promoter", identity)) # every INTERVAL_S, until cancelled
    heard = Heard(); await heard.listen(log.bus)                    # who is alive, by role and id
    heard.silent_s("promoter", "promoter:host-a")                   # None: never heard

Like the agents' `haru.hb.<fleet>.<domain>`, this is not history: core NATS, `haru.alive.<role>.<id>`
(the id escaped like a model id), body `{"role", "id", "pid"}`. Who beat is read from the subject, which
NATS permissions vouch for; the body is for people reading the bus. Who reads it:

- the gateway's `/healthz`: a role with no replica heard for `SILENT_AFTER_S` is down, and the
  gateway says `degraded` naming it;
- the gateway's holds: a hold whose estimate ran out waits on while a promoter is heard to drive the
  failover it waits for (haru/gateway/hold.py);
- the promoters: a step whose runner is silent for `SILENT_AFTER_S` was left by a dead replica and
  is taken over at once instead of after the step's lease (haru/promoter/drive.py).

A replica beats from a task of its own, so a replica whose event loop is wedged falls silent too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import msgspec
import structlog

from haru.core import subjects
from haru.core.errors import BusError
from haru.log.bus import Bus, Msg, Subscription

INTERVAL_S = 1.0
SILENT_AFTER_S = 3.5


class Beat(msgspec.Struct, frozen=True):
    role: str
    id: str
    pid: int = 0


_encode = msgspec.json.Encoder().encode
_log = structlog.get_logger("haru.host.alive")


async def beat(bus: Bus, role: str, identity: str, interval: float = INTERVAL_S) -> None:
    """Publish this replica's heartbeat on the bus every `interval` seconds until cancelled."""
    identity = identity or role
    subject = subjects.alive(role, identity)
    body = _encode(Beat(role=role, id=identity, pid=os.getpid()))
    while True:
        try:
            await bus.publish(subject, body)
        except BusError:
            pass  # NATS away: nats-py buffers or refuses; the next beat retries
        except Exception:  # a bug: say it with its traceback, keep beating
            _log.exception("alive.beat_failed", role=role, id=identity)
        await asyncio.sleep(interval)


class Heard:
    """The last time each (role, id) was heard, by this process's monotonic clock."""

    def __init__(self) -> None:
        self.last: dict[tuple[str, str], float] = {}
        self.since = time.monotonic()
        self._sub: Subscription | None = None

    async def listen(self, bus: Bus, subject: str = subjects.ALL_ALIVE) -> None:
        def on_msg(msg: Msg) -> None:
            self.heard(msg.subject)

        self.since = time.monotonic()
        self._sub = await bus.subscribe(subject, on_msg)

    def listening(self) -> bool:
        return self._sub is not None

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def heard(self, subject: str) -> None:
        """A beat on `subject`: who beat is read from the subject (what NATS permissions vouch for), never
        from the body."""
        who = subjects.alive_of(subject)
        if who is not None:
            self.last[who] = time.monotonic()

    def silent_s(self, role: str, identity: str) -> float | None:
        """Seconds since `identity` was last heard; None if never heard since listening began."""
        seen = self.last.get((role, identity))
        return None if seen is None else time.monotonic() - seen

    def listening_s(self) -> float:
        return time.monotonic() - self.since

    def alive(self, role: str, within_s: float = SILENT_AFTER_S) -> list[str]:
        """Ids of `role` heard within `within_s`."""
        now = time.monotonic()
        return sorted(i for (r, i), t in self.last.items() if r == role and now - t <= within_s)

    def ages(self, role: str, within_s: float = SILENT_AFTER_S) -> list[float]:
        """Seconds since each replica of `role` heard within `within_s` was last heard."""
        now = time.monotonic()
        return [now - t for (r, _), t in self.last.items() if r == role and now - t <= within_s]

    def last_heard_s(self, role: str) -> float | None:
        """Seconds since any replica of `role` was heard (None: never)."""
        times = [t for (r, _), t in self.last.items() if r == role]
        return None if not times else time.monotonic() - max(times)
