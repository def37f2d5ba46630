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
While a client has a direct subscription, its protocol parser's `parse` is wrapped too: a `MSG` line
of a direct subscription at the head of the buffer is read with one split of the line and one copy of
the payload instead of nats-py's regex, state machine and two copies (~0.7-0.9 us a message, measured
back to back on one server); anything else (another operation, another subscription's message, one
with headers, a line or payload not complete yet) goes to nats-py's own `parse`, which goes on from
there, so messages keep the buffer's order (tests/unit/test_nats_direct_parser.py cuts the same bytes
at every position and compares with nats-py's parser alone).

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
            _log.error(
                "nats_direct.callback_failed", sid=sid, subject=subject.decode("utf-8", "replace"), error=repr(exc)
            )

    nc._process_msg = process_msg
    _wrap_parser(nc._ps, table)
    setattr(nc, _TABLE, table)
    return table


_MSG = b"MSG "
_CRLF = b"\r\n"
_AWAITING_CONTROL_LINE = 1  # nats.protocol.parser's state constant (nats-py 2.16.0)


def _wrap_parser(ps: Any, table: dict[int, DirectCallback]) -> None:
    """Read the `MSG` lines of direct subscriptions at the head of the buffer without nats-py's regex,
    state machine and double copy, and hand everything else (any other operation, a `MSG` for another
    subscription or with headers, a line or payload not complete yet, a line it does not read exactly
    as three or four fields) to nats-py's own `parse`, which carries on from there: the order of
    messages is the buffer's."""
    original = ps.parse

    async def parse(data: bytes = b"") -> None:
        buf = ps.buf  # read each time: nats-py's `reset` (a reconnect) makes a new one
        if data:
            buf.extend(data)
        while ps.state == _AWAITING_CONTROL_LINE and buf.startswith(_MSG):
            end = buf.find(_CRLF)
            if end < 0:
                break
            fields = bytes(buf[4:end]).split(b" ")
            if len(fields) == 3:
                subject, sid, size = fields
                reply = b""
            elif len(fields) == 4:
                subject, sid, reply, size = fields
            else:
                break
            if not sid.isdigit() or not size.isdigit():
                break
            callback = table.get(int(sid))
            if callback is None:
                break
            start = end + 2
            stop = start + int(size)
            if len(buf) < stop + 2:
                break
            payload = bytes(buf[start:stop])
            del buf[: stop + 2]
            try:
                callback(subject, reply, payload, None)
            except Exception as exc:  # noqa: BLE001 - never into nats-py's read loop, which would stop
                _log.error(
                    "nats_direct.callback_failed",
                    sid=int(sid),
                    subject=subject.decode("utf-8", "replace"),
                    error=repr(exc),
                )
        await original(b"")

    ps.parse = parse


def _release(nc: Any, table: dict[int, DirectCallback]) -> None:
    """Unwrap the client's `_process_msg` once its last direct subscription is stopped."""
    if not table and nc.__dict__.get(_TABLE) is table:
        del nc.__dict__[_TABLE]
        nc.__dict__.pop("_process_msg", None)  # the class's own methods again
        nc._ps.__dict__.pop("parse", None)


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
    if not raw or not raw.startswith(_HDR_LINE) or raw[len(_HDR_LINE) : len(_HDR_LINE) + 1] == b" ":
        return None
    body = raw[len(_HDR_LINE) + 2 :]
    if len(body) <= 2:
        return None
    try:
        parsed: dict[str, str] = nc._parse_header_lines(body)
    except Exception:  # noqa: BLE001 - nats-py logs it and hands the message on without headers too
        return None
    return parsed or None
