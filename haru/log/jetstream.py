"""What the JetStream log's parts share: one connection (`JetStreamClient`: the checked publish, the
single-message reads), the translation of nats-py's errors into Haru's, the publish-ack inbox, the
link listeners and the configuration of a history stream.

nats-py errors never escape haru.log: `translated` turns them into `haru.core.errors` exceptions
(httpx's map_httpcore_exceptions, in spirit).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
import structlog
from nats.js import api

from haru.core.errors import Conflict, EventDecodeError, LogError, LogUnavailable, StreamUnknown
from haru.core.receipts import Receipt
from haru.log.record import EXPECTED_LAST_SUBJECT_SEQ, MSG_ID

__all__ = [
    "AckInbox",
    "DEFAULT_REPLAY_TIMEOUT_S",
    "DUPLICATE_WINDOW_S",
    "CONFLICT_CODES",
    "IN_PROCESS",
    "JetStreamClient",
    "Link",
    "history_stream",
    "parse_ack_reply",
    "stream_state",
    "translated",
]

DUPLICATE_WINDOW_S = 120.0
CONFLICT_CODES = (10071, 10164)
# JSStreamDuplicateMessageConflict, "duplicate message id is in process": a retry of an append whose first copy
# (same Msg-Id) the stream leader is still proposing. Not a refusal: that copy may yet be stored, and asking again
# gets its acknowledgement (or, if it was dropped, stores this one) once the proposal is settled.
IN_PROCESS = 10158
DEFAULT_REPLAY_TIMEOUT_S = 300.0  # a non-follow replay's deadline unless the caller gives one
# how long a STREAM.INFO answered by a replica that knows no leader is asked again (stream_state)
LEADERLESS_RETRY_S = 2.0
NO_MESSAGE_FOUND = 10037  # JetStream's JSNoMessageFoundErr: the stream holds no such message


def holds_nothing(exc: BaseException) -> bool:
    """Whether nats-py's 404 says the stream holds no such message (JetStream's code 10037, or a direct
    get's 404 status, which has no code), and not that the server that answered knows no such stream
    (10059: never created, or a meta leader whose assignments lag after an election): only the first is
    an answer about the data. nats-py's KV get raises KeyNotFoundError for both; the API error it replaced is its
    __context__."""
    code = getattr(_answered(exc), "err_code", None)
    return code is None or code == NO_MESSAGE_FOUND


def _answered(exc: BaseException) -> BaseException:
    """The API error JetStream answered: `exc`, or the one nats-py's KV get replaced by KeyNotFoundError
    (only there: any other exception's __context__ is whatever its raiser was handling, e.g. a Conflict)."""
    if isinstance(exc, nats.js.errors.KeyNotFoundError) and isinstance(exc.__context__, nats.js.errors.APIError):
        return exc.__context__
    return exc


def not_an_answer(what: str, exc: BaseException) -> StreamUnknown:
    """The error for a 404 that is not "no such message" (`holds_nothing` False): never read as empty."""
    err = _answered(exc)
    said = f"{getattr(err, 'description', '')} (code {getattr(err, 'err_code', '?')})"
    return StreamUnknown(
        f"{what}: JetStream answered {said}: the server that answered does not know the stream: it was never "
        f"created (`haru up` creates it), or a new meta leader is catching up (it passes)"
    )


_log = structlog.get_logger("haru.log.eventlog")


class _PubAck(msgspec.Struct):
    """A JetStream publish ack: `{"stream", "seq", "duplicate"}`, or
    `{"error": {"code", "err_code", "description"}}`."""

    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: dict[str, Any] | None = None


_ack_decoder = msgspec.json.Decoder(_PubAck)


def parse_ack_reply(reply: str) -> tuple[int, int, int]:
    """(stream seq, timestamp ns, pending) from a JetStream delivery's reply subject.

    v1: $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
    v2: $JS.ACK.<domain>.<account>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>.<token>
    Parsing it is ~8 µs a message cheaper than msg.metadata (docs/design.md, "Facts the code relies on").
    """
    t = reply.split(".")
    if len(t) == 9:
        return int(t[5]), int(t[7]), int(t[8])
    return int(t[7]), int(t[9]), int(t[10])


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
    """Map nats-py exceptions onto Haru's (httpx's map_httpcore_exceptions, in spirit)."""
    try:
        yield
    except (LogError, EventDecodeError):
        raise
    except (
        nats.js.errors.NoStreamResponseError,
        nats.js.errors.ServiceUnavailableError,
        nats.errors.NoRespondersError,
    ) as exc:
        raise LogUnavailable(f"{what}: JetStream did not answer (no stream leader yet, or JetStream is off)") from exc
    except (TimeoutError, nats.errors.TimeoutError) as exc:
        raise LogUnavailable(f"{what}: timed out waiting for NATS") from exc
    except (
        nats.errors.ConnectionClosedError,
        nats.errors.ConnectionDrainingError,
        nats.errors.ConnectionReconnectingError,
    ) as exc:
        raise LogUnavailable(f"{what}: the NATS connection is closed or reconnecting") from exc
    except nats.js.errors.APIError as exc:
        raise LogError(f"{what}: JetStream refused: {exc.description} (code {exc.err_code})") from exc
    except nats.errors.Error as exc:
        raise LogError(f"{what}: {exc}") from exc


async def stream_state(
    js: Any, stream: str, *, subjects_filter: str | None = None, within_s: float = LEADERLESS_RETRY_S
) -> api.StreamInfo:
    """STREAM.INFO as the stream's leader answers it. JetStream lets every replica that knows no leader for
    its group answer this request with its own state (nats-server's jsStreamInfoRequest: a leaderless group),
    and the first answer wins: a replica back from a partition, still behind and not yet told who leads, says
    the stream ends where its copy ends, and a follower takes that for the log gone back. Such an answer
    (no leader in its cluster part) is no reading of the stream: asked again for `within_s`, then
    LogUnavailable, which callers retry as they do an election. Call inside `translated`."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        info: api.StreamInfo = await js.stream_info(stream, subjects_filter=subjects_filter)
        if info.cluster is None or info.cluster.leader:
            return info
        if asyncio.get_running_loop().time() >= deadline:
            raise LogUnavailable(
                f"{stream}: the server that answered knows no leader for it (an election, or a replica back from "
                f"a partition and still catching up), so its state may be behind the stream's: not read; retry"
            )
        await asyncio.sleep(0.2)


def history_stream(
    name: str, subject: str, replicas: int, description: str, *, atomic: bool = False
) -> api.StreamConfig:
    """A stream that keeps everything: file storage, no limit that drops history, no delete, no purge,
    no rollups, a 2-minute duplicate window, and direct gets for fast reads of a subject's last message;
    with `atomic`, atomic batch appends (nats-server >= 2.12: `append_batch`)."""
    return api.StreamConfig(
        name=name,
        subjects=[subject],
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE,
        max_msgs=-1,
        max_bytes=-1,
        max_age=0,
        max_msgs_per_subject=-1,
        discard=api.DiscardPolicy.OLD,
        duplicate_window=DUPLICATE_WINDOW_S,
        deny_delete=True,
        deny_purge=True,
        allow_rollup_hdrs=False,
        allow_direct=True,
        allow_atomic=atomic or None,
        num_replicas=replicas,
        description=description,
    )


class AckInbox:
    """Publish acks for appends, on one wildcard inbox subscription of this connection's own.

    What `nc.request` does, less its per-request costs that a busy writer pays on every append:
    a fresh NUID plus random bytes for the token (a counter does), a done-callback to drop the
    future from the map (a `finally` does), and `asyncio.wait_for` with its own timer in the loop's
    heap (one timer per 50 ms of deadlines does: appends that time out are failed by the timer of
    the slot their deadline falls in, up to 50 ms late). bench/eventlog.py's pipelined appends spend
    ~45 us of this process's CPU each, ~22 us of it in nats-py's request path.
    """

    _SLOT_S = 0.05

    def __init__(self, nc: nats.NATS) -> None:
        self.nc = nc
        self._prefix = ""
        self._waiting: dict[str, asyncio.Future[bytes]] = {}
        self._expiring: dict[int, set[asyncio.Future[bytes]]] = {}
        self._next = 0
        self._starting = asyncio.Lock()

    async def _start(self) -> None:
        async with self._starting:
            if not self._prefix:
                prefix = f"{self.nc.new_inbox()}."
                await self.nc.subscribe(prefix + "*", cb=self._on_ack)
                self._prefix = prefix

    async def _on_ack(self, msg: Any) -> None:
        future = self._waiting.get(msg.subject[len(self._prefix) :])
        if future is None or future.done():
            return  # it timed out, or the caller went away
        if msg.headers and msg.headers.get("Status") == "503":
            future.set_exception(nats.errors.NoRespondersError())
        else:
            future.set_result(msg.data)

    def _expire(self, slot: int) -> None:
        for future in self._expiring.pop(slot, ()):
            if not future.done():
                future.set_exception(nats.errors.TimeoutError())

    async def request(self, subject: str, data: bytes, headers: dict[str, str], timeout: float) -> bytes:
        """Publish with a reply inbox and return the reply's body; raises nats-py's TimeoutError,
        NoRespondersError and connection errors as `nc.request` does."""
        if not self._prefix:
            await self._start()
        loop = asyncio.get_running_loop()
        self._next += 1
        token = str(self._next)
        future: asyncio.Future[bytes] = loop.create_future()
        slot = int((loop.time() + timeout) / self._SLOT_S) + 1
        expiring = self._expiring.get(slot)
        if expiring is None:
            expiring = self._expiring[slot] = set()
            loop.call_at(slot * self._SLOT_S, self._expire, slot)
        expiring.add(future)
        self._waiting[token] = future
        try:
            await self.nc.publish(subject, data, reply=self._prefix + token, headers=headers)
            return await future
        finally:
            del self._waiting[token]
            expiring.discard(future)


class Link:
    """Who wants to know when the connection to NATS is lost and when it is back (nats-py's
    disconnected/reconnected callbacks, which exist before the EventLog does)."""

    def __init__(self) -> None:
        self.listeners: list[Callable[[bool], None]] = []

    def _tell(self, up: bool) -> None:
        for listener in list(self.listeners):
            try:
                listener(up)
            except Exception as exc:  # noqa: BLE001 - a listener's bug must not break the client
                _log.warning("eventlog.link_listener_failed", error=str(exc))

    async def down(self) -> None:
        self._tell(False)

    async def up(self) -> None:
        self._tell(True)


class JetStreamClient:
    """One connection to JetStream, as the log's parts (events, views, intents) share it: the checked
    publish with its retries, and single-message reads. `haru.log.eventlog.EventLog` composes the parts."""

    def __init__(
        self,
        nc: nats.NATS,
        *,
        writer: str,
        timeout: float = 5.0,
        replay_timeout: float = DEFAULT_REPLAY_TIMEOUT_S,
        link: Link | None = None,
    ) -> None:
        self.nc = nc
        self.replay_timeout = replay_timeout  # the deadline of a replay that does not follow
        self.js = nc.jetstream(timeout=timeout)
        self.writer = writer
        self.timeout = timeout
        # subject -> (last seq, sha256 of its body): what this writer knows without a read.
        self._tips: dict[str, tuple[int, str]] = {}
        # subject -> the last event this writer was acknowledged there (haru.core.receipts): unlike
        # _tips, never taken from a read, so a log that went back behind it has lost an acknowledged write.
        self._receipts: dict[str, Receipt] = {}
        self._kv: Any = None
        self._acks = AckInbox(nc)
        self._link = link if link is not None else Link()

    def on_link_change(self, listener: Callable[[bool], None]) -> Callable[[], None]:
        """Call `listener(False)` when the connection to NATS is lost and `listener(True)` when it
        is back (for watches that must not show the last state as if it were live). Returns a
        function that removes the listener. Only for logs made by `EventLog.open`/`connect`."""
        listeners = self._link.listeners
        listeners.append(listener)
        return lambda: listeners.remove(listener) if listener in listeners else None

    async def _publish(self, subject: str, data: bytes, headers: dict[str, str]) -> int:
        """What `js.publish` does, with the ack decoded by a prebuilt msgspec decoder instead of
        json.loads into a dataclass (the one part of an append's Python that cost more than the rest
        together). Errors are raised as nats-py raises them, so the callers' handling is the same."""
        try:
            reply = await self._acks.request(subject, data, headers, self.timeout)
        except nats.errors.NoRespondersError:
            raise nats.js.errors.NoStreamResponseError from None
        ack = _ack_decoder.decode(reply)
        if ack.error is not None:
            nats.js.errors.APIError.from_error(ack.error)  # raises the matching APIError subclass
        return ack.seq

    async def _get_seq(self, stream: str, seq: int, *, direct: bool = False) -> tuple[str, bytes] | None:
        """(subject, body) of the message at `seq`, None when there is none: from the stream's leader, or with
        `direct` from any replica (a stored message never changes, so any replica that holds it is right)."""
        with translated(f"reading sequence {seq}"):
            try:
                raw = await self.js.get_msg(stream, seq=seq, direct=direct)
            except nats.js.errors.NotFoundError as exc:
                if not holds_nothing(exc):
                    raise not_an_answer(f"reading sequence {seq}", exc) from exc
                return None
        return raw.subject or "", raw.data or b""

    async def _publish_checked(self, stream: str, subject: str, data: bytes, expect: int, mid: str) -> int:
        """Publish with the expected-sequence check; a lost ack whose message was stored is a success."""
        attempts = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(self.timeout * 2, 10.0)
        while True:
            attempts += 1
            # nats-py writes into the headers dict it is given: a fresh one per attempt
            # (docs/design.md, "Facts the code relies on").
            headers = {EXPECTED_LAST_SUBJECT_SEQ: str(expect), MSG_ID: mid}
            try:
                return await self._publish(subject, data, headers)
            except nats.js.errors.NoStreamResponseError as exc:
                # Not an APIError: the 503 while a stream leader is elected (3-6 s on R3, docs/design.md).
                if loop.time() >= deadline:
                    raise LogUnavailable(f"appending to {subject}: no stream leader answered in time") from exc
                await asyncio.sleep(min(0.25 * attempts, 1.0))
                continue
            except nats.js.errors.APIError as exc:
                if exc.err_code in CONFLICT_CODES:
                    last = await self._last_raw(stream, subject)
                    if last is not None and (last[2] or {}).get(MSG_ID) == mid:
                        return last[0]  # our own message, stored before the ack was lost
                    raise Conflict(subject, expect, None if last is None else last[0]) from exc
                if isinstance(exc, nats.js.errors.ServiceUnavailableError):
                    if loop.time() >= deadline:
                        raise LogUnavailable(f"appending to {subject}: no stream leader answered in time") from exc
                    await asyncio.sleep(min(0.25 * attempts, 1.0))
                    continue
                if exc.err_code == IN_PROCESS:
                    if loop.time() >= deadline:
                        raise LogUnavailable(
                            f"appending to {subject}: the stream leader still holds an earlier try of this append "
                            f"in process (JetStream {IN_PROCESS}); asking again later"
                        ) from exc
                    await asyncio.sleep(min(0.25 * attempts, 1.0))
                    continue
                raise LogError(
                    f"appending to {subject}: JetStream refused: {exc.description} (code {exc.err_code})"
                ) from exc
            except (TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
                # The ack may be lost while the message was stored: retry with the same Msg-Id.
                if loop.time() >= deadline:
                    raise LogUnavailable(f"appending to {subject}: timed out waiting for NATS") from exc
                await asyncio.sleep(min(0.1 * attempts, 1.0))
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError) as exc:
                if loop.time() >= deadline or self.nc.is_closed:
                    raise LogUnavailable(f"appending to {subject}: the NATS connection is closed") from exc
                await asyncio.sleep(0.25)

    # ----------------------------------------------------------------------------------- reads

    async def _last_raw(
        self, stream: str, subject: str, *, direct: bool = False
    ) -> tuple[int, bytes, dict[str, str] | None, datetime] | None:
        """The last message on `subject`: from the stream's leader, or with `direct` by a direct get whose
        request subject names `subject` ($JS.API.DIRECT.GET.<stream>.<subject>: permitted per subject)."""
        with translated(f"reading the last message on {subject}"):
            try:
                raw = await self.js.get_msg(stream, subject=subject, direct=direct)
            except nats.js.errors.NotFoundError as exc:
                if not holds_nothing(exc):
                    raise not_an_answer(f"reading the last message on {subject}", exc) from exc
                return None
        time = raw.time if isinstance(raw.time, datetime) else datetime.now(UTC)
        return raw.seq or 0, raw.data or b"", raw.headers, time
