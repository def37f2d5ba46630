"""One subscription's messages handed straight from nats-py's read loop to a synchronous callback.

    sub = await subscribe_direct(nc, inbox, on_msg)    # None: this nats-py is not the one it was written for
    ...                                                 # on_msg(subject, reply, data, headers), all bytes
    await sub.unsubscribe()                             # sub.stop() stops the deliveries at once, without an await

Why. nats-py hands every delivered message to a subscription through `Client._process_msg`: it parses
the headers, builds a `Msg` (decoding the subject and reply to text), for a JetStream subscription parses
the reply subject again for its bookkeeping, and queues the message for the subscription's task, which
then calls the callback. For a replay that is most of what a message costs: a follower's catch-up read
this way drains bench/projector.py's 100k events 1.1-2.0x faster (median ~1.5x) than nats-py's ordered
consumer doing nothing with its messages (docs/performance.md). Here the callback gets the parser's raw
subject, reply, payload and header block and runs inside the read loop: no `Msg`, no queue, no task.

What the caller takes on. The callback must be synchronous, quick per message, and must not raise (an
exception is logged and the message dropped: nats-py's read loop would otherwise stop, and with it the
connection); flow control, heartbeats and statuses are its own business (haru/log/js_replay.py's
catch-up reader reads a pull consumer, which needs none of them). The connection's `in_msgs` statistics
do not count these messages. The wrapper is on the client only while it has a direct subscription (the
last one stopped puts nats-py's own method back), so the rest of its traffic pays nothing otherwise.

The version guard: `Client._process_msg(sid, subject, reply, data, headers)` is private to nats-py; it is
wrapped only on the exact nats-py this was written and tested against (`FOR_NATS_PY`); on any other
`subscribe_direct` returns None and the caller reads the ordinary way.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any

import structlog

__all__ = ["DirectCallback", "DirectSubscription", "FOR_NATS_PY", "direct_supported", "header_dict", "subscribe_direct"]

FOR_NATS_PY = "2.16.0"
DirectCallback = Callable[[bytes, bytes, bytes, "bytes | None"], None]  # subject, reply, payload, header block
_log = structlog.get_logger("haru.log.nats_direct")
_TABLE = "_haru_direct_subs"  # the attribute of a client holding {sid: callback}


def direct_supported() -> bool:
    """True when the installed nats-py is the one the wrapper was written against."""
    try:
        return importlib.metadata.version("nats-py") == FOR_NATS_PY
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - nats-py is a dependency
        return False


def _table(nc: Any) -> dict[int, DirectCallback]:
    """The client's table of direct subscriptions, its `_process_msg` wrapped while the table is not
    empty (`_release` unwraps it: the rest of the connection's traffic pays nothing outside a catch-up)."""
    table: dict[int, DirectCallback] | None = nc.__dict__.get(_TABLE)
    if table is not None:
        return table
    table = {}
    original = nc._process_msg

    async def process_msg(sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        callback = table.get(sid)
        if callback is None:
            await original(sid, subject, reply, data, headers)
            return
        try:
            callback(subject, reply, data, headers)
        except Exception as exc:  # noqa: BLE001 - never into nats-py's read loop, which would stop
            _log.error("nats_direct.callback_failed", sid=sid, subject=subject.decode("utf-8", "replace"),
                       error=repr(exc))

    nc._process_msg = process_msg
    setattr(nc, _TABLE, table)
    return table


def _release(nc: Any, table: dict[int, DirectCallback]) -> None:
    """Unwrap the client's `_process_msg` once its last direct subscription is stopped."""
    if not table and nc.__dict__.get(_TABLE) is table:
        del nc.__dict__[_TABLE]
        nc.__dict__.pop("_process_msg", None)  # the class's own method again


class DirectSubscription:
    """A subscription whose messages go to a callback from the read loop (see the module docstring)."""

    def __init__(self, nc: Any, sub: Any, table: dict[int, DirectCallback]) -> None:
        self.nc = nc
        self.sub = sub
        self.sid: int = sub._id
        self._table = table

    def stop(self) -> None:
        """No more deliveries to the callback from now on (what is still in flight is dropped)."""
        self._table.pop(self.sid, None)
        _release(self.nc, self._table)

    async def unsubscribe(self) -> None:
        self.stop()
        await self.sub.unsubscribe()


async def subscribe_direct(nc: Any, subject: str, callback: DirectCallback) -> DirectSubscription | None:
    """Subscribe `callback` to `subject` on `nc` (a nats-py client); None when this nats-py is not
    `FOR_NATS_PY` (then subscribe the ordinary way)."""
    if not direct_supported():
        return None
    table = _table(nc)
    sub = await nc.subscribe(subject)  # no callback: nats-py would queue its messages, the wrapper takes them first
    table[sub._id] = callback
    return DirectSubscription(nc, sub, table)


_HDR_LINE = b"NATS/1.0"


def header_dict(nc: Any, raw: bytes | None) -> dict[str, str] | None:
    """The headers of a stored message's header block, as nats-py's `Msg.headers` would have them (with the
    client's own line parser: haru/log/nats_headers.py's when enabled). Not for status messages."""
    if not raw or not raw.startswith(_HDR_LINE) or raw[len(_HDR_LINE):len(_HDR_LINE) + 1] == b" ":
        return None
    body = raw[len(_HDR_LINE) + 2:]
    if len(body) <= 2:
        return None
    try:
        parsed: dict[str, str] = nc._parse_header_lines(body)
    except Exception:  # noqa: BLE001 - nats-py logs it and hands the message on without headers too
        return None
    return parsed or None
