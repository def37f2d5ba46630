"""The example queries of docs/postgres.md, run as written against a database the sink filled.

The history is appended to a real event log and written by the sink; the expected answers are
worked out by hand from it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from haru.core import events as ev
from haru.core import subjects
from haru.core.specs import DomainSpec
from haru.projections import postgres_queries as Q
from haru.projections.postgres import PostgresSink

pytestmark = pytest.mark.postgres

F = "default"
M = "qwen3.6:27b"
M2 = "mistral-small"
NOW = datetime.now(UTC).replace(microsecond=0)


def ago(days: float = 0, seconds: float = 0) -> datetime:
    return NOW - timedelta(days=days, seconds=seconds)


async def put(log, subject: str, event) -> int:
    return await log.append(subject, event, expect=await log.last_seq_of(subject))


async def fill(log, nats_url: str, dsn: str, history: list[tuple[str, object]]) -> asyncpg.Connection:
    for subject, event in history:
        await put(log, subject, event)
    await PostgresSink(dsn, [nats_url], retry=False, batch_size=4).run(follow=False)
    return await asyncpg.connect(dsn)


def gpu(domain: str, index: int, present: bool | None, at: datetime):
    return subjects.gpu(F, domain, index), ev.GpuObserved(at=at, domain=domain, index=index, present=present)


def model(domain: str, event):
    return subjects.model(F, domain, event.model), event


def test_the_docs_show_every_query_verbatim():
    docs = (__import__("pathlib").Path(__file__).resolve().parents[2] / "docs" / "postgres.md").read_text()
    for title, sql in Q.EXAMPLES.items():
        assert title in docs
        assert sql.strip() in docs, f"docs/postgres.md does not show the query {title!r} as written"


async def test_gpu_detachments_per_domain_and_provider_over_30_days(event_log, nats_server, pg_dsn):
    history = [
        (subjects.decl(F), ev.DomainDeclared(at=ago(60), spec=DomainSpec(name="a", provider="static", region="fra1"))),
        (
            subjects.decl(F),
            ev.DomainDeclared(at=ago(60), spec=DomainSpec(name="b", provider="skypilot", region="us-east-1")),
        ),
        # domain a, GPU 0: detached 40 days ago (outside the window), then twice in it
        gpu("a", 0, True, ago(45)),
        gpu("a", 0, False, ago(40)),
        gpu("a", 0, True, ago(39)),
        gpu("a", 0, False, ago(20)),
        model("a", ev.ModelLost(at=ago(20), domain="a", model=M, reason="gpu_detached")),
        model("a", ev.ModelLost(at=ago(20), domain="a", model=M2, reason="gpu_detached")),
        gpu("a", 0, True, ago(19)),
        gpu("a", 0, False, ago(2)),
        model("a", ev.ModelLost(at=ago(2), domain="a", model=M, reason="gpu_detached")),
        # absent while still absent is not a second detachment
        gpu("a", 0, False, ago(1)),
        # an eviction is not a detachment (and not the provider's doing)
        model("a", ev.ModelLost(at=ago(3), domain="a", model=M2, reason="evicted")),
        # domain b, GPU 1: absent at first sight (never seen attached), then attached and detached once
        gpu("b", 1, False, ago(10)),
        gpu("b", 1, True, ago(9)),
        gpu("b", 1, False, ago(5)),
        model("b", ev.ModelLost(at=ago(5), domain="b", model=M, reason="gpu_detached")),
        # no NVML: presence unknown is never a detachment
        gpu("b", 0, None, ago(4)),
        gpu("b", 0, None, ago(3)),
    ]
    conn = await fill(event_log, nats_server.url, pg_dsn, history)
    try:
        rows = [tuple(r) for r in await conn.fetch(Q.GPU_DETACHMENTS_30D)]
    finally:
        await conn.close()
    assert rows == [
        (F, "a", "static", "fra1", 2, 3),
        (F, "b", "skypilot", "us-east-1", 1, 1),
    ]


async def test_mean_time_to_resident_per_model(event_log, nats_server, pg_dsn):
    history = [
        model("a", ev.ModelLoading(at=ago(seconds=1000), domain="a", model=M)),
        model("a", ev.ModelResident(at=ago(seconds=960), domain="a", model=M)),  # cold start 40 s
        model("a", ev.ModelSleeping(at=ago(seconds=900), domain="a", model=M)),
        model("a", ev.ModelWaking(at=ago(seconds=800), domain="a", model=M)),
        model("a", ev.ModelResident(at=ago(seconds=798.5), domain="a", model=M)),  # wake 1.5 s
        model("a", ev.ModelLost(at=ago(seconds=700), domain="a", model=M, reason="process_exited")),
        model("a", ev.ModelLoading(at=ago(seconds=690), domain="a", model=M)),
        model("a", ev.ModelResident(at=ago(seconds=630), domain="a", model=M)),  # cold start 60 s
        # the same model on the other domain counts for the model too
        model("b", ev.ModelLoading(at=ago(seconds=500), domain="b", model=M)),
        model("b", ev.ModelResident(at=ago(seconds=450), domain="b", model=M)),  # cold start 50 s
        model("b", ev.ModelLoading(at=ago(seconds=400), domain="b", model=M2)),
        model("b", ev.ModelResident(at=ago(seconds=390), domain="b", model=M2)),  # 10 s
        model("b", ev.ModelLoading(at=ago(seconds=300), domain="b", model=M2)),
        model("b", ev.ModelFailed(at=ago(seconds=290), domain="b", model=M2, runtime_said="OOM")),  # never resident
    ]
    conn = await fill(event_log, nats_server.url, pg_dsn, history)
    try:
        rows = [tuple(r) for r in await conn.fetch(Q.MEAN_TIME_TO_RESIDENT)]
    finally:
        await conn.close()
    assert rows == [
        (F, M2, "loading", 1, 10_000, 10_000),
        (F, M, "loading", 3, 50_000, 60_000),
        (F, M, "waking", 1, 1_500, 1_500),
    ]


async def test_failover_durations_per_step(event_log, nats_server, pg_dsn):
    op = subjects.op(F)

    def steps(op_id: str, start: float, plan: list[tuple[str, float, bool]]):
        out = [(op, ev.PromotionRequested(at=ago(seconds=start), op_id=op_id, target="b", source="a"))]
        t = start
        for step, took, ok in plan:
            out.append((op, ev.StepStarted(at=ago(seconds=t), op_id=op_id, step=step)))
            t -= took
            done = ev.StepCompleted if ok else ev.StepFailed
            out.append((op, done(at=ago(seconds=t), op_id=op_id, step=step, took_ms=int(took * 1000))))
            if not ok:
                out.append((op, ev.OperationAborted(at=ago(seconds=t), op_id=op_id, step=step)))
                return out
        out.append((op, ev.OperationCompleted(at=ago(seconds=t), op_id=op_id)))
        return out

    history = [
        *steps(
            "op1",
            1000,
            [
                ("stop_training", 1.0, True),
                ("verify_gpu", 0.2, True),
                ("wake", 3.0, True),
                ("probe", 0.5, True),
                ("flip", 0.01, True),
            ],
        ),
        *steps("op2", 500, [("stop_training", 3.0, True), ("verify_gpu", 0.4, True), ("wake", 5.0, False)]),
        *steps("op3", 100, [("stop_training", 2.0, True)]),
        (op, ev.DemotionRequested(at=ago(seconds=50), op_id="op4", target="a")),
        (op, ev.StepStarted(at=ago(seconds=50), op_id="op4", step="sleep")),
        (op, ev.StepCompleted(at=ago(seconds=48), op_id="op4", step="sleep")),
        (op, ev.StepStarted(at=ago(seconds=48), op_id="op4", step="start_training")),  # still running
    ]
    conn = await fill(event_log, nats_server.url, pg_dsn, history)
    try:
        rows = [tuple(r) for r in await conn.fetch(Q.FAILOVER_STEP_DURATIONS)]
    finally:
        await conn.close()
    # kind, step, runs, failed, restarted, mean, p50, p95, max
    assert rows == [
        ("demotion", "sleep", 1, 0, 0, 2_000, 2_000, 2_000, 2_000),
        ("promotion", "stop_training", 3, 0, 0, 2_000, 2_000, 3_000, 3_000),
        ("promotion", "verify_gpu", 2, 0, 0, 300, 200, 400, 400),
        ("promotion", "wake", 2, 1, 0, 4_000, 3_000, 5_000, 5_000),
        ("promotion", "probe", 1, 0, 0, 500, 500, 500, 500),
        ("promotion", "flip", 1, 0, 0, 10, 10, 10, 10),
    ]


async def test_open_incidents_and_incidents_per_domain(event_log, nats_server, pg_dsn):
    history = [
        (subjects.decl(F), ev.DomainDeclared(at=ago(60), spec=DomainSpec(name="b", provider="skypilot"))),
        model("a", ev.ModelLost(at=ago(seconds=7200), domain="a", model=M, reason="unhealthy", detail="probe 500")),
        model("a", ev.ModelResident(at=ago(seconds=7000), domain="a", model=M)),  # closed: 200 s
        model("b", ev.ModelLost(at=ago(seconds=3600), domain="b", model=M2, reason="gpu_detached", detail="gone")),
        model("b", ev.ModelLoading(at=ago(seconds=3500), domain="b", model=M2)),  # loading is not resident
        model("a", ev.ModelLost(at=ago(seconds=600), domain="a", model=M, reason="evicted", detail="OOM")),
        model("a", ev.ModelLost(at=ago(days=40), domain="a", model=M2, reason="evicted")),  # old and open
    ]
    conn = await fill(event_log, nats_server.url, pg_dsn, history)
    try:
        open_rows = await conn.fetch(Q.OPEN_INCIDENTS)
        per_domain = [tuple(r) for r in await conn.fetch(Q.INCIDENTS_PER_DOMAIN_30D)]
    finally:
        await conn.close()
    assert [(r["domain"], r["model"], r["reason"], r["detail"], r["opened_at"]) for r in open_rows] == [
        ("a", M2, "evicted", "", ago(days=40)),
        ("b", M2, "gpu_detached", "gone", ago(seconds=3600)),
        ("a", M, "evicted", "OOM", ago(seconds=600)),
    ]
    open_for = [r["open_for_s"] for r in open_rows]
    # now() is the database's; NOW was fixed when this module was imported, maybe minutes ago
    since_import = (datetime.now(UTC) - NOW).total_seconds()
    assert abs(open_for[1] - 3600 - since_import) < 120 and abs(open_for[2] - 600 - since_import) < 120
    # fleet, domain, provider, reason, incidents, still open, total s, longest s (open ones up to now)
    assert per_domain[0][:6] == (F, "b", "skypilot", "gpu_detached", 1, 1)
    assert abs(per_domain[0][6] - 3600 - since_import) < 120
    assert per_domain[1][:6] == (F, "a", "unknown", "evicted", 1, 1)
    assert per_domain[2] == (F, "a", "unknown", "unhealthy", 1, 0, 200, 200)


async def test_a_cascading_promotion_is_one_operation_row_naming_the_standbys_it_tried(event_log, nats_server, pg_dsn):
    op = subjects.op(F)
    history = [
        (
            op,
            ev.PromotionRequested(
                at=ago(seconds=60), op_id="op-c", target="b", source="a", reason="domain_unreachable", cascade=True
            ),
        ),
        (op, ev.StepStarted(at=ago(seconds=59), op_id="op-c", step="wake")),
        (op, ev.StepFailed(at=ago(seconds=58), op_id="op-c", step="wake", error="out of memory")),
        (op, ev.PromotionRetargeted(at=ago(seconds=58), op_id="op-c", target="c", previous="b", step="wake")),
        (op, ev.StepStarted(at=ago(seconds=57), op_id="op-c", step="probe")),
        (op, ev.StepFailed(at=ago(seconds=56), op_id="op-c", step="probe", error="500")),
        (op, ev.PromotionRetargeted(at=ago(seconds=56), op_id="op-c", target="d", previous="c", step="probe")),
        (op, ev.OperationCompleted(at=ago(seconds=50), op_id="op-c")),
    ]
    conn = await fill(event_log, nats_server.url, pg_dsn, history)  # batches of 4: the moves span batches
    try:
        row = await conn.fetchrow("SELECT target, tried, outcome FROM haru.operations WHERE op_id = 'op-c'")
        assert (row["target"], list(row["tried"]), row["outcome"]) == ("d", ["b", "c"], "completed")
    finally:
        await conn.close()
