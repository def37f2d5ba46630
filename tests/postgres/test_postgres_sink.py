"""`haru sink postgres` against a real nats-server and a real PostgreSQL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest

from haru.core import events as ev
from haru.core import subjects
from haru.core.specs import DomainSpec
from haru.host.tasks import cancel_and_wait
from haru.log.eventlog import EventLog
from haru.projections import pg_schema as S
from haru.projections.postgres import PostgresSink
from tests.support import pgdata

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parents[2]
HARU = (
    [str(ROOT / ".venv" / "bin" / "haru")]
    if (ROOT / ".venv" / "bin" / "haru").exists()
    else [sys.executable, "-m", "haru.cli"]
)
F = "default"
M = "qwen3.6:27b"
M2 = "meta-llama/Llama-3.1-8B-Instruct"
T0 = datetime(2026, 11, 20, 8, 0, 0, tzinfo=UTC)


def t(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


async def put(log: EventLog, subject: str, event) -> int:
    return await log.append(subject, event, expect=await log.last_seq_of(subject))


async def once(dsn: str, url: str, **kwargs) -> PostgresSink:
    sink = PostgresSink(dsn, [url], retry=False, **kwargs)
    await sink.run(follow=False)
    return sink


async def test_incidents_match_the_events_and_survive_a_restart(event_log, nats_server, pg_dsn):
    log = event_log
    decl = subjects.decl(F)
    await put(log, decl, ev.DomainDeclared(at=t(0), spec=DomainSpec(name="a", provider="static", region="fra1")))
    await put(log, decl, ev.DomainDeclared(at=t(0), spec=DomainSpec(name="b", provider="skypilot", region="us-east-1")))
    a, b = subjects.model(F, "a", M), subjects.model(F, "b", M2)
    await put(log, a, ev.ModelLoading(at=t(1), domain="a", model=M))
    await put(log, a, ev.ModelResident(at=t(48), domain="a", model=M, warmup_ms=900))
    opened = await put(log, a, ev.ModelLost(at=t(100), domain="a", model=M, reason="gpu_detached", detail="GPU 0 gone"))
    await put(log, a, ev.ModelLoading(at=t(110), domain="a", model=M))
    await put(log, a, ev.ModelLost(at=t(120), domain="a", model=M, reason="process_exited", exit_code=137))
    await put(log, a, ev.ModelLoading(at=t(130), domain="a", model=M))
    closed = await put(log, a, ev.ModelResident(at=t(195.5), domain="a", model=M))
    await put(log, b, ev.ModelResident(at=t(10), domain="b", model=M2))
    open_seq = await put(log, b, ev.ModelLost(at=t(200), domain="b", model=M2, reason="evicted", detail="OOM killer"))
    bad = await log.js.publish(subjects.model(F, "b", M2), b'{"type":"model_lost","domain":"b"}')
    await put(log, subjects.agent(F, "a"), ev.AgentStarted(at=t(0), domain="a", host="gpu-a"))

    sink = await once(pg_dsn, nats_server.url, batch_size=3)  # small batches: spans cross batches
    assert sink.position == await log.last_seq()
    conn = await asyncpg.connect(pg_dsn)
    try:
        rows = await conn.fetch("SELECT * FROM haru.incidents ORDER BY opened_seq")
        assert [dict(r) for r in rows] == [
            dict(
                opened_seq=opened,
                fleet=F,
                domain="a",
                model=M,
                reason="gpu_detached",
                detail="GPU 0 gone",
                opened_at=t(100),
                closed_seq=closed,
                closed_at=t(195.5),
                duration_ms=95_500,
            ),
            dict(
                opened_seq=open_seq,
                fleet=F,
                domain="b",
                model=M2,
                reason="evicted",
                detail="OOM killer",
                opened_at=t(200),
                closed_seq=None,
                closed_at=None,
                duration_ms=None,
            ),
        ]
        states = await conn.fetch(
            "SELECT seq, state, reason, observed_at, recorded_at FROM haru.residency_transitions "
            "WHERE domain = 'a' ORDER BY seq"
        )
        assert [r["state"] for r in states] == ["loading", "resident", "lost", "loading", "lost", "loading", "resident"]
        assert all(r["recorded_at"] > r["observed_at"] for r in states)  # JetStream time is now; `at` is 2026-11-20
        skipped = await conn.fetchrow("SELECT * FROM haru.skipped_events")
        assert skipped["seq"] == bad.seq and "at" in skipped["error"]
        assert (await conn.fetchrow("SELECT provider, region FROM haru.domains WHERE domain = 'b'"))[:] == (
            "skypilot",
            "us-east-1",
        )
    finally:
        await conn.close()

    # a new sink process: the open incident is read back from the database and closed by an update
    await put(log, b, ev.ModelLoading(at=t(205), domain="b", model=M2))
    closer = await put(log, b, ev.ModelResident(at=t(260.25), domain="b", model=M2))
    await once(pg_dsn, nats_server.url)
    conn = await asyncpg.connect(pg_dsn)
    try:
        row = await conn.fetchrow("SELECT * FROM haru.incidents WHERE opened_seq = $1", open_seq)
        assert (row["closed_seq"], row["closed_at"], row["duration_ms"]) == (closer, t(260.25), 60_250)
        assert await conn.fetchval("SELECT count(*) FROM haru.incidents WHERE closed_seq IS NULL") == 0
        assert await conn.fetchval("SELECT last_seq FROM haru.sink_position") == closer
    finally:
        await conn.close()


async def test_a_pull_is_stored_with_its_progress_and_where_the_files_came_from(event_log, nats_server, pg_dsn):
    """model_pulling rows (issue 13): the read model says a model was being fetched, how far, and from
    where once every file was verified, before it loaded."""
    log = event_log
    a = subjects.model(F, "a", M)
    ref = "hf:Qwen/Qwen3-0.6B-GGUF:Q4_K_M"
    await put(log, a, ev.ModelPulling(at=t(1), domain="a", model=M, reference=ref, total_bytes=4096))
    await put(log, a, ev.ModelPulling(at=t(6), domain="a", model=M, reference=ref, done_bytes=1024, total_bytes=4096))
    await put(
        log,
        a,
        ev.ModelPulling(
            at=t(9),
            domain="a",
            model=M,
            reference=ref,
            done_bytes=4096,
            total_bytes=4096,
            origin="https://huggingface.co/Qwen/Qwen3-0.6B-GGUF@abc123",
        ),
    )
    await put(log, a, ev.ModelLoading(at=t(10), domain="a", model=M))
    await once(pg_dsn, nats_server.url)
    conn = await asyncpg.connect(pg_dsn)
    try:
        rows = await conn.fetch(
            "SELECT state, reference, done_bytes, total_bytes, detail FROM haru.residency_transitions "
            "WHERE domain = 'a' ORDER BY seq"
        )
        assert [tuple(r) for r in rows] == [
            ("pulling", ref, 0, 4096, ""),
            ("pulling", ref, 1024, 4096, ""),
            ("pulling", ref, 4096, 4096, "https://huggingface.co/Qwen/Qwen3-0.6B-GGUF@abc123"),
            ("loading", None, None, None, ""),
        ]
    finally:
        await conn.close()


async def test_the_sink_follows_new_events_and_flushes_partial_batches(event_log, nats_server, pg_dsn):
    sink = PostgresSink(pg_dsn, [nats_server.url], batch_size=1000, flush_interval=0.05, retry=False)
    task = asyncio.create_task(sink.run(follow=True))
    conn = await asyncpg.connect(pg_dsn)
    try:
        subject = subjects.model(F, "a", M)
        last = 0
        for i in range(5):
            await put(event_log, subject, ev.ModelLoading(at=t(i * 10), domain="a", model=M))
            last = await put(event_log, subject, ev.ModelResident(at=t(i * 10 + 3), domain="a", model=M))
        async with asyncio.timeout(20):
            while await _position(conn) != last:
                assert not task.done(), task
                await asyncio.sleep(0.02)
        assert await conn.fetchval("SELECT count(*) FROM haru.residency_transitions") == 10
    finally:
        await cancel_and_wait(task)
        assert task.cancelled()
        await conn.close()


async def test_a_second_sink_waits_for_the_first_and_writes_nothing_twice(event_log, nats_server, pg_dsn):
    last = await pgdata.store(event_log, pgdata.fleet_history(3000))
    results = await asyncio.gather(*(once(pg_dsn, nats_server.url, batch_size=200) for _ in range(2)))
    assert sorted(s.written for s in results) == [0, last]
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await _position(conn) == last
        assert await _event_rows(conn) == _expected_event_rows(pgdata.fleet_history(3000))
    finally:
        await conn.close()


@pytest.mark.timeout(180)
async def test_a_sink_killed_mid_stream_and_restarted_writes_every_event_exactly_once(
    event_log, nats_server, pg_server, pg_dsn, tmp_path
):
    items = pgdata.fleet_history(20_000)
    last = await pgdata.store(event_log, items)
    assert last == len(items)
    conn = await asyncpg.connect(pg_dsn)
    procs: list[subprocess.Popen] = []

    def start(*extra: str) -> subprocess.Popen:
        err = open(tmp_path / f"sink{len(procs)}.err", "wb")
        proc = subprocess.Popen(
            [*HARU, "sink", "postgres", "--dsn", pg_dsn, "--nats-url", nats_server.url, "--batch-size", "250", *extra],
            stdout=subprocess.PIPE, stderr=err, env={**os.environ, "HARU_LOG_FORMAT": "json"},
        )  # fmt: skip
        procs.append(proc)
        return proc

    try:
        kills = []
        for _ in range(2):  # killed twice, each time in the middle of the stream
            proc = start()
            before = await _position(conn) or 0
            async with asyncio.timeout(60):
                while ((await _position(conn)) or 0) <= before:
                    assert proc.poll() is None, (tmp_path / f"sink{len(procs) - 1}.err").read_text()
                    await asyncio.sleep(0.003)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            kills.append(await _position(conn))
        assert 0 < kills[0] < kills[1] < last, kills  # both kills landed mid-stream

        proc = start("--once", "--json")
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, (tmp_path / f"sink{len(procs) - 1}.err").read_text()
        assert b'"position":%d' % last in out
        assert await _position(conn) == last

        expected = _expected_event_rows(items)
        assert await _event_rows(conn) == expected  # every event once: no gap, no duplicate
        for table in ("residency_transitions", "gpu_observations", "skipped_events"):
            seqs = [r[0] for r in await conn.fetch(f"SELECT seq FROM haru.{table} ORDER BY seq")]
            assert len(seqs) == len(set(seqs)) == expected[table]

        # and the killed-and-restarted database equals one written in a single uninterrupted run
        admin = await asyncpg.connect(pg_server.dsn())
        await admin.execute('CREATE DATABASE "reference_run" TEMPLATE template0')
        await admin.close()
        reference = pg_server.dsn("reference_run")
        await once(reference, nats_server.url, batch_size=5000)
        ref = await asyncpg.connect(reference)
        try:
            for table, columns in _DATA_TABLES.items():
                query = f"SELECT {', '.join(columns)} FROM haru.{table} ORDER BY {', '.join(columns)}"
                assert await conn.fetch(query) == await ref.fetch(query), table
        finally:
            await ref.close()
        assert await conn.fetchval("SELECT count(*) FROM haru.incidents") > 100
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        await conn.close()


async def test_cli_without_a_database_says_how_to_give_one():
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "HARU_DATABASE_URL")}
    out = subprocess.run([*HARU, "sink", "postgres"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2
    assert "--dsn" in out.stderr and "DATABASE_URL" in out.stderr


async def test_cli_migrate_only_reports_the_schema_version(pg_dsn):
    cmd = [*HARU, "sink", "postgres", "--dsn", pg_dsn, "--migrate-only", "--json"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    applied = ",".join(str(m.version) for m in S.MIGRATIONS)
    assert first.stdout.strip() == '{"applied":[' + applied + '],"version":' + str(S.LATEST) + "}"
    assert second.stdout.strip() == '{"applied":[],"version":' + str(S.LATEST) + "}"


async def test_cli_with_an_unreachable_database_exits_unavailable(nats_server):
    out = subprocess.run(
        [*HARU, "sink", "postgres", "--dsn", "postgresql://haru@127.0.0.1:1/haru", "--once",
         "--nats-url", nats_server.url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 6, out.stderr
    assert "cannot reach Postgres" in out.stderr


# --------------------------------------------------------------------------------------- helpers

_DATA_TABLES = {
    "residency_transitions": S.TRANSITION_COLUMNS,
    "gpu_observations": S.GPU_COLUMNS,
    "incidents": S.INCIDENT_COLUMNS,
    "operations": S.OPERATION_COLUMNS,
    "operation_steps": S.STEP_COLUMNS,
    "skipped_events": S.SKIPPED_COLUMNS,
    "domains": S.DOMAIN_COLUMNS,
}


async def _position(conn) -> int | None:
    try:
        return await conn.fetchval("SELECT last_seq FROM haru.sink_position WHERE stream = 'HARU_EVENTS'")
    except asyncpg.UndefinedTableError:
        return None


async def _event_rows(conn) -> dict[str, int]:
    out = {}
    for table in ("residency_transitions", "gpu_observations", "skipped_events", "operations"):
        out[table] = await conn.fetchval(f"SELECT count(*) FROM haru.{table}")
    out["steps_started"] = await conn.fetchval("SELECT count(*) FROM haru.operation_steps")
    out["steps_finished"] = await conn.fetchval("SELECT count(*) FROM haru.operation_steps WHERE outcome IS NOT NULL")
    out["losses_that_opened"] = await conn.fetchval("SELECT count(*) FROM haru.incidents")
    return out


def _expected_event_rows(items: list[tuple[str, bytes]]) -> dict[str, int]:
    """What the events say, counted independently of the sink's mapping."""
    tags: Counter[str] = Counter()
    invalid = 0
    open_: set[tuple[str, str]] = set()
    opened = 0
    for _subject, data in items:
        try:
            e = ev.decode(data)
        except Exception:
            invalid += 1
            continue
        tags[ev.tag_of(e)] += 1
        if isinstance(e, ev.ModelLost) and (e.domain, e.model) not in open_:
            open_.add((e.domain, e.model))
            opened += 1
        elif isinstance(e, ev.ModelResident):
            open_.discard((e.domain, e.model))
    residency = sum(
        tags[t]
        for t in (
            "model_loading",
            "model_resident",
            "model_sleeping",
            "model_waking",
            "model_lost",
            "model_failed",
            "model_stopped",
        )
    )
    return {
        "residency_transitions": residency,
        "gpu_observations": tags["gpu_observed"],
        "skipped_events": invalid,
        "operations": tags["promotion_requested"] + tags["demotion_requested"],
        "steps_started": tags["step_started"],
        "steps_finished": tags["step_completed"] + tags["step_failed"],
        "losses_that_opened": opened,
    }


@pytest.mark.timeout(120)
async def test_a_following_sink_survives_a_postgres_restart_and_resumes_exactly_once(event_log, nats_server, tmp_path):
    """Its own server (the session's is shared): crash Postgres under the sink, start it again."""
    from tests.support.pg_local import LocalPostgres

    pg_server = LocalPostgres()
    await asyncio.to_thread(pg_server.start)
    try:
        dsn = pg_server.dsn("postgres")
        first = await pgdata.store(event_log, pgdata.fleet_history(2000, seed=3))
        sink = PostgresSink(dsn, [nats_server.url], batch_size=300, flush_interval=0.05, retry=True, retry_max=0.5)
        task = asyncio.create_task(sink.run(follow=True))
        try:
            await _wait_position(dsn, first, task)
            await asyncio.to_thread(pg_server.restart, mode="immediate", down_for=1.0)  # a crash, then back
            subject = subjects.model(F, "a", M)
            last = 0
            for i in range(3):
                await put(event_log, subject, ev.ModelLoading(at=t(i), domain="a", model=M))
                last = await put(event_log, subject, ev.ModelResident(at=t(i + 0.5), domain="a", model=M))
            await _wait_position(dsn, last, task)
        finally:
            await cancel_and_wait(task)
            assert task.cancelled()
        conn = await asyncpg.connect(dsn)
        try:
            expected = _expected_event_rows(pgdata.fleet_history(2000, seed=3))
            got = await _event_rows(conn)
            assert got["residency_transitions"] == expected["residency_transitions"] + 6
            assert got["gpu_observations"] == expected["gpu_observations"]
            seqs = [r[0] for r in await conn.fetch("SELECT seq FROM haru.residency_transitions")]
            assert len(seqs) == len(set(seqs))
        finally:
            await conn.close()
    finally:
        await asyncio.to_thread(pg_server.stop)


async def _wait_position(dsn: str, target: int, task: asyncio.Task, timeout: float = 40) -> None:
    async with asyncio.timeout(timeout):
        while True:
            assert not task.done(), task
            try:
                conn = await asyncpg.connect(dsn)
                try:
                    if await _position(conn) == target:
                        return
                finally:
                    await conn.close()
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                pass  # the server is restarting
            await asyncio.sleep(0.05)


@pytest.mark.timeout(120)
async def test_a_following_sink_rides_out_a_nats_restart(event_log, nats_server, pg_dsn):
    first = await pgdata.store(event_log, pgdata.fleet_history(1000, seed=5))
    sink = PostgresSink(
        pg_dsn,
        [nats_server.url],
        batch_size=300,
        flush_interval=0.05,
        retry=True,
        retry_max=0.5,
        stall_interval=0.3,
        stall_checks=2,
    )
    task = asyncio.create_task(sink.run(follow=True))
    try:
        await _wait_position(pg_dsn, first, task)
        await asyncio.to_thread(nats_server.stop_sync)
        await asyncio.sleep(0.5)
        await asyncio.to_thread(nats_server.start_sync)
        subject = subjects.model(F, "b", M2)
        last = 0
        async with asyncio.timeout(30):  # the test's own connection reconnects too
            while True:
                try:
                    await put(event_log, subject, ev.ModelLoading(at=t(1), domain="b", model=M2))
                    last = await put(event_log, subject, ev.ModelResident(at=t(2), domain="b", model=M2))
                    break
                except Exception:
                    await asyncio.sleep(0.2)
        await _wait_position(pg_dsn, last, task, timeout=12)  # nats-py alone takes ~20 s to notice
    finally:
        await cancel_and_wait(task)
        assert task.cancelled()
    conn = await asyncpg.connect(pg_dsn)
    try:
        seqs = [r[0] for r in await conn.fetch("SELECT seq FROM haru.residency_transitions")]
        assert len(seqs) == len(set(seqs))
        assert last in seqs
    finally:
        await conn.close()


async def test_cli_with_a_malformed_dsn_says_what_a_dsn_looks_like():
    out = subprocess.run(
        [*HARU, "sink", "postgres", "--dsn", "db.internal/haru", "--migrate-only"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out.stderr
    assert "not a usable PostgreSQL URL" in out.stderr and "postgresql://" in out.stderr


async def test_cli_once_before_the_stream_exists_says_to_start_haru(nats_server, pg_dsn):
    out = subprocess.run(
        [*HARU, "sink", "postgres", "--dsn", pg_dsn, "--once", "--nats-url", nats_server.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 6, out.stderr
    assert "HARU_EVENTS does not exist yet" in out.stderr


async def test_huge_values_are_stored_and_an_unstorable_one_stops_the_sink_saying_where(event_log, nats_server, pg_dsn):
    subject = subjects.model(F, "a", M)
    big = await put(event_log, subject, ev.ModelResident(at=t(1), domain="a", model=M, warmup_ms=2**40))
    await once(pg_dsn, nats_server.url)
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await conn.fetchval("SELECT warmup_ms FROM haru.residency_transitions WHERE seq = $1", big) == 2**40
        bad = await put(event_log, subject, ev.ModelResident(at=t(2), domain="a", model=M, warmup_ms=2**63))
        from haru.projections.postgres import SinkError

        with pytest.raises(SinkError, match=f"events {bad}..{bad} hold a value Postgres cannot store"):
            await once(pg_dsn, nats_server.url)
        assert await _position(conn) == big  # nothing of the batch was written, the position did not move
    finally:
        await conn.close()
