"""The Postgres read model: follows HARU_EVENTS and writes SQL tables, exactly once.

    async with await asyncpg.connect(dsn) as conn: await migrate(conn)
    await PostgresSink(dsn, ["nats://127.0.0.1:4222"]).run()          # `haru sink postgres`

The imperative shell around `projections.pg_rows.plan` (the pure mapping) and
`projections.pg_schema` (the tables, as versioned migrations):

- On start it applies the missing migrations (each in its own transaction, under an advisory
  lock, so two sinks starting together do not both apply one), takes the one-writer advisory lock
  (a second sink on the same database waits as a hot standby), reads its position and the open
  incidents/operations/steps, and replays the log from position + 1.
- Records from the replay callback are gathered into batches (`batch_size` records, or whatever
  arrived within `flush_interval` seconds). Each batch is one transaction: the updates that close
  spans opened by earlier batches, one COPY per table, the declaration upserts, and the position,
  moved from the value this sink last wrote to the batch's last sequence (a conditional UPDATE: if
  anyone else moved it, the transaction rolls back). A crash anywhere leaves rows and position
  consistent, so a restart neither duplicates nor skips an event.
- Replay and writing overlap: while one batch is in Postgres the next is being received.
- Invalid bodies, and events that may not stand on their subject (`haru.core.authority`), are logged,
  stored in `haru.skipped_events`, and advance the position; no other row comes from them.

Errors (`SinkError`, a `HaruError`): the database belongs to another log, its schema is newer
than this sink, or another writer moved the position. Postgres or NATS going away ends `run` with
`SinkUnavailable` when `retry` is off; with `retry` on (the service default) the sink reconnects
with a capped backoff and resumes from its stored position.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Sequence

import asyncpg
import structlog

from haru.core import subjects
from haru.core.errors import HaruError, LogError, LogUnavailable
from haru.core.restarts import Backoff
from haru.log.eventlog import EventLog
from haru.projections import pg_schema as S
from haru.projections.pg_rows import Carry, Writes, carry_from_rows, plan

log = structlog.get_logger("haru.sink.postgres")


class SinkError(HaruError):
    """The Postgres sink cannot go on: the message says why and what to do."""


class SinkUnavailable(SinkError):
    """Postgres cannot be reached (or went away)."""


_CONNECTION_LOST = (
    asyncpg.PostgresConnectionError,  # SQLSTATE class 08
    asyncpg.InterfaceError,  # the connection is closed
    asyncpg.AdminShutdownError,
    asyncpg.CannotConnectNowError,
    OSError,
)


# ------------------------------------------------------------------------------------- connection


async def connect(dsn: str, *, timeout: float = 10.0) -> asyncpg.Connection:
    """A connection, with the failures an operator can fix said in one line."""
    try:
        return await asyncpg.connect(dsn, timeout=timeout)
    except asyncpg.ClientConfigurationError as exc:
        raise SinkError(f"--dsn is not a usable PostgreSQL URL: {exc}; e.g. postgresql://haru@db/haru") from exc
    except (TimeoutError, OSError, asyncpg.CannotConnectNowError) as exc:
        raise SinkUnavailable(f"cannot reach Postgres ({_redact(dsn)}): {exc}; check --dsn") from exc
    except asyncpg.InvalidCatalogNameError as exc:
        raise SinkError(f"{exc}: create the database first (createdb) or fix --dsn") from exc
    except asyncpg.InvalidAuthorizationSpecificationError as exc:
        raise SinkError(f"Postgres refused the login: {exc}; fix the user/password in --dsn") from exc


# ------------------------------------------------------------------------------------- migrations


async def schema_version(conn: asyncpg.Connection) -> int:
    """The highest applied migration (0 = none, or no `haru` schema yet)."""
    exists = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", S.MIGRATIONS_TABLE)
    if not exists:
        return 0
    return await conn.fetchval(f"SELECT coalesce(max(version), 0) FROM {S.MIGRATIONS_TABLE}")


async def migrate(
    conn: asyncpg.Connection,
    *,
    upto: int | None = None,
    migrations: Sequence[S.Migration] = S.MIGRATIONS,
) -> list[int]:
    """Apply the migrations not yet applied (up to `upto`), each in its own transaction.

    Returns the versions applied now ([] when the schema was current: re-running is a no-op).
    Raises SinkError when the database has versions this code does not know (a newer sink
    migrated it: upgrade this one instead of writing with an older mapping).
    """
    known = {m.version for m in migrations}
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1, $2)", S.LOCK_NAMESPACE, S.MIGRATION_LOCK)
        await conn.execute(S.BOOTSTRAP)
        applied_before = {r[0] for r in await conn.fetch(f"SELECT version FROM {S.MIGRATIONS_TABLE}")}
    unknown = sorted(applied_before - known)
    if unknown:
        raise SinkError(
            f"the database schema has migration(s) {unknown} that this sink does not know "
            f"(it knows up to {max(known)}): a newer haru migrated it; upgrade this sink"
        )
    applied: list[int] = []
    for m in sorted(migrations, key=lambda m: m.version):
        if upto is not None and m.version > upto:
            break
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1, $2)", S.LOCK_NAMESPACE, S.MIGRATION_LOCK)
            done = await conn.fetchval(f"SELECT 1 FROM {S.MIGRATIONS_TABLE} WHERE version = $1", m.version)
            if done:
                continue
            await conn.execute(m.sql)
            await conn.execute(f"INSERT INTO {S.MIGRATIONS_TABLE} (version, name) VALUES ($1, $2)", m.version, m.name)
        applied.append(m.version)
        log.info("migration_applied", version=m.version, name=m.name)
    return applied


# ------------------------------------------------------------------------------ position and carry


async def load_state(conn: asyncpg.Connection, stream: str = subjects.EVENTS_STREAM) -> tuple[int, Carry]:
    """The stored position (0 = nothing written yet) and the spans still open."""
    await conn.execute(
        f"INSERT INTO {S.POSITION_TABLE} (stream, last_seq) VALUES ($1, 0) ON CONFLICT (stream) DO NOTHING", stream
    )
    position = await conn.fetchval(f"SELECT last_seq FROM {S.POSITION_TABLE} WHERE stream = $1", stream)
    carry = carry_from_rows(
        await conn.fetch(S.OPEN_INCIDENTS),
        await conn.fetch(S.OPEN_OPERATIONS),
        await conn.fetch(S.RUNNING_STEPS),
    )
    return position, carry


async def write_batch(conn: asyncpg.Connection, stream: str, expected: int, writes: Writes) -> None:
    """One batch, one transaction: span closes, COPYs, upserts, then the position."""
    async with conn.transaction():
        # Closes first: a span closed and reopened in one batch must free its "one open" slot.
        if writes.close_incidents:
            await conn.executemany(S.CLOSE_INCIDENT, writes.close_incidents)
        if writes.finish_steps:
            await conn.executemany(S.FINISH_STEP, writes.finish_steps)
        if writes.finish_operations:
            await conn.executemany(S.FINISH_OPERATION, writes.finish_operations)
        for table, rows in writes.copies.items():
            if rows:
                await conn.copy_records_to_table(
                    table, records=rows, columns=S.COPY_TABLES[table], schema_name=S.SCHEMA
                )
        if writes.insert_operations:
            await conn.executemany(S.INSERT_OPERATION, writes.insert_operations)
        if writes.retarget_operations:
            await conn.executemany(S.RETARGET_OPERATION, writes.retarget_operations)
        if writes.upsert_domains:
            await conn.executemany(S.UPSERT_DOMAIN, writes.upsert_domains)
        status = await conn.execute(
            f"UPDATE {S.POSITION_TABLE} SET last_seq = $3, updated_at = now() WHERE stream = $1 AND last_seq = $2",
            stream,
            expected,
            writes.last_seq,
        )
        if status != "UPDATE 1":
            raise SinkError(
                f"the stored position of {stream} is no longer {expected}: another writer moved it; "
                f"run one sink per database (a second one waits on the advisory lock)"
            )


# ----------------------------------------------------------------------------------------- the sink


class _Batcher:
    """Gathers records from the replay callback into batches; the queue bound is the backpressure."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.buf: list = []
        self.queue: asyncio.Queue[list | None] = asyncio.Queue(maxsize=2)
        self.received = 0  # the last sequence the replay handed over

    async def add(self, record) -> None:
        self.received = record.seq
        self.buf.append(record)
        if len(self.buf) >= self.size:
            batch, self.buf = self.buf, []
            await self.queue.put(batch)

    def take(self) -> list:
        batch, self.buf = self.buf, []
        return batch

    async def close(self) -> None:
        if self.buf:
            await self.queue.put(self.take())
        await self.queue.put(None)


class PostgresSink:
    """`haru sink postgres`: one follower of HARU_EVENTS writing one database."""

    def __init__(
        self,
        dsn: str,
        servers: list[str],
        *,
        creds: str | None = None,
        batch_size: int = 5000,
        flush_interval: float = 0.2,
        retry: bool = True,
        retry_max: float = 30.0,
        stall_interval: float = 1.0,
        stall_checks: int = 3,
        stream: str = subjects.EVENTS_STREAM,
    ) -> None:
        self.dsn = dsn
        self.servers = servers
        self.creds = creds
        self.batch_size = max(1, batch_size)
        self.flush_interval = flush_interval
        self.retry = retry
        self.retry_max = retry_max
        self.stall_interval = stall_interval
        self.stall_checks = stall_checks
        self.stream = stream
        self.position = 0
        self.written = 0  # events written by this process (all sessions)
        self.writer_id = f"sink:postgres@{socket.gethostname()}:{os.getpid()}"

    async def run(self, *, follow: bool = True) -> int:
        """Follow the log (until cancelled), or with follow=False write what is stored and return.

        Returns the position reached.
        """
        backoff, failures = Backoff(0.5, self.retry_max), 0  # sessions in a row that wrote nothing
        while True:
            written = self.written
            try:
                return await self._session(follow)
            except (SinkUnavailable, LogUnavailable) as exc:
                if not self.retry:
                    raise
                # that session got somewhere: start the backoff again
                failures = 1 if self.written != written else failures + 1
                log.warning("sink_unavailable", error=str(exc), retry_in_s=backoff.delay(failures))
                await asyncio.sleep(backoff.delay(failures))

    async def _session(self, follow: bool) -> int:
        conn = await connect(self.dsn)
        try:
            await migrate(conn)
            if not await conn.fetchval("SELECT pg_try_advisory_lock($1, $2)", S.LOCK_NAMESPACE, S.SINK_LOCK):
                log.info("sink_waiting", why="another sink writes this database; waiting for its lock")
                await conn.execute("SELECT pg_advisory_lock($1, $2)", S.LOCK_NAMESPACE, S.SINK_LOCK)
            position, carry = await load_state(conn, self.stream)
            self.position = position
            async with EventLog.connect(self.servers, writer=self.writer_id, creds=self.creds) as elog:
                try:
                    head = await elog.last_seq()
                except LogError as exc:
                    if "10059" not in str(exc):  # stream not found
                        raise
                    raise LogUnavailable(
                        f"the stream {self.stream} does not exist yet: start Haru (`haru up`) or point "
                        f"--nats-url at its NATS"
                    ) from exc
                if position > head:
                    raise SinkError(
                        f"the database has events up to sequence {position} but {self.stream} ends at {head}: "
                        f"it was filled from another event log; point --dsn at a fresh database"
                    )
                log.info("sink_started", position=position, head=head, open_incidents=len(carry.incidents))
                writer = _Writer(self, conn, carry, caught_up_at=head)
                batcher = _Batcher(self.batch_size)
                try:
                    async with asyncio.TaskGroup() as tg:
                        tg.create_task(writer.loop(batcher))
                        tg.create_task(self._replay(elog, batcher, position, follow))
                except BaseExceptionGroup as group:
                    raise _first(group) from None
            return self.position
        except _CONNECTION_LOST as exc:
            raise SinkUnavailable(f"lost Postgres ({_redact(self.dsn)}): {exc}") from exc
        finally:
            try:
                async with asyncio.timeout(5):
                    await conn.close()
            except Exception:
                conn.terminate()

    async def _replay(self, elog, batcher: _Batcher, position: int, follow: bool) -> None:
        """Hand the log's records to the batcher from `position` + 1: what is stored (follow=False),
        or, following, until cancelled (haru/log/follow.py: a stalled replay, or one a NATS restart left
        behind, is started again after the last record handed over; a full queue is the writer's
        backpressure, not a stall)."""
        batcher.received = position
        if follow:
            await elog.follow(
                batcher.add,
                from_seq=position + 1,
                headers=False,
                name="sink",
                stall_interval=self.stall_interval,
                stall_checks=self.stall_checks,
                busy=batcher.queue.full,
            )
        else:
            await elog.replay(batcher.add, from_seq=position + 1, headers=False)
        await batcher.close()


class _Writer:
    def __init__(self, sink: PostgresSink, conn: asyncpg.Connection, carry: Carry, caught_up_at: int) -> None:
        self.sink = sink
        self.conn = conn
        self.carry = carry
        self.caught_up_at = caught_up_at
        self.caught_up = sink.position >= caught_up_at
        self.started = time.monotonic()
        self.first = sink.position

    async def loop(self, batcher: _Batcher) -> None:
        while True:
            try:
                async with asyncio.timeout(self.sink.flush_interval):
                    batch = await batcher.queue.get()
            except TimeoutError:
                # A full batch may have been queued while the wait was being cancelled: it holds
                # older records than the buffer, so it goes first.
                if not batcher.queue.empty():
                    continue
                batch = batcher.take()
                if not batch:
                    continue
            if batch is None:
                return
            await self.write(batch)

    async def write(self, batch: list) -> None:
        sink = self.sink
        if batch[0].seq <= sink.position:
            raise SinkError(
                f"records out of order: sequence {batch[0].seq} after position {sink.position} (a bug; "
                f"nothing was written, restart the sink)"
            )
        writes, carry = plan(self.carry, batch)
        try:
            await write_batch(self.conn, sink.stream, sink.position, writes)
        except (asyncpg.DataError, OverflowError) as exc:  # client-side: a value the column cannot hold
            raise SinkError(
                f"events {batch[0].seq}..{batch[-1].seq} hold a value Postgres cannot store ({exc}); nothing "
                f"of them was written. Find it with `nats stream get {sink.stream} <seq>`"
            ) from exc
        sink.position = writes.last_seq
        sink.written += len(batch)
        self.carry = carry
        for seq, subject, error in writes.skipped:
            log.warning("event_skipped", seq=seq, subject=subject, error=error)
        if not self.caught_up and sink.position >= self.caught_up_at:
            self.caught_up = True
            took = time.monotonic() - self.started
            count = sink.position - self.first
            log.info(
                "sink_caught_up",
                position=sink.position,
                events=count,
                seconds=round(took, 3),
                events_per_s=round(count / took) if took > 0 else None,
            )


def tune_gc() -> None:
    """Process-wide GC settings for a sink process (the CLI calls this; a library user may not).

    A sink holds a few batches of records (thousands of small objects each) that the default
    gen0 threshold (700) makes the collector rescan hundreds of times per 100k events; a higher
    threshold and frozen start-up objects cut ~12% of the CPU per event (bench/postgres.py).
    """
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def _first(group: BaseExceptionGroup) -> BaseException:
    """The first real failure in a TaskGroup's group (cancellations are consequences)."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group.exceptions[0]


def _redact(dsn: str) -> str:
    """The DSN without its password, for messages."""
    if "://" not in dsn or "@" not in dsn:
        return dsn
    scheme, rest = dsn.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}@{host}"
