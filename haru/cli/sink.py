"""`haru sink postgres --dsn $DATABASE_URL`: the Postgres read model of HARU_EVENTS.

Follows the event log and writes residency transitions, incidents, operations and their steps,
GPU observations and domain declarations into the `haru` schema of a Postgres database, exactly
once (the position is stored in the same transaction as the rows). Applies its own schema
migrations first. `--once` writes what is stored now and exits; `--migrate-only` only migrates.
"""

from __future__ import annotations

import argparse
import os

from haru.cli.common import (
    ExitStatus,
    add_log_options,
    add_nats_options,
    configure_logging,
    emit_json,
    fail,
    nats_servers,
)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sink",
        help="write the event log into another store (postgres)",
        description="Followers that write HARU_EVENTS into another store for queries over history.",
    )
    sub = p.add_subparsers(dest="sink", metavar="<store>")
    sub.required = True
    pg = sub.add_parser(
        "postgres",
        help="follow HARU_EVENTS into PostgreSQL (residency history, incidents, operations, GPUs)",
        description=(
            "Follow HARU_EVENTS and write the Postgres read model (schema `haru`): residency "
            "transitions, incidents, operations and steps, GPU observations, domains. Applies its own "
            "migrations; keeps its position in the same transaction as its rows, so it resumes exactly "
            "where it stopped. One sink writes a database at a time; a second one waits as a standby."
        ),
    )
    pg.add_argument(
        "--dsn",
        default=os.environ.get("HARU_DATABASE_URL") or os.environ.get("DATABASE_URL"),
        help="PostgreSQL DSN, e.g. postgresql://haru@db/haru (env HARU_DATABASE_URL or DATABASE_URL)",
    )
    add_nats_options(pg)
    pg.add_argument("--batch-size", type=int, default=5000, help="events per transaction at most (default %(default)s)")
    pg.add_argument(
        "--flush-ms", type=int, default=200, help="write a partial batch after this long (default %(default)s ms)"
    )
    pg.add_argument("--once", action="store_true", help="write what the log holds now, then exit")
    pg.add_argument("--migrate-only", action="store_true", help="apply the schema migrations and exit")
    pg.add_argument("--json", action="store_true", help="print the result (--once, --migrate-only) as JSON")
    add_log_options(pg)
    pg.set_defaults(handler=run)


async def run(args: argparse.Namespace) -> ExitStatus:
    if not args.dsn:
        return fail("no database: pass --dsn postgresql://user@host/db (or set DATABASE_URL)", ExitStatus.USAGE)
    if args.batch_size < 1 or args.flush_ms < 1:
        return fail("--batch-size and --flush-ms must be positive", ExitStatus.USAGE)
    configure_logging(args.log_format, args.log_level)

    import asyncpg

    from haru.core.errors import LogUnavailable
    from haru.projections.postgres import (
        PostgresSink,
        SinkError,
        SinkUnavailable,
        connect,
        migrate,
        schema_version,
        tune_gc,
    )

    if args.migrate_only:
        try:
            conn = await connect(args.dsn)
        except SinkUnavailable as exc:
            return fail(str(exc), ExitStatus.UNAVAILABLE)
        except SinkError as exc:
            return fail(str(exc))
        try:
            applied = await migrate(conn)
            version = await schema_version(conn)
        except SinkError as exc:
            return fail(str(exc))
        finally:
            await conn.close()
        if args.json:
            emit_json({"applied": applied, "version": version})
        else:
            print(
                f"schema at version {version}"
                + (f" (applied {', '.join(map(str, applied))})" if applied else " (nothing to apply)")
            )
        return ExitStatus.OK

    tune_gc()
    sink = PostgresSink(
        args.dsn,
        nats_servers(args.nats_url),
        creds=args.nats_creds,
        batch_size=args.batch_size,
        flush_interval=args.flush_ms / 1000,
        retry=not args.once,
    )
    try:
        position = await sink.run(follow=not args.once)
    except (SinkUnavailable, LogUnavailable) as exc:
        return fail(str(exc), ExitStatus.UNAVAILABLE)
    except SinkError as exc:
        return fail(str(exc))
    except asyncpg.PostgresError as exc:
        return fail(f"Postgres refused a write: {exc} (SQLSTATE {exc.sqlstate}); the position did not move")
    if args.json:
        emit_json({"position": position, "written": sink.written})
    else:
        print(f"wrote {sink.written} events; position {position}")
    return ExitStatus.OK
