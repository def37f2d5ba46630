"""Schema migrations against a real PostgreSQL: versioned, idempotent, and additive."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from haru.projections import pg_schema as S
from haru.projections.postgres import SinkError, migrate, schema_version

pytestmark = pytest.mark.postgres


async def catalog(conn) -> list[tuple]:
    """Every table, column and index of the `haru` schema: what a migration changes."""
    cols = await conn.fetch(
        """SELECT table_name, column_name, data_type, is_nullable, column_default
           FROM information_schema.columns WHERE table_schema = 'haru' ORDER BY 1, 2"""
    )
    idx = await conn.fetch("SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'haru' ORDER BY 1")
    return [tuple(r) for r in cols] + [tuple(r) for r in idx]


async def tables(conn) -> set[str]:
    rows = await conn.fetch("SELECT table_name FROM information_schema.tables WHERE table_schema = 'haru'")
    return {r[0] for r in rows}


async def test_a_fresh_database_gets_every_migration_in_order(pg):
    assert await schema_version(pg) == 0
    assert await migrate(pg) == [m.version for m in S.MIGRATIONS]
    assert await schema_version(pg) == S.LATEST
    rows = await pg.fetch("SELECT version, name FROM haru.schema_migrations ORDER BY version")
    assert [(r["version"], r["name"]) for r in rows] == [(m.version, m.name) for m in S.MIGRATIONS]
    assert {
        "residency_transitions",
        "incidents",
        "operations",
        "operation_steps",
        "domains",
        "gpu_observations",
        "sink_position",
        "skipped_events",
        "schema_migrations",
    } <= await tables(pg)


async def test_rerunning_migrations_is_a_no_op(pg):
    await migrate(pg)
    await pg.execute(
        "INSERT INTO haru.incidents (opened_seq, fleet, domain, model, reason, opened_at) "
        "VALUES (1, 'default', 'a', 'm', 'evicted', now())"
    )
    before = await catalog(pg)
    applied_at = await pg.fetch("SELECT version, applied_at FROM haru.schema_migrations ORDER BY version")
    assert await migrate(pg) == []
    assert await migrate(pg) == []
    assert await catalog(pg) == before
    assert await pg.fetch("SELECT version, applied_at FROM haru.schema_migrations ORDER BY version") == applied_at
    assert await pg.fetchval("SELECT count(*) FROM haru.incidents") == 1


async def test_a_newer_sink_on_an_older_schema_applies_only_the_missing_migrations(pg):
    assert await migrate(pg, upto=1) == [1]
    assert await schema_version(pg) == 1
    assert "operations" not in await tables(pg) and "domains" not in await tables(pg)
    # the older sink wrote history with its schema
    await pg.execute(
        "INSERT INTO haru.residency_transitions (seq, fleet, domain, model, state, observed_at, recorded_at) "
        "VALUES (7, 'default', 'a', 'qwen3.6:27b', 'resident', now(), now())"
    )
    await pg.execute("INSERT INTO haru.sink_position (stream, last_seq) VALUES ('HARU_EVENTS', 7)")
    v1_applied = await pg.fetchval("SELECT applied_at FROM haru.schema_migrations WHERE version = 1")

    assert await migrate(pg) == [m.version for m in S.MIGRATIONS if m.version > 1]
    assert await schema_version(pg) == S.LATEST
    assert {"operations", "operation_steps", "domains"} <= await tables(pg)
    assert await pg.fetchval("SELECT applied_at FROM haru.schema_migrations WHERE version = 1") == v1_applied
    assert await pg.fetchval("SELECT count(*) FROM haru.residency_transitions WHERE seq = 7") == 1
    assert await pg.fetchval("SELECT last_seq FROM haru.sink_position") == 7


async def test_the_pulling_migration_keeps_older_rows_and_takes_pulling_ones(pg):
    assert await migrate(pg, upto=3) == [1, 2, 3]
    insert = (
        "INSERT INTO haru.residency_transitions (seq, fleet, domain, model, state, observed_at, recorded_at) "
        "VALUES ($1, 'default', 'a', 'm', $2, now(), now())"
    )
    await pg.execute(insert, 1, "resident")
    with pytest.raises(asyncpg.CheckViolationError):
        await pg.execute(insert, 2, "pulling")
    assert await migrate(pg, upto=4) == [4]
    await pg.execute(insert, 2, "pulling")
    assert [
        tuple(r) for r in await pg.fetch("SELECT seq, state, done_bytes FROM haru.residency_transitions ORDER BY seq")
    ] == [(1, "resident", None), (2, "pulling", None)]
    with pytest.raises(asyncpg.CheckViolationError):
        await pg.execute(insert, 3, "dreaming")


async def test_the_cascade_migration_keeps_older_operations_with_nothing_tried(pg):
    assert await migrate(pg, upto=4) == [1, 2, 3, 4]
    await pg.execute(
        "INSERT INTO haru.operations (fleet, op_id, kind, target) VALUES ('default', 'op-1', 'promotion', 'b')"
    )
    assert await migrate(pg, upto=5) == [5]
    assert list(await pg.fetchval("SELECT tried FROM haru.operations WHERE op_id = 'op-1'")) == []


async def test_an_upgraded_schema_equals_a_fresh_one(pg_server):
    names = ("upgraded", "fresh")
    admin = await asyncpg.connect(pg_server.dsn())
    try:
        for name in names:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
            await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
    finally:
        await admin.close()
    upgraded = await asyncpg.connect(pg_server.dsn("upgraded"))
    fresh = await asyncpg.connect(pg_server.dsn("fresh"))
    try:
        await migrate(upgraded, upto=1)
        await migrate(upgraded, upto=2)
        await migrate(upgraded)
        await migrate(fresh)
        assert await catalog(upgraded) == await catalog(fresh)
    finally:
        await upgraded.close()
        await fresh.close()


async def test_a_schema_newer_than_the_sink_is_refused(pg):
    await migrate(pg)
    await pg.execute("INSERT INTO haru.schema_migrations (version, name) VALUES ($1, 'from the future')", S.LATEST + 1)
    with pytest.raises(SinkError, match="upgrade this sink"):
        await migrate(pg)


async def test_a_failing_migration_leaves_nothing_behind(pg):
    broken = (*S.MIGRATIONS[:1], S.Migration(2, "broken", "CREATE TABLE haru.half_done (x int); SELECT 1/0;"))
    await migrate(pg, migrations=S.MIGRATIONS[:1])
    with pytest.raises(asyncpg.DivisionByZeroError):
        await migrate(pg, migrations=broken)
    assert await schema_version(pg) == 1
    assert "half_done" not in await tables(pg)
    assert await migrate(pg) == [m.version for m in S.MIGRATIONS if m.version > 1]


async def test_two_sinks_migrating_at_once_apply_each_migration_once(pg_dsn):
    conns = [await asyncpg.connect(pg_dsn) for _ in range(3)]
    try:
        results = await asyncio.gather(*(migrate(c) for c in conns))
        applied = sorted(v for r in results for v in r)
        assert applied == [m.version for m in S.MIGRATIONS]
        assert await conns[0].fetchval("SELECT count(*) FROM haru.schema_migrations") == len(S.MIGRATIONS)
    finally:
        for c in conns:
            await c.close()
