"""Events per second into Postgres through the sink, against a plain COPY of the same rows.

    .venv/bin/python bench/postgres.py [--events 200000] [--rounds 3] [--batch-size 2000] [--durable]

One run starts a nats-server and a local PostgreSQL (from the machine's binaries), stores a
plausible fleet history of N events in HARU_EVENTS (residency walks, GPU detachments with their
lost models, promotions with steps, a few invalid bodies), and then, per round, into a fresh
database each:

  sink   `PostgresSink.run(follow=False)`: replay from NATS, decode, map, batch, COPY/upsert,
         position per transaction: the whole path `haru sink postgres` takes, timed end to end;
  copy   the rows the sink would write (computed beforehand, untimed), written with one
         `copy_records_to_table` per table in one transaction: the floor Postgres sets.

  replay `EventLog.replay` into a no-op handler: what reading the log alone costs, the ceiling
         of any follower, printed so the sink's figure can be read against it.

It prints events per second for each (the median of the rounds) and the ratio sink/copy (the
target is >= 0.5x) and sink/replay. The sink and the COPY use the same server, the same tables
and indexes. The stored messages carry the headers `EventLog.append` writes, as a real log's do.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import asyncpg
import structlog

from haru.host.natsd import NatsServer
from haru.log.eventlog import EventLog
from haru.projections import pg_schema as S
from haru.projections.pg_rows import Carry, plan
from haru.projections.postgres import PostgresSink, migrate, tune_gc
from tests.support import pgdata
from tests.support.pg_local import LocalPostgres

CPU: dict[str, list[float]] = {"sink": [], "copy": [], "replay": []}  # this process's CPU seconds


async def fresh_db(pg: LocalPostgres, name: str) -> str:
    admin = await asyncpg.connect(pg.dsn())
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
    finally:
        await admin.close()
    return pg.dsn(name)


async def count_rows(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        total = 0
        for table in (*S.COPY_TABLES, "operations", "domains"):
            total += await conn.fetchval(f"SELECT count(*) FROM haru.{table}")
        return total
    finally:
        await conn.close()


async def run_sink(pg: LocalPostgres, url: str, n: int, batch_size: int, round_: int) -> tuple[float, int]:
    dsn = await fresh_db(pg, f"sink{round_}")
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)  # untimed, as for the COPY: both measure writing, not creating tables
    finally:
        await conn.close()
    sink = PostgresSink(dsn, [url], batch_size=batch_size, retry=False)
    t, cpu = time.perf_counter(), time.process_time()
    position = await sink.run(follow=False)
    took = time.perf_counter() - t
    CPU["sink"].append(time.process_time() - cpu)
    assert position == n, (position, n)
    return took, await count_rows(dsn)


async def run_copy(pg: LocalPostgres, writes, round_: int) -> tuple[float, int]:
    dsn = await fresh_db(pg, f"copy{round_}")
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
        t, cpu = time.perf_counter(), time.process_time()
        async with conn.transaction():
            for table, rows in writes.copies.items():
                if rows:
                    await conn.copy_records_to_table(
                        table, records=rows, columns=S.COPY_TABLES[table], schema_name=S.SCHEMA
                    )
            if writes.insert_operations:
                await conn.copy_records_to_table(
                    "operations", records=writes.insert_operations, columns=S.OPERATION_COLUMNS, schema_name=S.SCHEMA
                )
            # one row per domain: the last declaration (a plain COPY has no upsert)
            last = {(r[0], r[1]): r for r in writes.upsert_domains}
            if last:
                await conn.copy_records_to_table(
                    "domains", records=list(last.values()), columns=S.DOMAIN_COLUMNS, schema_name=S.SCHEMA
                )
        took = time.perf_counter() - t
        CPU["copy"].append(time.process_time() - cpu)
    finally:
        await conn.close()
    return took, await count_rows(dsn)


async def run_replay(url: str, n: int) -> float:
    async with EventLog.connect([url], writer="bench-replay") as log:

        async def nothing(record) -> None:
            return None

        t, cpu = time.perf_counter(), time.process_time()
        last = await log.replay(nothing, headers=False)
        took = time.perf_counter() - t
        CPU["replay"].append(time.process_time() - cpu)
    assert last == n, (last, n)
    return took


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=5000)
    parser.add_argument("--durable", action="store_true", help="fsync and synchronous_commit on (default off)")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    tune_gc()  # as `haru sink postgres` does

    n = args.events
    with tempfile.TemporaryDirectory() as tmp, LocalPostgres(durable=args.durable) as pg:
        async with NatsServer(Path(tmp) / "nats") as nats_server:
            async with EventLog.connect([nats_server.url], writer="bench") as log:
                await log.ensure()
                items = pgdata.fleet_history(n)
                await pgdata.store(log, items)
                records = await log.history()
            assert len(records) == n
            writes, _ = plan(Carry(), records)
            rows = writes.row_count
            print(
                f"{n} events -> {rows} rows; PostgreSQL at {pg.bindir} "
                f"({'durable' if args.durable else 'fsync off'}), batch size {args.batch_size}"
            )

            sink_s: list[float] = []
            copy_s: list[float] = []
            replay_s: list[float] = []
            for r in range(args.rounds):
                took, sink_rows = await run_sink(pg, nats_server.url, n, args.batch_size, r)
                sink_s.append(took)
                took_c, copy_rows = await run_copy(pg, writes, r)
                copy_s.append(took_c)
                took_r = await run_replay(nats_server.url, n)
                replay_s.append(took_r)
                assert sink_rows == copy_rows == rows, (sink_rows, copy_rows, rows)
                print(
                    f"  round {r + 1}: sink {n / took:>8,.0f} ev/s ({took:.2f} s)   "
                    f"copy {n / took_c:>8,.0f} ev/s ({took_c:.2f} s)   replay {n / took_r:>8,.0f} ev/s ({took_r:.2f} s)"
                )

    sink_eps = n / statistics.median(sink_s)
    copy_eps = n / statistics.median(copy_s)
    replay_eps = n / statistics.median(replay_s)
    ratio = sink_eps / copy_eps
    print(
        f"sink: {sink_eps:,.0f} events/s   plain COPY: {copy_eps:,.0f} events/s   "
        f"replay alone: {replay_eps:,.0f} events/s"
    )
    per_event = {k: statistics.median(v) / n * 1e6 for k, v in CPU.items()}
    print(
        f"this process's CPU per event: sink {per_event['sink']:.1f} us, replay alone {per_event['replay']:.1f} us, "
        f"COPY {per_event['copy']:.1f} us (the rest of the time is Postgres and nats-server; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f})"
    )
    print(
        f"ratio sink/COPY {ratio:.2f}x (target >= 0.5x: {'met' if ratio >= 0.5 else 'NOT met'})   "
        f"ratio sink/replay {sink_eps / replay_eps:.2f}x"
    )


if __name__ == "__main__":
    try:  # the CLI runs the sink on uvloop; so does the benchmark
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
