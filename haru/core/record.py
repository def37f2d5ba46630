"""What the log stores and how an append is named: `Record` (one stored message: its sequence, subject,
recorded time, body and decoded event), the body hash of the per-subject chain, and the deterministic id
of an append. Pure: the core's folds and checks read records, and both logs (haru/log/eventlog.py on
JetStream, haru/log/memory.py in memory) store and chain events through these same functions.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import TypeVar

import msgspec

from haru.core.errors import EventDecodeError
from haru.core.events import AnyEvent, Event, decode

E = TypeVar("E", bound=Event)

__all__ = ["Record", "body_hash", "datetime_to_ns", "decode_record", "msg_id", "with_absolute_cause"]


class Record(msgspec.Struct, frozen=True, gc=False):
    """One stored message: its stream sequence, subject, recorded time, raw body and decoded event.

    A frozen msgspec Struct rather than a frozen dataclass: a replay builds one per message, and
    a frozen dataclass's __init__ (one object.__setattr__ per field) cost ~0.8 us of the ~10 us a
    replayed message takes; this costs ~0.08 us. gc=False: a Record refers to no container that
    could refer back to it, so the collector need not track 100k of them during a replay.
    """

    seq: int
    subject: str
    time_ns: int  # when JetStream recorded it, ns since the epoch (the event's `at` is when the writer observed it)
    data: bytes
    event: AnyEvent | None  # None when the body is not a valid event
    error: str = ""  # why it is not, with msgspec's path
    headers: dict[str, str] | None = None

    @property
    def time(self) -> datetime:
        """When JetStream recorded it (computed on demand: replay hot paths rarely need it)."""
        return datetime.fromtimestamp(self.time_ns / 1e9, UTC)


def body_hash(data: bytes) -> str:
    """The chain link: `prev` of the next event on the same subject is this body's sha256."""
    return hashlib.sha256(data).hexdigest()


def msg_id(subject: str, expect: int, data: bytes) -> str:
    """The deterministic id of an append (its Nats-Msg-Id on JetStream): the same (subject, position, body) is the
    same event."""
    h = hashlib.sha256()
    h.update(subject.encode())
    h.update(b"\n%d\n" % expect)
    h.update(data)
    return h.hexdigest()[:40]


def decode_record(seq: int, subject: str, time_ns: int, data: bytes, headers: dict[str, str] | None) -> Record:
    """A Record whose body is decoded, or carries the decoder's error (with msgspec's path) when invalid."""
    try:
        event = decode(data)
    except EventDecodeError as exc:
        return Record(seq, subject, time_ns, data, None, str(exc), headers)
    except RecursionError:  # a body nested thousands deep: msgspec refuses it this way
        return Record(seq, subject, time_ns, data, None, "not a valid Haru event: nested too deeply to decode", headers)
    return Record(seq, subject, time_ns, data, with_absolute_cause(event, seq), "", headers)


def with_absolute_cause(event: E, seq: int) -> E:
    """The event stored at `seq` with its `cause` as an absolute sequence.

    A writer appending an atomic batch (`haru.log.seam.EventWriter.append_batch`) cannot know the
    sequence of an earlier record of the same batch, only that the batch is stored contiguously: it
    writes that record's position relative to its own, negative (-1: the record just before). Every
    read resolves it here, so no reader ever sees a relative cause."""
    if event.cause >= 0:
        return event
    return msgspec.structs.replace(event, cause=max(0, seq + event.cause))


def datetime_to_ns(t: datetime) -> int:
    return int(t.timestamp() * 1_000_000) * 1000
