"""The one fold of an operation's history (haru/core/operations.py), as `haru op` and the console read it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from haru.core.events import (
    DemotionRequested,
    OperationAborted,
    PromotionRequested,
    StepCompleted,
    StepFailed,
    StepStarted,
)
from haru.core.operations import abort_words, as_doc, fold_operations
from haru.log.eventlog import Record

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def rec(seq: int, event) -> Record:
    return Record(seq=seq, subject="haru.evt.f.op", time_ns=0, data=b"", event=event)


def at(ms: int) -> datetime:
    return T0 + timedelta(milliseconds=ms)


def test_an_abort_is_worded_once_whether_or_not_the_error_names_its_step():
    assert abort_words("verify_gpu", "GPU 0 gone") == "verify_gpu: GPU 0 gone"
    assert abort_words("verify_gpu", "verify_gpu: GPU 0 gone") == "verify_gpu: GPU 0 gone"
    assert abort_words("", "aborted by alice") == "aborted by alice"


def test_a_restarted_step_is_a_second_attempt_and_an_outcome_without_its_start_stands_alone():
    records = [
        rec(1, StepCompleted(at=at(0), op_id="op-1", step="sleep")),  # before its request: not an operation yet
        rec(2, PromotionRequested(at=at(0), op_id="op-1", target="b", reason="manual", by="alice")),
        rec(3, StepStarted(at=at(10), op_id="op-1", step="wake")),
        rec(4, StepStarted(at=at(20), op_id="op-1", step="wake", attempt=2)),
        rec(
            5,
            StepFailed(at=at(50), op_id="op-1", step="wake", error_code="out_of_memory", error="CUDA OOM", took_ms=25),
        ),
        rec(6, StepCompleted(at=at(60), op_id="op-1", step="probe", took_ms=5)),
        rec(7, OperationAborted(at=at(70), op_id="op-1", step="wake", error="CUDA OOM")),
        rec(8, DemotionRequested(at=at(80), op_id="op-2", target="a")),
        rec(9, PromotionRequested(at=at(90), op_id="op-1", target="a")),  # a second request of op-1 adds nothing
    ]
    first, second = fold_operations(records)
    assert (first.op_id, first.target, first.state, first.error) == ("op-1", "b", "aborted", "wake: CUDA OOM")
    assert [(s.step, s.attempt, s.state) for s in first.steps] == [
        ("wake", 1, "started"),
        ("wake", 2, "failed"),
        ("probe", 1, "completed"),
    ]
    assert first.steps[2].started_at is None and first.steps[2].seq == 6
    assert (second.op_id, second.kind, second.state) == ("op-2", "demotion", "running")
    doc = as_doc(first)
    assert doc["duration_ms"] == 70 and doc["steps"][1]["duration_ms"] == 30
    assert doc["steps"][1]["error"] == "out_of_memory: CUDA OOM" and doc["requested_at"] == T0.isoformat()


def test_haru_promote_wait_words_each_event_and_the_abort_as_haru_op_does():
    from haru.core.operations import progress_line

    assert (
        progress_line("op-1", PromotionRequested(at=at(0), op_id="op-1", target="b", reason="manual"))
        == "requested  manual promotion of b"
    )
    assert progress_line("op-1", StepStarted(at=at(0), op_id="op-1", step="wake")) is None
    assert (
        progress_line("op-1", OperationAborted(at=at(0), op_id="op-1", step="wake", error="CUDA OOM"))
        == "aborted    op-1 at wake: CUDA OOM (routing did not move)"
    )
