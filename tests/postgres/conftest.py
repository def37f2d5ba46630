"""PostgreSQL for the read-model tests: one real server for the session, a fresh database per test.

The server is started from the machine's binaries (`tests.support.pg_local.LocalPostgres`: initdb
into a temporary directory, pg_ctl start on a free loopback port with its socket inside that
directory; as an unprivileged user when we are root) and stopped at the end of the session.
Tests marked `postgres` are skipped, saying why, only when no binaries can be found; with
HARU_REQUIRE_POSTGRES=1 (CI) a missing PostgreSQL is a failure instead.
"""

from __future__ import annotations

import itertools
import os

import pytest

from tests.support.pg_local import LocalPostgres, find_bindir

_counter = itertools.count(1)


@pytest.fixture(scope="session")
def pg_server():
    if find_bindir() is None:
        reason = (
            "PostgreSQL binaries (initdb, pg_ctl, postgres) not found on PATH, in /usr/lib/postgresql/*/bin "
            "or via pg_config: apt-get install postgresql (or set HARU_PG_BINDIR)"
        )
        if os.environ.get("HARU_REQUIRE_POSTGRES") == "1":
            pytest.fail(reason + " [HARU_REQUIRE_POSTGRES=1]")
        pytest.skip(reason)
    server = LocalPostgres()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def pg_dsn(pg_server):
    """The DSN of a new, empty database on the session's server."""
    import asyncpg

    name = f"t{os.getpid()}_{next(_counter)}"
    admin = await asyncpg.connect(pg_server.dsn("postgres"))
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
    finally:
        await admin.close()
    yield pg_server.dsn(name)


@pytest.fixture
async def pg(pg_dsn):
    """A connection to the fresh database."""
    import asyncpg

    conn = await asyncpg.connect(pg_dsn)
    try:
        yield conn
    finally:
        await conn.close()
