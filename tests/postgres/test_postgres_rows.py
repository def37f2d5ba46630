"""The pure mapping from log records to Postgres rows (projections.pg_rows): no database here."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from haru.core import events as ev
from haru.core import subjects
from haru.core.specs import DomainSpec, GpuSpec
from haru.log.eventlog import Record
from haru.projections import pg_schema as S
from haru.projections.pg_rows import Carry, OpenSpan, carry_from_rows, plan

T0 = datetime(2026, 11, 1, 12, 0, 0, tzinfo=UTC)
F = "default"


def at(ms: int) -> datetime:
    return T0 + timedelta(milliseconds=ms)


def ns(ms: int) -> int:
    return int(at(ms).timestamp() * 1000) * 1_000_000


def rec(seq: int, subject: str, event, *, recorded_ms: int | None = None) -> Record:
    data = ev.encode(event)
    return Record(seq, subject, ns(recorded_ms if recorded_ms is not None else seq * 1000 + 5), data, event, "")


def model_rec(seq: int, event, domain: str = "a", model: str = "qwen3.6:27b") -> Record:
    return rec(seq, subjects.model(F, domain, model), event)


def rows(table: str, writes) -> list[dict]:
    return [dict(zip(S.COPY_TABLES[table], r, strict=True)) for r in writes.copies[table]]


def test_each_residency_event_is_one_transition_row_with_both_times():
    m = "qwen3.6:27b"
    records = [
        model_rec(1, ev.ModelLoading(at=at(100), domain="a", model=m, by="agent:default/a@h")),
        model_rec(2, ev.ModelResident(at=at(47_100), domain="a", model=m, warmup_ms=812)),
        model_rec(3, ev.ModelSleeping(at=at(50_000), domain="a", model=m)),
        model_rec(4, ev.ModelWaking(at=at(51_000), domain="a", model=m)),
        model_rec(
            5,
            ev.ModelLost(at=at(52_000), domain="a", model=m, reason="process_exited", detail="signal 9", exit_code=137),
        ),
        model_rec(6, ev.ModelFailed(at=at(53_000), domain="a", model=m, runtime_said="CUDA out of memory")),
        model_rec(7, ev.ModelStopped(at=at(54_000), domain="a", model=m, detail="retired")),
    ]
    writes, _ = plan(Carry(), records)
    got = rows("residency_transitions", writes)
    assert [r["state"] for r in got] == ["loading", "resident", "sleeping", "waking", "lost", "failed", "stopped"]
    assert [r["seq"] for r in got] == [1, 2, 3, 4, 5, 6, 7]
    assert {(r["fleet"], r["domain"], r["model"]) for r in got} == {(F, "a", m)}
    assert got[0]["observed_at"] == at(100) and got[0]["recorded_at"] == at(1005)
    assert got[0]["writer"] == "agent:default/a@h"
    assert got[1]["warmup_ms"] == 812 and got[0]["warmup_ms"] is None
    assert (got[4]["reason"], got[4]["detail"], got[4]["exit_code"]) == ("process_exited", "signal 9", 137)
    assert got[5]["reason"] is None and got[5]["detail"] == "CUDA out of memory"
    assert got[6]["detail"] == "retired"
    assert writes.last_seq == 7


def test_a_loss_opens_an_incident_and_the_next_resident_closes_it_with_its_duration():
    m = "qwen3.6:27b"
    records = [
        model_rec(10, ev.ModelResident(at=at(0), domain="a", model=m)),
        model_rec(11, ev.ModelLost(at=at(1_000), domain="a", model=m, reason="gpu_detached", detail="GPU 0 gone")),
        model_rec(12, ev.ModelLoading(at=at(2_000), domain="a", model=m)),
        model_rec(13, ev.ModelLost(at=at(3_000), domain="a", model=m, reason="process_exited")),  # still the same
        model_rec(14, ev.ModelLoading(at=at(4_000), domain="a", model=m)),
        model_rec(15, ev.ModelResident(at=at(61_500), domain="a", model=m)),
    ]
    writes, carry = plan(Carry(), records)
    assert rows("incidents", writes) == [
        dict(
            opened_seq=11,
            fleet=F,
            domain="a",
            model=m,
            reason="gpu_detached",
            detail="GPU 0 gone",
            opened_at=at(1_000),
            closed_seq=15,
            closed_at=at(61_500),
            duration_ms=60_500,
        )
    ]
    assert writes.close_incidents == [] and carry.incidents == {}


def test_an_incident_open_at_the_end_of_a_batch_is_carried_and_closed_by_an_update_later():
    m = "mistral-small"
    first, carry = plan(Carry(), [model_rec(20, ev.ModelLost(at=at(0), domain="b", model=m, reason="evicted"), "b", m)])
    assert rows("incidents", first)[0]["closed_seq"] is None
    assert carry.incidents == {(F, "b", m): OpenSpan(20, at(0))}
    # a resident on another model or domain does not close it
    second, carry = plan(carry, [model_rec(21, ev.ModelResident(at=at(5), domain="a", model=m), "a", m)])
    assert second.close_incidents == [] and (F, "b", m) in carry.incidents
    third, carry = plan(carry, [model_rec(22, ev.ModelResident(at=at(2_250), domain="b", model=m), "b", m)])
    assert third.close_incidents == [(20, 22, at(2_250), 2_250)]
    assert third.copies["incidents"] == [] and carry.incidents == {}


def test_closing_then_reopening_in_one_batch_closes_the_carried_one_and_opens_a_new_one():
    m = "gemma-3-12b"
    carry = Carry(incidents={(F, "a", m): OpenSpan(5, at(0))})
    writes, carry = plan(
        carry,
        [
            model_rec(30, ev.ModelResident(at=at(1_000), domain="a", model=m), model=m),
            model_rec(31, ev.ModelLost(at=at(2_000), domain="a", model=m, reason="unhealthy"), model=m),
        ],
    )
    assert writes.close_incidents == [(5, 30, at(1_000), 1_000)]
    assert [(r["opened_seq"], r["closed_seq"]) for r in rows("incidents", writes)] == [(31, None)]
    assert carry.incidents == {(F, "a", m): OpenSpan(31, at(2_000))}


def test_plan_does_not_mutate_the_carry_it_was_given():
    m = "qwen3.6:27b"
    carry = Carry(incidents={(F, "a", m): OpenSpan(5, at(0))})
    plan(carry, [model_rec(6, ev.ModelResident(at=at(1), domain="a", model=m))])
    assert carry.incidents == {(F, "a", m): OpenSpan(5, at(0))}


def test_gpu_observations_keep_presence_including_unknown():
    records = [
        rec(
            40,
            subjects.gpu(F, "a", 1),
            ev.GpuObserved(
                at=at(1),
                domain="a",
                index=1,
                present=True,
                name="H100",
                memory_total_bytes=80,
                memory_used_bytes=10,
                processes=[ev.GpuProcess(pid=1), ev.GpuProcess(pid=2)],
            ),
        ),
        rec(41, subjects.gpu(F, "a", 1), ev.GpuObserved(at=at(2), domain="a", index=1, present=False)),
        rec(42, subjects.gpu(F, "b", 0), ev.GpuObserved(at=at(3), domain="b", index=0, present=None)),
    ]
    writes, _ = plan(Carry(), records)
    got = rows("gpu_observations", writes)
    assert [(r["domain"], r["gpu_index"], r["present"]) for r in got] == [
        ("a", 1, True),
        ("a", 1, False),
        ("b", 0, None),
    ]
    assert got[0]["processes"] == 2 and got[0]["memory_used_bytes"] == 10 and got[0]["name"] == "H100"


def test_a_promotion_with_its_steps_in_one_batch_is_rows_with_timing_and_outcome():
    s = subjects.op(F)
    records = [
        rec(50, s, ev.PromotionRequested(at=at(0), op_id="op1", target="b", source="a", reason="gpu_detached")),
        rec(51, s, ev.StepStarted(at=at(10), op_id="op1", step="stop_training")),
        rec(52, s, ev.StepCompleted(at=at(1_510), op_id="op1", step="stop_training", took_ms=1_490, detail="SIGTERM")),
        rec(53, s, ev.StepStarted(at=at(1_600), op_id="op1", step="wake")),
        rec(
            54,
            s,
            ev.StepFailed(at=at(4_600), op_id="op1", step="wake", error_code="oom", error="CUDA OOM", took_ms=2_999),
        ),
        rec(55, s, ev.OperationAborted(at=at(4_700), op_id="op1", step="wake", error="CUDA OOM")),
    ]
    writes, carry = plan(Carry(), records)
    ops = [dict(zip(S.OPERATION_COLUMNS, r, strict=True)) for r in writes.insert_operations]
    assert len(ops) == 1
    op = ops[0]
    assert (op["kind"], op["target"], op["source"], op["reason"]) == ("promotion", "b", "a", "gpu_detached")
    assert (op["outcome"], op["failed_step"], op["error"], op["duration_ms"]) == ("aborted", "wake", "CUDA OOM", 4_700)
    steps = rows("operation_steps", writes)
    assert [(r["seq"], r["step"], r["outcome"], r["duration_ms"], r["took_ms"]) for r in steps] == [
        (51, "stop_training", "completed", 1_500, 1_490),
        (53, "wake", "failed", 3_000, 2_999),
    ]
    assert steps[0]["detail"] == "SIGTERM" and (steps[1]["error_code"], steps[1]["error"]) == ("oom", "CUDA OOM")
    assert carry.operations == {} and carry.steps == {}


def test_steps_and_operations_spanning_batches_are_finished_by_updates():
    s = subjects.op(F)
    _, carry = plan(
        Carry(),
        [
            rec(60, s, ev.DemotionRequested(at=at(0), op_id="op2", target="a")),
            rec(61, s, ev.StepStarted(at=at(100), op_id="op2", step="sleep")),
        ],
    )
    assert carry.steps == {(F, "op2", "sleep"): OpenSpan(61, at(100))}
    # a resumed promoter starts the step again: the abandoned attempt is closed as restarted
    w2, carry = plan(carry, [rec(62, s, ev.StepStarted(at=at(900), op_id="op2", step="sleep", attempt=2))])
    assert w2.finish_steps == [(61, "restarted", 62, at(900), 800, None, "", "", "")]
    assert [r["attempt"] for r in rows("operation_steps", w2)] == [2]
    w3, carry = plan(
        carry,
        [
            rec(63, s, ev.StepCompleted(at=at(1_000), op_id="op2", step="sleep", took_ms=90)),
            rec(64, s, ev.OperationCompleted(at=at(1_100), op_id="op2")),
        ],
    )
    assert w3.finish_steps == [(62, "completed", 63, at(1_000), 100, 90, "", "", "")]
    assert w3.finish_operations == [(F, "op2", "completed", 64, at(1_100), 1_100, "", "")]
    assert carry == Carry()


def test_domain_declarations_carry_provider_and_region_and_retirement():
    spec = DomainSpec(name="b", provider="skypilot", region="us-east-1", gpus=[GpuSpec(index=0, memory_bytes=1)])
    writes, _ = plan(
        Carry(),
        [
            rec(70, subjects.decl(F), ev.DomainDeclared(at=at(0), spec=spec)),
            rec(71, subjects.decl(F), ev.DomainRetired(at=at(5), domain="b")),
        ],
    )
    got = [dict(zip(S.DOMAIN_COLUMNS, r, strict=True)) for r in writes.upsert_domains]
    assert (got[0]["provider"], got[0]["region"], got[0]["gpus"], got[0]["retired_at"]) == (
        "skypilot",
        "us-east-1",
        1,
        None,
    )
    assert (got[1]["provider"], got[1]["retired_at"]) == (None, at(5))


def test_invalid_bodies_are_skipped_but_advance_the_position():
    bad = Record(80, subjects.model(F, "a", "m"), ns(1), b'{"type":"model_lost"}', None, "Object missing field `at`")
    weird = rec(81, "haru.evt.default", ev.ModelWaking(at=at(2), domain="a", model="m"))  # no such subject shape
    ignored = rec(82, subjects.agent(F, "a"), ev.AgentStarted(at=at(3), domain="a"))
    writes, _ = plan(Carry(), [bad, weird, ignored])
    assert writes.last_seq == 82
    assert [s[0] for s in writes.skipped] == [80, 81]
    assert writes.skipped[0][2] == "Object missing field `at`"
    assert [r["body"] for r in rows("skipped_events", writes)][0] == b'{"type":"model_lost"}'
    assert writes.copies["residency_transitions"] == []


def test_naive_times_are_taken_as_utc():
    naive = datetime(2026, 11, 1, 12, 0, 0)
    writes, _ = plan(Carry(), [model_rec(90, ev.ModelWaking(at=naive, domain="a", model="qwen3.6:27b"))])
    assert rows("residency_transitions", writes)[0]["observed_at"] == T0


def test_carry_is_rebuilt_from_the_open_rows():
    carry = carry_from_rows([(F, "a", "m", 7, at(1))], [(F, "op", 8, at(2))], [(F, "op", "wake", 9, at(3))])
    assert carry == Carry(
        incidents={(F, "a", "m"): OpenSpan(7, at(1))},
        operations={(F, "op"): OpenSpan(8, at(2))},
        steps={(F, "op", "wake"): OpenSpan(9, at(3))},
    )


_kinds = st.sampled_from(["loading", "resident", "lost", "sleeping", "waking"])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(["m1", "m2"]), _kinds), max_size=60),
    st.integers(min_value=1, max_value=10),
)
def test_batching_does_not_change_the_incidents(steps, batch):
    """Planning the history in batches of any size ends with the same incidents as all at once."""
    records = []
    for i, (domain, model, kind) in enumerate(steps, start=1):
        common = dict(at=at(i * 100), domain=domain, model=model)
        event = {
            "loading": ev.ModelLoading(**common),
            "resident": ev.ModelResident(**common),
            "lost": ev.ModelLost(**common, reason="evicted"),
            "sleeping": ev.ModelSleeping(**common),
            "waking": ev.ModelWaking(**common),
        }[kind]
        records.append(model_rec(i, event, domain, model))

    def incidents(chunks):
        table: dict[int, list] = {}
        carry = Carry()
        for chunk in chunks:
            writes, carry = plan(carry, chunk)
            for closed in writes.close_incidents:
                table[closed[0]][7:10] = list(closed[1:])
            for r in writes.copies["incidents"]:
                table[r[0]] = list(r)
        return table, carry

    whole, carry_whole = incidents([records])
    parts, carry_parts = incidents([records[i : i + batch] for i in range(0, len(records), batch)])
    assert whole == parts and carry_whole == carry_parts
    # and the reference: opened by a loss when none is open, closed by the next resident
    open_: dict = {}
    expected: dict[int, list] = {}
    for r in records:
        key = (r.event.domain, r.event.model)
        if isinstance(r.event, ev.ModelLost) and key not in open_:
            open_[key] = r.seq
            expected[r.seq] = [r.seq, None]
        elif isinstance(r.event, ev.ModelResident) and key in open_:
            expected[open_.pop(key)][1] = r.seq
    assert {k: [v[0], v[7]] for k, v in whole.items()} == expected


def test_a_request_repeated_for_an_operation_already_recorded_in_the_batch_changes_nothing():
    s = subjects.op(F)
    writes, carry = plan(
        Carry(),
        [
            rec(1, s, ev.PromotionRequested(at=at(0), op_id="op", target="b")),
            rec(2, s, ev.OperationCompleted(at=at(10), op_id="op")),
            rec(3, s, ev.PromotionRequested(at=at(20), op_id="op", target="a")),
        ],
    )
    ops = [dict(zip(S.OPERATION_COLUMNS, r, strict=True)) for r in writes.insert_operations]
    assert [(o["target"], o["outcome"], o["duration_ms"]) for o in ops] == [("b", "completed", 10)]
    assert carry.operations == {}


def test_a_misplaced_event_makes_no_row_but_a_skipped_one_naming_it():
    forger = "agent:default/a@h"
    records = [
        model_rec(1, ev.ModelLost(at=at(100), domain="b", model="qwen3.6:27b", reason="gpu_detached", by=forger)),
        rec(2, subjects.agent(F, "a"), ev.RouteMoved(at=at(200), active="b", by=forger)),
        rec(3, subjects.agent(F, "a"), ev.PromotionRequested(at=at(300), op_id="op-x", target="b", by=forger)),
        rec(4, subjects.gpu(F, "a", 0), ev.GpuObserved(at=at(400), domain="a", index=1, present=False, by=forger)),
    ]
    writes, carry = plan(Carry(), records)
    assert writes.last_seq == 4 and carry == Carry()
    for table in ("residency_transitions", "incidents", "gpu_observations", "operation_steps"):
        assert writes.copies[table] == [], table
    assert writes.insert_operations == [] and writes.upsert_domains == []
    skipped = rows("skipped_events", writes)
    assert [r["seq"] for r in skipped] == [1, 2, 3, 4]
    assert skipped[0]["error"] == (
        f"misplaced: seq 1: model_lost on {subjects.model(F, 'a', 'qwen3.6:27b')} by {forger} "
        "not applied: its body says domain 'b', its subject says 'a'"
    )
    assert "route_moved belongs on haru.evt.<fleet>.route" in skipped[1]["error"]
    assert skipped[3]["body"] == ev.encode(records[3].event)
    assert [s[0] for s in writes.skipped] == [1, 2, 3, 4]


def test_the_named_rows_are_their_tables_columns_in_order():
    """The planner patches rows by name; a COPY or INSERT takes them in the table's column order."""
    from dataclasses import fields

    from haru.projections.pg_rows import IncidentRow, OperationRow, StepRow

    assert [f.name for f in fields(IncidentRow)] == list(S.INCIDENT_COLUMNS)
    assert [f.name for f in fields(StepRow)] == list(S.STEP_COLUMNS)
    assert [f.name for f in fields(OperationRow)] == list(S.OPERATION_COLUMNS)


def test_a_cascading_promotion_records_the_standbys_it_tried_and_its_final_target():
    s = subjects.op(F)
    records = [
        rec(
            70,
            s,
            ev.PromotionRequested(
                at=at(0), op_id="op3", target="b", source="a", reason="domain_unreachable", cascade=True
            ),
        ),
        rec(71, s, ev.StepStarted(at=at(10), op_id="op3", step="wake")),
        rec(72, s, ev.StepFailed(at=at(20), op_id="op3", step="wake", error="out of memory")),
        rec(
            73,
            s,
            ev.PromotionRetargeted(
                at=at(21), op_id="op3", target="c", previous="b", step="wake", error="out of memory"
            ),
        ),
    ]
    writes, carry = plan(Carry(), records)
    [op] = [dict(zip(S.OPERATION_COLUMNS, r, strict=True)) for r in writes.insert_operations]
    assert (op["target"], op["tried"]) == ("c", ["b"])
    # the next move, in a later batch, updates the row written before
    w2, _ = plan(carry, [rec(74, s, ev.PromotionRetargeted(at=at(30), op_id="op3", target="d", previous="c"))])
    assert w2.retarget_operations == [(F, "op3", "d", "c")] and w2.row_count == 1
