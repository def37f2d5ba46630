"""The event log on JetStream: one connection, with the log's three parts composed on it.

    async with EventLog.connect(["nats://127.0.0.1:4222"], writer="agent:default/a") as log:
        await log.ensure()
        seq = await log.append(subjects.model("default", "a", "qwen3.6:27b"), event, expect=last_seq)

`EventLog` implements `haru.log.seam.Log`, the Protocol every service is typed against, from parts that
each do one thing on the shared `haru.log.jetstream.JetStreamClient`:

    haru/log/js_events.py    JetStreamEvents   appends and reads of HARU_EVENTS (js_replay.py: one replay,
                                               holes.py: its hole arithmetic, pure)
    haru/log/js_views.py     JetStreamViews    the views' KV bucket, compare-and-swap
    haru/log/js_intents.py   JetStreamIntents  the route intents' stream
    this module              EventLog          connecting, the link's listeners, the bus, ensure, close

nats-py errors never escape haru.log: they become `haru.core.errors` exceptions.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Server
from nats.js import api

from haru.core import subjects
from haru.core.errors import LogError, LogUnavailable
from haru.log.jetstream import DEFAULT_REPLAY_TIMEOUT_S, Link, history_stream, translated
from haru.log.js_events import JetStreamEvents
from haru.log.js_intents import JetStreamIntents
from haru.log.js_views import JetStreamViews
from haru.log.receipts import ReceiptGuard
from haru.log.record import EXPECTED_LAST_SUBJECT_SEQ, MSG_ID, Record, body_hash, msg_id
from haru.log.training_objects import ensure_bucket

if TYPE_CHECKING:
    from haru.log.bus import NatsBus

# Record, body_hash, msg_id and the header names live in haru.log.record; imported from here by name
# too, as the log's vocabulary.
__all__ = [
    "DEFAULT_REPLAY_TIMEOUT_S",
    "EXPECTED_LAST_SUBJECT_SEQ",
    "EventLog",
    "MSG_ID",
    "Record",
    "body_hash",
    "msg_id",
]

_FIRST_CONNECT_ATTEMPTS = 1  # nats-py: a server is dropped after this many failed retries (so: 2 tries)
_FIRST_CONNECT_WAIT_S = 0.05  # between those tries
_RECONNECT_WAIT_S = 0.5  # between reconnect attempts once connected
_log = structlog.get_logger("haru.log.eventlog")


class ServerSteer:
    """Which server a reconnect goes to (nats-py's `reconnect_to_server_handler`): the one asked for by
    `go(url)` when it is in the pool, else the next one in the order the servers were given, round and
    round, waiting `wait_s` before each new round. (nats-py's own choice, without a handler, is the same
    round without the asked-for server.)"""

    def __init__(self, servers: list[str], wait_s: float) -> None:
        self.order = [urlparse(u if "://" in u else f"nats://{u}").netloc for u in servers]
        self.wait_s = wait_s
        self.wanted = ""
        self._next = 1  # the first connection went to the first server

    def go(self, url: str) -> None:
        self.wanted = urlparse(url).netloc

    def __call__(self, servers: list[Server], info: dict[str, Any]) -> tuple[Server | None, float]:
        pool = {srv.uri.netloc: srv for srv in servers}
        if self.wanted in pool:
            chosen, self.wanted = pool[self.wanted], ""
            self._next = self.order.index(chosen.uri.netloc) + 1 if chosen.uri.netloc in self.order else self._next
            return chosen, 0.0
        for _ in range(len(self.order)):
            i = self._next % len(self.order)
            self._next = i + 1
            if self.order[i] in pool:
                return pool[self.order[i]], (self.wait_s if i == 0 else 0.0)
        return None, self.wait_s


class EventLog(JetStreamEvents, JetStreamViews, JetStreamIntents):
    """A connection to the log (`haru.log.seam.Log`). Create with `EventLog.connect(...)` (async
    context) or `EventLog.open`."""

    def __init__(
        self,
        nc: nats.NATS,
        *,
        writer: str,
        timeout: float = 5.0,
        replay_timeout: float = DEFAULT_REPLAY_TIMEOUT_S,
        link: Link | None = None,
    ) -> None:
        super().__init__(nc, writer=writer, timeout=timeout, replay_timeout=replay_timeout, link=link)
        self._bus: NatsBus | None = None
        self._steer: ServerSteer | None = None  # set by `open(steer=True)`
        self._creds: str | None = None  # the credentials `open` was given (for `server_reaches_majority`)
        # What this writer was acknowledged, checked against the log after each reconnect (a server
        # that restarted on a store that forgot) and on a conflict below a receipt: haru.log.receipts.
        self.receipt_guard = ReceiptGuard(self, self.receipts)
        self.on_link_change(self.receipt_guard.link_changed)

    # ------------------------------------------------------------------------ connection state

    @property
    def connected(self) -> bool:
        return bool(self.nc.is_connected)

    def server_urls(self) -> list[str]:
        """The NATS servers this connection knows (for messages that say where it is connected)."""
        return [u.geturl() for u in self.nc.servers]

    def connected_url(self) -> str:
        """The server this connection is on now ("" while it is not connected)."""
        url = self.nc.connected_url
        return url.geturl() if url is not None else ""

    async def reaches_majority(self, timeout: float, *, stale_s: float = 2.5) -> bool | None:
        """Whether the event stream has a leader backed by a majority of its replicas, as the server this
        connection is on sees it: True, False (it answered: no leader, or a leader whose replicas it has
        not heard from within `stale_s`), or None (no answer within `timeout`). A node cut from the
        others first times out (its requests wait on a leader it cannot reach), then answers with no
        leader; a cut-off leader answers with replicas it no longer hears. A stream without replicas
        (one server) has a majority whenever it answers."""
        return await _majority(self.js, timeout, stale_s)

    async def server_reaches_majority(self, url: str, timeout: float, *, stale_s: float = 2.5) -> bool | None:
        """`reaches_majority` as another server sees it, on a connection of its own opened and closed here
        (None also when that server cannot be reached within `timeout`)."""

        async def quiet(exc: Exception) -> None:
            return None

        kwargs: dict[str, Any] = dict(
            servers=[url], allow_reconnect=False, connect_timeout=timeout, error_cb=quiet, name=f"{self.writer}:probe"
        )
        if self._creds:
            kwargs["user_credentials"] = self._creds
        try:
            nc = await asyncio.wait_for(nats.connect(**kwargs), timeout)
        except (TimeoutError, OSError, nats.errors.Error):
            return None
        try:
            return await _majority(nc.jetstream(timeout=timeout), timeout, stale_s)
        finally:
            with contextlib.suppress(Exception):
                await nc.close()

    async def move_to_next_server(self) -> None:
        """Leave this server for the next one in the list (nats-py's own reconnect: the subscriptions,
        and the services on them, follow the connection)."""
        with contextlib.suppress(nats.errors.Error):
            await self.nc.force_reconnect()

    async def move_to(self, url: str) -> None:
        """Leave this server for `url` (one of the servers the log was opened with, `steer=True`)."""
        if self._steer is not None:
            self._steer.go(url)
        await self.move_to_next_server()

    @property
    def bus(self) -> NatsBus:
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
        steer: bool = False,
    ) -> EventLog:
        """`steer`: reconnects go where `move_to` asks, else round the servers in the order given (an
        agent, which leaves a node without a majority and comes back to its own region's node)."""
        if isinstance(servers, str):
            servers = [s.strip() for s in servers.split(",") if s.strip()]

        first_errors: list[BaseException] = []  # what the first connection's attempts ran into

        async def _quiet(exc: Exception) -> None:
            if len(first_errors) < 16:
                first_errors.append(exc)
            # Reconnect noise is expected while a server restarts; anything else (a permissions
            # violation, a slow consumer) is worth a line in the service's log.
            if isinstance(
                exc,
                (
                    OSError,
                    asyncio.TimeoutError,
                    nats.errors.UnexpectedEOF,
                    nats.errors.StaleConnectionError,
                    nats.errors.ConnectionClosedError,
                ),
            ):
                return
            _log.warning("nats.error", writer=writer, error=str(exc) or type(exc).__name__)

        link = Link()
        # The first connection tries each server twice, 50 ms apart, and gives up: with
        # `max_reconnect_attempts=-1` nats-py's connect() loops over refused servers until our
        # timeout (every CLI command waited the whole connect_timeout, ~5.5 s, to say NATS was
        # down). Once connected, the client reconnects forever (the options are read at each
        # reconnect).
        kwargs: dict[str, Any] = dict(
            servers=servers,
            name=name or writer,
            connect_timeout=min(2.0, connect_timeout),
            # The servers in the order given: a process's own region's node first, the others as
            # fallbacks (nats-py shuffles them by default, which put clients on another region's node).
            dont_randomize=True,
            allow_reconnect=True,
            max_reconnect_attempts=_FIRST_CONNECT_ATTEMPTS,
            reconnect_time_wait=_FIRST_CONNECT_WAIT_S,
            error_cb=_quiet,
            disconnected_cb=link.down,
            reconnected_cb=link.up,
        )
        if creds:
            kwargs["user_credentials"] = creds
        chooser = ServerSteer(servers, _RECONNECT_WAIT_S) if steer else None
        if chooser is not None:
            kwargs["reconnect_to_server_handler"] = chooser
        try:
            async with asyncio.timeout(connect_timeout):
                nc = await nats.connect(**kwargs)
        except (TimeoutError, nats.errors.NoServersError, OSError) as exc:
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
        log = cls(nc, writer=writer, timeout=timeout, replay_timeout=replay_timeout, link=link)
        log._steer, log._creds = chooser, creds
        return log

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, servers: list[str] | str, *, writer: str, **kwargs: Any) -> AsyncIterator[EventLog]:
        log = await cls.open(servers, writer=writer, **kwargs)
        try:
            yield log
        finally:
            await log.close()

    async def close(self) -> None:
        if self.receipt_guard is not None:
            await self.receipt_guard.close()  # a persisted guard's last write of its receipts
        with contextlib.suppress(Exception):
            await self.nc.drain()
        with contextlib.suppress(Exception):
            await self.nc.close()

    # -------------------------------------------------------------------------------- streams

    def cluster_size(self) -> int:
        """How many servers this connection knows: the ones it was given and the ones the cluster
        advertised to it (nats-py's server pool; 1 for a standalone server given once)."""
        return max(1, len({u.netloc for u in self.nc.servers}))

    async def ensure(self, *, replicas: int | None = None) -> None:
        """Create (or check and update) HARU_EVENTS, HARU_ROUTE and the KV bucket haru_views; create the object
        stores haru_adapters and haru_checkpoints if they are missing.

        `replicas` defaults to 3 on a cluster of three or more servers, else 1: a stream created
        unreplicated on a cluster would quietly lose the point of the cluster. An existing stream
        keeps its replicas (changing them is an operator's decision).
        """
        if replicas is None:
            replicas = 3 if self.cluster_size() >= 3 else 1
        events = history_stream(
            subjects.EVENTS_STREAM,
            subjects.ALL_EVENTS,
            replicas,
            "Haru event log: every fact, hash-chained per subject. Never deleted, never purged.",
            atomic=True,  # the promoter appends a step's outcome and the next step's start as one batch
        )
        route = history_stream(
            subjects.ROUTE_STREAM,
            subjects.ALL_INTENTS,
            replicas,
            "Haru route intents per fleet, history kept per subject.",
        )
        for config in (events, route):
            await self._ensure_stream(config)
        with translated("ensuring the KV bucket haru_views"):
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
        await ensure_bucket(
            self.js,
            subjects.ADAPTERS_BUCKET,
            replicas=replicas,
            description="Haru: published LoRA adapters, one object per version (a tar of the adapter's folder)",
        )
        await ensure_bucket(
            self.js,
            subjects.CHECKPOINTS_BUCKET,
            replicas=replicas,
            description="Haru: each training slot's newest checkpoint, one object per fleet/slot, replaced",
        )

    async def _ensure_stream(self, config: api.StreamConfig) -> None:
        with translated(f"ensuring stream {config.name}"):
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
                or bool(have.allow_atomic) != bool(config.allow_atomic)
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


async def _majority(js: Any, timeout: float, stale_s: float) -> bool | None:
    """`EventLog.reaches_majority` on a JetStream context."""
    try:
        info = await asyncio.wait_for(js.stream_info(subjects.EVENTS_STREAM), timeout)
    except (TimeoutError, nats.errors.Error):
        return None
    cluster = info.cluster
    if cluster is None:
        return True
    if not cluster.leader:
        return False
    replicas = cluster.replicas or []
    heard = 1 + sum(1 for r in replicas if r.current and (r.active or 0) / 1e9 < stale_s)
    return heard > (1 + len(replicas)) // 2
