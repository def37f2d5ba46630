"""The event log: the only module that speaks JetStream for events, views and route intents.

    async with EventLog.connect(["nats://127.0.0.1:4222"], writer="agent:default/a") as log:
        await log.ensure()
        seq = await log.append(subjects.model("default", "a", "qwen3.6:27b"), event, expect=last_seq)

Every append is optimistic and sequence-checked (`Nats-Expected-Last-Subject-Sequence`), carries a
deterministic `Nats-Msg-Id` (sha256 of subject, expected sequence and body, so a retry after a lost
ack is not a second event), and extends the subject's hash chain (`prev` = sha256 of the previous
body on the subject). A lost race raises `Conflict` with the subject's current sequence.

nats-py errors never escape this module: they become `haru.core.errors` exceptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import msgspec
import nats
import structlog
import nats.errors
import nats.js.errors
from nats.js import api

from haru.core import subjects
from haru.core.errors import (Conflict, EventDecodeError, LogDamaged, LogError, LogUnavailable, ReplayTimeout,
                         seq_ranges)
from haru.core.events import AnyEvent, Event, decode, encode

if TYPE_CHECKING:
    from haru.log.bus import NatsBus
    from haru.log.follow import Follower

EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
MSG_ID = "Nats-Msg-Id"
DUPLICATE_WINDOW_S = 120.0
_CONFLICT_CODES = (10071, 10164)
_FIRST_CONNECT_ATTEMPTS = 1  # nats-py: a server is dropped after this many failed retries (so: 2 tries)
_FIRST_CONNECT_WAIT_S = 0.05  # between those tries
_RECONNECT_WAIT_S = 0.5  # between reconnect attempts once connected
_STALL_CHECK_S = 0.5  # a non-follow replay without progress this long asks its consumer whether it is done
DEFAULT_REPLAY_TIMEOUT_S = 300.0  # a non-follow replay's deadline unless the caller gives one
_SUBJECTS_PAGE = 100_000  # nats-server's limit on the subjects one stream-info answer lists
# The decoder of haru.core.events.decode (same type, no hooks), called directly on the replay's hot path;
# a body it refuses goes through haru.core.events.decode for the error text.
_event_decoder = msgspec.json.Decoder(AnyEvent)
_log = structlog.get_logger("haru.log.eventlog")


class _PubAck(msgspec.Struct):
    """A JetStream publish ack: `{"stream", "seq", "duplicate"}`, or `{"error": {"code", "err_code", "description"}}`."""

    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: dict[str, Any] | None = None


_ack_decoder = msgspec.json.Decoder(_PubAck)


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
        return datetime.fromtimestamp(self.time_ns / 1e9, timezone.utc)


def _ignore(rec: Record) -> None:
    return None


def body_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def msg_id(subject: str, expect: int, data: bytes) -> str:
    """The deterministic Nats-Msg-Id of an append: the same (subject, position, body) is the same event."""
    h = hashlib.sha256()
    h.update(subject.encode())
    h.update(b"\n%d\n" % expect)
    h.update(data)
    return h.hexdigest()[:40]


def _decode_record(seq: int, subject: str, time_ns: int, data: bytes, headers: dict[str, str] | None) -> Record:
    try:
        event = decode(data)
    except EventDecodeError as exc:
        return Record(seq, subject, time_ns, data, None, str(exc), headers)
    except RecursionError:  # a body nested thousands deep: msgspec refuses it this way
        return Record(seq, subject, time_ns, data, None, "not a valid Haru event: nested too deeply to decode", headers)
    return Record(seq, subject, time_ns, data, event, "", headers)


def _datetime_to_ns(t: datetime) -> int:
    return int(t.timestamp() * 1_000_000) * 1000


def _parse_ack_reply(reply: str) -> tuple[int, int, int]:
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
def _translated(what: str) -> Iterator[None]:
    """Map nats-py exceptions onto Haru's (httpx's map_httpcore_exceptions, in spirit)."""
    try:
        yield
    except (LogError, EventDecodeError):
        raise
    except (nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError) as exc:
        raise LogUnavailable(f"{what}: JetStream did not answer (no stream leader yet, or JetStream is off)") from exc
    except (nats.errors.TimeoutError, asyncio.TimeoutError) as exc:
        raise LogUnavailable(f"{what}: timed out waiting for NATS") from exc
    except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError, nats.errors.ConnectionReconnectingError) as exc:
        raise LogUnavailable(f"{what}: the NATS connection is closed or reconnecting") from exc
    except nats.js.errors.APIError as exc:
        raise LogError(f"{what}: JetStream refused: {exc.description} (code {exc.err_code})") from exc
    except nats.errors.Error as exc:
        raise LogError(f"{what}: {exc}") from exc


def _history_stream(name: str, subject: str, replicas: int, description: str) -> api.StreamConfig:
    """A stream that keeps everything: file storage, no limit that drops history, no delete, no purge,
    no rollups, a 2-minute duplicate window, and direct gets for fast reads of a subject's last message."""
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
        num_replicas=replicas,
        description=description,
    )


class _AckInbox:
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
        future = self._waiting.get(msg.subject[len(self._prefix):])
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


class _Link:
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


class EventLog:
    """A connection to the log. Create with `EventLog.connect(...)` (async context) or `EventLog.open`."""

    def __init__(self, nc: nats.NATS, *, writer: str, timeout: float = 5.0,
                 replay_timeout: float = DEFAULT_REPLAY_TIMEOUT_S, link: "_Link | None" = None) -> None:
        self.nc = nc
        self.replay_timeout = replay_timeout  # the deadline of a replay that does not follow
        self.js = nc.jetstream(timeout=timeout)
        self.writer = writer
        self.timeout = timeout
        # subject -> (last seq, sha256 of its body): what this writer knows without a read.
        self._tips: dict[str, tuple[int, str]] = {}
        self._kv: Any = None
        self._acks = _AckInbox(nc)
        self._link = link if link is not None else _Link()
        self._bus: "NatsBus | None" = None

    # ------------------------------------------------------------------------ connection state

    def on_link_change(self, listener: Callable[[bool], None]) -> Callable[[], None]:
        """Call `listener(False)` when the connection to NATS is lost and `listener(True)` when it
        is back (for watches that must not show the last state as if it were live). Returns a
        function that removes the listener. Only for logs made by `open`/`connect`."""
        listeners = self._link.listeners
        listeners.append(listener)
        return lambda: listeners.remove(listener) if listener in listeners else None

    @property
    def connected(self) -> bool:
        return bool(self.nc.is_connected)

    def server_urls(self) -> list[str]:
        """The NATS servers this connection knows (for messages that say where it is connected)."""
        return [u.geturl() for u in self.nc.servers]

    @property
    def bus(self) -> "NatsBus":
        """Core NATS on this log's connection (heartbeats, liveness, commands): haru.log.bus."""
        if self._bus is None:
            from haru.log.bus import NatsBus

            self._bus = NatsBus(self.nc)
        return self._bus

    # ------------------------------------------------------------------------------- connection

    @classmethod
    async def open(
        cls,
        servers: list[str] | str,
        *,
        writer: str,
        creds: str | None = None,
        name: str | None = None,
        timeout: float = 5.0,
        connect_timeout: float = 5.0,
        replay_timeout: float = DEFAULT_REPLAY_TIMEOUT_S,
    ) -> "EventLog":
        if isinstance(servers, str):
            servers = [s.strip() for s in servers.split(",") if s.strip()]

        first_errors: list[BaseException] = []  # what the first connection's attempts ran into

        async def _quiet(exc: Exception) -> None:
            if len(first_errors) < 16:
                first_errors.append(exc)
            # Reconnect noise is expected while a server restarts; anything else (a permissions
            # violation, a slow consumer) is worth a line in the service's log.
            if isinstance(exc, (OSError, asyncio.TimeoutError, nats.errors.UnexpectedEOF,
                                nats.errors.StaleConnectionError, nats.errors.ConnectionClosedError)):
                return
            _log.warning("nats.error", writer=writer, error=str(exc) or type(exc).__name__)

        link = _Link()
        # The first connection tries each server twice, 50 ms apart, and gives up: with
        # `max_reconnect_attempts=-1` nats-py's connect() loops over refused servers until our
        # timeout (every CLI command waited the whole connect_timeout, ~5.5 s, to say NATS was
        # down). Once connected, the client reconnects forever (the options are read at each
        # reconnect).
        kwargs: dict[str, Any] = dict(
            servers=servers,
            name=name or writer,
            connect_timeout=min(2.0, connect_timeout),
            allow_reconnect=True,
            max_reconnect_attempts=_FIRST_CONNECT_ATTEMPTS,
            reconnect_time_wait=_FIRST_CONNECT_WAIT_S,
            error_cb=_quiet,
            disconnected_cb=link.down,
            reconnected_cb=link.up,
        )
        if creds:
            kwargs["user_credentials"] = creds
        try:
            async with asyncio.timeout(connect_timeout):
                nc = await nats.connect(**kwargs)
        except (asyncio.TimeoutError, nats.errors.NoServersError, OSError) as exc:
            seen = first_errors or [exc]
            if all(isinstance(e, ConnectionRefusedError) for e in seen):
                why = "connection refused"
            elif any(isinstance(e, (asyncio.TimeoutError, nats.errors.TimeoutError)) for e in seen):
                why = "no answer"
            else:
                why = str(seen[-1]) or type(seen[-1]).__name__
            raise LogUnavailable(
                f"cannot reach NATS at {', '.join(servers)} ({why}): start it (`haru up` runs one) "
                f"or pass --nats-url / set HARU_NATS_URL"
            ) from exc
        except nats.errors.Error as exc:
            raise LogUnavailable(f"cannot connect to NATS at {', '.join(servers)}: {exc}") from exc
        nc.options["max_reconnect_attempts"] = -1
        nc.options["reconnect_time_wait"] = _RECONNECT_WAIT_S
        return cls(nc, writer=writer, timeout=timeout, replay_timeout=replay_timeout, link=link)

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, servers: list[str] | str, *, writer: str, **kwargs: Any) -> AsyncIterator["EventLog"]:
        log = await cls.open(servers, writer=writer, **kwargs)
        try:
            yield log
        finally:
            await log.close()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.nc.drain()
        with contextlib.suppress(Exception):
            await self.nc.close()

    # -------------------------------------------------------------------------------- streams

    def cluster_size(self) -> int:
        """How many servers the connected one says its cluster has (1 when standalone)."""
        info = getattr(self.nc, "_server_info", None) or {}
        if not info.get("cluster"):
            return 1
        return max(1, len(set(info.get("connect_urls") or [])))

    async def ensure(self, *, replicas: int | None = None) -> None:
        """Create (or check and update) HARU_EVENTS, HARU_ROUTE and the KV bucket haru_views.

        `replicas` defaults to 3 on a cluster of three or more servers, else 1: a stream created
        unreplicated on a cluster would quietly lose the point of the cluster. An existing stream
        keeps its replicas (changing them is an operator's decision).
        """
        if replicas is None:
            replicas = 3 if self.cluster_size() >= 3 else 1
        events = _history_stream(
            subjects.EVENTS_STREAM, subjects.ALL_EVENTS, replicas,
            "Haru event log: every fact, hash-chained per subject. Never deleted, never purged.",
        )
        route = _history_stream(
            subjects.ROUTE_STREAM, subjects.ALL_INTENTS, replicas,
            "Haru route intents per fleet, history kept per subject.",
        )
        for config in (events, route):
            await self._ensure_stream(config)
        with _translated("ensuring the KV bucket haru_views"):
            try:
                self._kv = await self.js.key_value(subjects.VIEWS_BUCKET)
            except nats.js.errors.BucketNotFoundError:
                self._kv = await self.js.create_key_value(
                    bucket=subjects.VIEWS_BUCKET,
                    description="Haru fleet views, written with compare-and-swap by projectors",
                    history=1,
                    storage=api.StorageType.FILE,
                    replicas=replicas,
                )

    async def _ensure_stream(self, config: api.StreamConfig) -> None:
        with _translated(f"ensuring stream {config.name}"):
            try:
                info = await self.js.stream_info(config.name or "")
            except nats.js.errors.NotFoundError:
                await self.js.add_stream(config)
                return
            have = info.config
            drift = (
                have.subjects != config.subjects
                or have.duplicate_window != config.duplicate_window
                or have.allow_direct != config.allow_direct
                or bool(have.deny_delete) != bool(config.deny_delete)
                or bool(have.deny_purge) != bool(config.deny_purge)
                or (have.max_age or 0) != 0
                or (have.max_msgs or -1) != -1
                or (have.max_bytes or -1) != -1
                or (have.max_msgs_per_subject or -1) != -1
            )
            if drift:
                config.num_replicas = have.num_replicas  # changing replicas is an operator's decision
                try:
                    await self.js.update_stream(config)
                except nats.js.errors.APIError as exc:
                    raise LogError(
                        f"stream {config.name} exists with settings Haru cannot accept ({exc.description}); "
                        f"an admin must fix it with `nats stream edit {config.name}`"
                    ) from exc

    async def last_seq(self) -> int:
        """The event stream's last sequence (0 when empty)."""
        with _translated("reading the event stream's state"):
            info = await self.js.stream_info(subjects.EVENTS_STREAM)
        return info.state.last_seq

    async def last_seq_matching(self, subject_filter: str) -> int:
        """The last sequence of any event subject matching the filter (wildcards allowed; 0 when none)."""
        if subject_filter == subjects.ALL_EVENTS:
            return await self.last_seq()
        last = await self._last_raw(subjects.EVENTS_STREAM, subject_filter)
        return 0 if last is None else last[0]

    def follower(self, handler: Callable[[Record], Any | Awaitable[Any]], *, from_seq: int = 1, **kwargs: Any) -> "Follower":
        """A `haru.log.follow.Follower` of this log: catch-up, stall detection, reconnect and resume
        (`kwargs`: its `subject_filter`, `headers`, `name`, `stall_interval`, `stall_checks`, `busy`...)."""
        from haru.log.follow import Follower

        return Follower(self, handler, from_seq=from_seq, **kwargs)

    async def follow(self, handler: Callable[[Record], Any | Awaitable[Any]], *, from_seq: int = 1, **kwargs: Any) -> None:
        """Follow the log from `from_seq` until cancelled (`follower(...).run()`)."""
        await self.follower(handler, from_seq=from_seq, **kwargs).run()

    async def subject_counts(self, subject_filter: str = subjects.ALL_EVENTS) -> dict[str, int]:
        """The event subjects matching the filter that hold messages, with how many each.

        One stream-info request (~0.5 ms) instead of reading the messages (a filtered replay of a
        100k-event stream takes 2-11 ms). The server lists at most _SUBJECTS_PAGE subjects per
        answer and nats-py cannot ask for the next page: a list that long is counted from a replay.
        """
        with _translated(f"listing the subjects {subject_filter}"):
            info = await self.js.stream_info(subjects.EVENTS_STREAM, subjects_filter=subject_filter)
        found = dict(info.state.subjects or {})
        if len(found) < _SUBJECTS_PAGE:
            return found
        counts: dict[str, int] = {}

        def count(rec: Record) -> None:
            counts[rec.subject] = counts.get(rec.subject, 0) + 1

        await self.replay(count, subject_filter=subject_filter, headers=False)
        return counts

    # --------------------------------------------------------------------------------- append

    async def append(self, subject: str, event: Event, *, expect: int) -> int:
        """Append `event` to `subject` if the subject's last sequence is `expect` (0 = empty).

        Fills `prev` (the hash chain) and `by` (when empty). Returns the new stream sequence.
        Raises Conflict(current) when another writer got there first. Retrying an append whose
        ack was lost returns the stored message's sequence instead of writing a second event.
        """
        tip = self._tips.get(subject)
        stored_last: tuple[int, bytes, dict[str, str] | None, datetime] | None = None
        if expect == 0:
            prev = ""
        elif tip is not None and tip[0] == expect:
            prev = tip[1]
        else:
            stored_last = await self._last_raw(subjects.EVENTS_STREAM, subject)
            if stored_last is None:
                raise Conflict(subject, expect, 0)
            if stored_last[0] == expect:
                prev = body_hash(stored_last[1])
            else:
                at_expect = await self._get_seq(subjects.EVENTS_STREAM, expect)
                if at_expect is None or at_expect[0] != subject:
                    raise Conflict(subject, expect, stored_last[0])
                prev = body_hash(at_expect[1])
        if event.prev != prev or not event.by:
            event = msgspec.structs.replace(event, prev=prev, by=event.by or self.writer)
        data = encode(event)
        mid = msg_id(subject, expect, data)
        if stored_last is not None and stored_last[0] != expect:
            # The subject moved past `expect`: ours (a retry after a lost ack) or someone else's?
            if (stored_last[2] or {}).get(MSG_ID) == mid:
                self._tips[subject] = (stored_last[0], body_hash(stored_last[1]))
                return stored_last[0]
            raise Conflict(subject, expect, stored_last[0])
        seq = await self._publish_checked(subjects.EVENTS_STREAM, subject, data, expect, mid)
        self._tips[subject] = (seq, body_hash(data))
        return seq

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

    async def _get_seq(self, stream: str, seq: int) -> tuple[str, bytes] | None:
        with _translated(f"reading sequence {seq}"):
            try:
                raw = await self.js.get_msg(stream, seq=seq)
            except nats.js.errors.NotFoundError:
                return None
        return raw.subject or "", raw.data or b""

    async def _publish_checked(self, stream: str, subject: str, data: bytes, expect: int, mid: str) -> int:
        """Publish with the expected-sequence check; a lost ack whose message was stored is a success."""
        attempts = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(self.timeout * 2, 10.0)
        while True:
            attempts += 1
            # nats-py writes into the headers dict it is given: a fresh one per attempt (docs/design.md, "Facts the code relies on").
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
                if exc.err_code in _CONFLICT_CODES:
                    last = await self._last_raw(stream, subject)
                    if last is not None and (last[2] or {}).get(MSG_ID) == mid:
                        return last[0]  # our own message, stored before the ack was lost
                    raise Conflict(subject, expect, None if last is None else last[0]) from exc
                if isinstance(exc, nats.js.errors.ServiceUnavailableError):
                    if loop.time() >= deadline:
                        raise LogUnavailable(f"appending to {subject}: no stream leader answered in time") from exc
                    await asyncio.sleep(min(0.25 * attempts, 1.0))
                    continue
                raise LogError(f"appending to {subject}: JetStream refused: {exc.description} (code {exc.err_code})") from exc
            except (nats.errors.TimeoutError, asyncio.TimeoutError, nats.errors.NoRespondersError) as exc:
                # The ack may be lost while the message was stored: retry with the same Msg-Id.
                if loop.time() >= deadline:
                    raise LogUnavailable(f"appending to {subject}: timed out waiting for NATS") from exc
                await asyncio.sleep(min(0.1 * attempts, 1.0))
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError) as exc:
                if loop.time() >= deadline or self.nc.is_closed:
                    raise LogUnavailable(f"appending to {subject}: the NATS connection is closed") from exc
                await asyncio.sleep(0.25)

    # ----------------------------------------------------------------------------------- reads

    async def _last_raw(self, stream: str, subject: str) -> tuple[int, bytes, dict[str, str] | None, datetime] | None:
        with _translated(f"reading the last message on {subject}"):
            try:
                raw = await self.js.get_msg(stream, subject=subject)
            except nats.js.errors.NotFoundError:
                return None
        time = raw.time if isinstance(raw.time, datetime) else datetime.now(timezone.utc)
        return raw.seq or 0, raw.data or b"", raw.headers, time

    async def last(self, subject: str) -> Record | None:
        """The last event on `subject`, or None when the subject is empty."""
        last = await self._last_raw(subjects.EVENTS_STREAM, subject)
        if last is None:
            return None
        seq, data, headers, time = last
        self._tips[subject] = (seq, body_hash(data))
        return _decode_record(seq, subject, _datetime_to_ns(time), data, headers)

    async def last_seq_of(self, subject: str) -> int:
        """The last sequence on `subject` (0 when empty): what to pass as `expect`."""
        rec = await self.last(subject)
        return 0 if rec is None else rec.seq

    async def history(self, subject_filter: str = subjects.ALL_EVENTS, *, from_seq: int = 1, **kwargs: Any) -> list[Record]:
        """Every stored event matching the filter, from `from_seq`, in order (`kwargs`: `replay`'s
        `timeout` and `strict`). On `LogDamaged` the records read are in the exception's `records`."""
        out: list[Record] = []
        try:
            await self.replay(out.append, from_seq=from_seq, subject_filter=subject_filter, **kwargs)
        except LogDamaged as exc:
            exc.records = out  # what could be read, for a caller that shows it with the damage
            raise
        return out

    async def tail(self, subject_filter: str, limit: int, **kwargs: Any) -> list[Record]:
        """The last `limit` stored events matching the filter, oldest first, without reading the
        stream from its start: windows back from the end, four times wider each time, until one holds
        `limit` matches or reaches sequence 1 (`kwargs`: `history`'s)."""
        last = await self.last_seq()
        window = max(4 * limit, 256)
        while True:
            start = max(1, last - window + 1)
            records = await self.history(subject_filter, from_seq=start, **kwargs)
            if len(records) >= limit or start == 1:
                return records[-limit:] if limit else records
            window *= 4

    async def replay(
        self,
        handler: Callable[[Record], Any | Awaitable[Any]],
        *,
        from_seq: int = 1,
        subject_filter: str = subjects.ALL_EVENTS,
        follow: bool = False,
        headers: bool = True,
        timeout: float | None = None,
        strict: bool = False,
        on_gap: Callable[[list[int]], Any] | None = None,
    ) -> int:
        """Call `handler(record)` for each stored message matching the filter, in order.

        Built on an ordered push consumer with a callback (the fastest drain nats-py has).
        Without `follow` it returns once it has handled what was stored when it started; with
        `follow` it goes on with new messages until cancelled. Returns the last sequence handled
        (from_seq - 1 when nothing matched). An exception from the handler stops the replay and
        is raised here.

        A replay never hangs on a damaged store and never passes over a hole in silence
        (docs/operations.md, "Damaged or truncated log"). The stream denies deletes and purges
        and has no limits, so its sequences are dense: a hole is damage.

        - Without `follow` it ends within `timeout` seconds (default: the log's `replay_timeout`)
          or raises `ReplayTimeout`. When a stored message cannot be read (a flipped byte in a
          block file), nats-server skips it but still counts it as pending, so the last delivery
          never says "0 pending": a check every `_STALL_CHECK_S` without progress asks the
          consumer, and when the server has nothing more to send the replay ends.
        - Unfiltered (`haru.evt.>`), every sequence must follow the one before: a jump is a hole.
          Filtered, the sequences in between belong to other subjects, so holes are found from
          the counts instead: messages the consumer counted but never delivered, or (`strict`)
          messages the stream state says it lacks (first..last minus the messages it holds).
          Either way an unfiltered, header-only scan of the range names the sequences.
        - Without `follow`, holes raise `LogDamaged` (with the sequence numbers) after the
          handler has seen every readable event. With `follow`, each hole found is passed to
          `on_gap(seqs)` (default: an error in the log) and following goes on.
        """
        unfiltered = subject_filter == subjects.ALL_EVENTS
        loop = asyncio.get_running_loop()
        last_handled = from_seq - 1
        finished: asyncio.Future[None] = loop.create_future()
        is_async = inspect.iscoroutinefunction(handler)
        gaps: list[tuple[int, int]] = []  # (first, last) missing, inclusive
        last_tokens: list[str] = []  # the reply subject tokens of the last message handled
        if on_gap is None:
            def on_gap(seqs: list[int]) -> None:
                _log.error("eventlog.unreadable_sequences", seqs=seq_ranges(seqs), filter=subject_filter,
                           fix="restore the store from a backup or a cluster peer (docs/operations.md)")

        budget = self.replay_timeout if timeout is None else timeout
        deadline = None if budget is None else loop.time() + budget  # None: no deadline (asked for)

        def too_late() -> ReplayTimeout:
            end = "unknown" if stream_state is None else stream_state.last_seq
            return ReplayTimeout(
                f"replaying {subject_filter} from {from_seq}: not finished after {budget:g} s (read up to "
                f"seq {last_handled}, the stream ends at {end}); NATS is slow or unreachable: "
                f"retry, or allow longer with --timeout / HARU_REPLAY_TIMEOUT"
            )

        stream_state = None
        if not follow:
            try:
                async with asyncio.timeout_at(deadline):
                    with _translated("reading the event stream's state"):
                        stream_state = (await self.js.stream_info(subjects.EVENTS_STREAM)).state
            except TimeoutError:
                raise too_late() from None

        # The hot path of every follower (~100k messages/s): _parse_ack_reply and _decode_record
        # inlined, the pending count compared as text (the server writes it without leading zeros).
        decode_event = _event_decoder.decode
        invalid = (msgspec.DecodeError, RecursionError)  # ValidationError is a subclass of DecodeError

        async def on_msg(msg: Any) -> None:
            nonlocal last_handled, last_tokens
            if finished.done():
                return
            try:
                t = msg.reply.split(".")
                if len(t) == 9:  # v1: $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
                    seq, ts, drained = int(t[5]), t[7], t[8] == "0"
                else:  # v2: $JS.ACK.<domain>.<account>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>.<token>
                    seq, ts, drained = int(t[7]), t[9], t[10] == "0"
                if seq <= last_handled:
                    return  # redelivered after an ordered-consumer reset
                if unfiltered and seq != last_handled + 1:
                    gaps.append((last_handled + 1, seq - 1))
                    if follow:
                        on_gap(list(range(last_handled + 1, seq)))
                data = msg.data
                try:
                    rec = Record(seq, msg.subject, int(ts), data, decode_event(data), "", msg.headers if headers else None)
                except invalid:  # not a valid event: the slow path, for haru.core.events.decode's error text
                    rec = _decode_record(seq, msg.subject, int(ts), data, msg.headers if headers else None)
                if is_async:
                    await handler(rec)
                else:
                    handler(rec)
                last_handled = seq
                last_tokens = t
                if drained and not follow:
                    finished.set_result(None)
            except BaseException as exc:  # the handler's failure ends the replay, raised to the caller
                if not finished.done():
                    finished.set_exception(exc)

        if from_seq <= 1:
            policy, start = api.DeliverPolicy.ALL, None
        else:
            policy, start = api.DeliverPolicy.BY_START_SEQUENCE, from_seq
        config = api.ConsumerConfig(opt_start_seq=start, headers_only=False)
        try:
            async with asyncio.timeout_at(None if follow else deadline):
                with _translated(f"replaying {subject_filter} from {from_seq}"):
                    sub = await self.js.subscribe(
                        subject_filter,
                        cb=on_msg,
                        stream=subjects.EVENTS_STREAM,
                        ordered_consumer=True,
                        deliver_policy=policy,
                        config=config,
                        pending_msgs_limit=-1,
                        pending_bytes_limit=-1,
                    )
        except TimeoutError:
            raise too_late() from None
        first_pending = 0
        watchdog: asyncio.Task[None] | None = None
        try:
            if follow:
                await finished
                return last_handled
            async with asyncio.timeout_at(deadline):
                with _translated("reading the replay consumer"):
                    info = await sub.consumer_info()
            first_pending = (info.num_pending or 0) + ((info.delivered.consumer_seq or 0) if info.delivered else 0)
            if info.num_pending == 0 and (info.delivered is None or not info.delivered.consumer_seq):
                if not finished.done():
                    finished.set_result(None)
            watchdog = asyncio.create_task(self._end_of_replay(sub, finished, lambda: last_tokens))
            async with asyncio.timeout_at(deadline):
                await finished
        except TimeoutError:
            failure = finished.exception() if finished.done() and not finished.cancelled() else None
            if failure is not None:
                raise failure from None
            raise too_late() from None
        finally:
            if watchdog is not None:
                watchdog.cancel()
                with contextlib.suppress(BaseException):
                    await watchdog
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

        # What the consumer counted but never delivered (messages it could not read).
        if last_tokens:
            undelivered = int(last_tokens[8] if len(last_tokens) == 9 else last_tokens[10])
        else:
            undelivered = first_pending
        assert stream_state is not None
        end = stream_state.last_seq
        first = stream_state.first_seq if stream_state.messages else end + 1
        span = max(0, end - max(from_seq, 1) + 1)
        holes_in_state = max(0, end - first + 1 - stream_state.messages) + max(0, min(first, end + 1) - max(from_seq, 1))
        missing: list[int] = []
        if unfiltered:
            for a, b in gaps:
                missing.extend(range(a, b + 1))
            if last_handled < end:  # the newest sequences the stream has could not be read
                missing.extend(range(max(last_handled + 1, from_seq), end + 1))
        elif span and (undelivered > 0 or (strict and holes_in_state > 0)):
            try:
                await self.replay(_ignore, from_seq=from_seq, headers=False, timeout=None if deadline is None else max(0.1, deadline - loop.time()))
            except LogDamaged as exc:
                missing = [q for q in exc.missing if q <= end]
        if not missing and not undelivered:
            return last_handled
        where = f"{subject_filter} from seq {from_seq}" if from_seq > 1 else subject_filter
        if missing:
            what = f"cannot serve sequence{'s' if len(missing) > 1 else ''} {seq_ranges(missing)}"
            if not unfiltered:
                what += (f" (their subjects cannot be read: they may belong to {subject_filter})" if len(missing) > 1
                         else f" (its subject cannot be read: it may belong to {subject_filter})")
        else:
            what = f"counted {undelivered} message(s) matching {subject_filter} that it could not deliver"
        raise LogDamaged(
            f"the event store {what}, while replaying {where} (the stream holds 1..{end}); every other event "
            f"was read. Its files are damaged: restore the store from a backup or a cluster peer "
            f"(docs/operations.md, 'Damaged or truncated log')",
            missing=sorted(set(missing)), last=end, uncounted=0 if missing else undelivered,
        )

    async def _end_of_replay(self, sub: Any, finished: asyncio.Future[None], last: Callable[[], list[str]]) -> None:
        """Ends a replay whose consumer has nothing more to send although its last delivery said
        some was pending (nats-server skips a message it cannot read but keeps it in the count)."""
        seen = None
        while not finished.done():
            await asyncio.sleep(_STALL_CHECK_S)
            tokens = last()
            if tokens is not seen:
                seen = tokens
                continue
            try:
                async with asyncio.timeout(max(_STALL_CHECK_S, 1.0)):
                    info = await sub.consumer_info()
            except Exception:  # noqa: BLE001 - NATS is away: the replay's deadline decides
                continue
            cseq = 0 if not tokens else int(tokens[6] if len(tokens) == 9 else tokens[8])
            delivered = info.delivered.consumer_seq if info.delivered else 0
            if info.num_pending == 0 and delivered <= cseq and last() is tokens and not finished.done():
                finished.set_result(None)

    # ----------------------------------------------------------------------------- KV: views

    async def _views(self) -> Any:
        if self._kv is None:
            with _translated("opening the KV bucket haru_views"):
                try:
                    self._kv = await self.js.key_value(subjects.VIEWS_BUCKET)
                except nats.js.errors.BucketNotFoundError as exc:
                    raise LogUnavailable("the KV bucket haru_views does not exist yet: run `haru up` (or ensure())") from exc
        return self._kv

    async def get_view(self, key: str) -> tuple[bytes, int] | None:
        kv = await self._views()
        with _translated(f"reading view {key}"):
            try:
                entry = await kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                return None
        if entry.value is None:
            return None
        return entry.value, entry.revision

    async def views(self) -> dict[str, bytes]:
        """Every view stored now, by key (empty when there is none)."""
        kv = await self._views()
        out: dict[str, bytes] = {}
        with _translated("listing views"):
            try:
                keys = await kv.keys()
            except nats.js.errors.NoKeysError:
                return out
        for key in keys:
            got = await self.get_view(key)
            if got is not None:
                out[key] = got[0]
        return out

    async def read_seq(self, seq: int) -> Record | None:
        """The event stored at stream sequence `seq` (None when the store cannot serve it)."""
        with _translated(f"reading sequence {seq}"):
            try:
                raw = await self.js.get_msg(subjects.EVENTS_STREAM, seq=seq)
            except nats.js.errors.NotFoundError:
                return None
        time = raw.time if isinstance(raw.time, datetime) else datetime.now(timezone.utc)
        return _decode_record(raw.seq or 0, raw.subject or "", _datetime_to_ns(time), raw.data or b"", raw.headers)

    async def put_view(self, key: str, data: bytes, *, last: int) -> int:
        """Compare-and-swap a view: `last` is the revision read (0 = the key must not exist)."""
        kv = await self._views()
        with _translated(f"writing view {key}"):
            try:
                if last == 0:
                    return int(await kv.create(key, data))
                return int(await kv.update(key, data, last=last))
            except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError) as exc:
                if isinstance(exc, nats.js.errors.KeyWrongLastSequenceError) or exc.err_code in _CONFLICT_CODES:
                    current = await self.get_view(key)
                    raise Conflict(f"kv:{key}", last, None if current is None else current[1]) from exc
                raise

    async def watch_views(self, pattern: str = "fleet.*") -> AsyncIterator[tuple[str, bytes | None, int]]:
        """Current views, then every change: (key, value or None when deleted, revision)."""
        kv = await self._views()
        with _translated("watching views"):
            watcher = await kv.watch(pattern)
        try:
            async for entry in watcher:
                if entry is None:
                    continue  # the end of the initial values
                value = entry.value if entry.operation is None else None
                yield entry.key, value, entry.revision
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    # ------------------------------------------------------------------------- route intents

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
            seq, _, _ = _parse_ack_reply(msg.reply)
            queue.put_nowait((msg.subject.rsplit(".", 1)[1], msg.data, seq))

        with _translated(f"watching route intents on {subject}"):
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
