"""An operation's history: the op subject's records folded into each operation and its steps. Pure.

    ops = fold_operations(records)      stream order; every operation on one fleet's op subject
    as_doc(op)                          the JSON document `haru op --json` prints and the console sends
    abort_words(step, error)            how an abort is worded, everywhere: `verify_gpu: GPU 0 gone`
    progress_line(op_id, event)         one event of an operation as `haru promote --wait` prints it

Each operation is requested once (an `OperationRequested`), then its steps start and end
(`step_started`, `step_completed`/`step_failed`; a restarted step is a new attempt), then it ends
(`operation_completed`/`operation_aborted`). Durations are wall times between the events' own `at`;
`took_ms` is what the agent measured. An outcome whose start was before the records read stands alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any, Literal

import msgspec

from haru.core.events import (
    OperationAborted,
    OperationCompleted,
    OperationRequested,
    PromotionRetargeted,
    StepCompleted,
    StepFailed,
    StepStarted,
)
from haru.core.record import Record

__all__ = ["OpStep", "Operation", "fold_operations", "as_doc", "abort_words", "ms_between", "progress_line"]


class OpStep(msgspec.Struct, frozen=True, kw_only=True):
    """One attempt of one step of an operation."""

    step: str
    attempt: int = 1
    # skipped: a best-effort step that did not apply for a known reason (`detail` says why): not a failure
    state: Literal["started", "completed", "failed", "skipped"] = "started"
    seq: int  # the step_started's sequence (the outcome's, when its start was not read)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    took_ms: int | None = None  # the agent's own measure
    detail: str = ""
    error_code: str = ""
    error: str = ""
    domain: str = ""  # the domain it acted on: the operation's target when it started


class Operation(msgspec.Struct, frozen=True, kw_only=True):
    op_id: str
    kind: str
    target: str
    source: str = ""
    reason: str = "manual"
    detail: str = ""
    by: str = ""
    seq: int
    requested_at: datetime
    finished_at: datetime | None = None
    state: Literal["running", "completed", "aborted"] = "running"
    error: str = ""  # abort_words(step, error) of the abort
    steps: tuple[OpStep, ...] = ()
    tried: tuple[str, ...] = ()  # a cascading promotion: the standbys it moved on from, in order


def ms_between(a: datetime | None, b: datetime | None) -> int | None:
    """Whole milliseconds from `a` to `b` (0 when the clocks say `b` came first; None when one is unknown)."""
    if a is None or b is None:
        return None
    delta = b - a
    return max(0, delta.days * 86_400_000 + delta.seconds * 1000 + delta.microseconds // 1000)


def abort_words(step: str, error: str) -> str:
    """`verify_gpu: GPU 0 gone`: the step an operation was aborted at, and why (once, if the error names it)."""
    return error if not step or error.startswith(step) else f"{step}: {error}"


def fold_operations(records: Iterable[Record]) -> list[Operation]:
    """Every operation the records request, in the order requested, with its steps in order."""
    ops: dict[str, Operation] = {}
    for rec in records:
        ev = rec.event
        op_id = getattr(ev, "op_id", "") if ev is not None else ""
        if not op_id:
            continue
        if isinstance(ev, OperationRequested):
            if op_id not in ops:
                ops[op_id] = Operation(
                    op_id=op_id,
                    kind=ev.kind,
                    target=ev.target,
                    source=getattr(ev, "source", ""),
                    reason=getattr(ev, "reason", "manual"),
                    detail=getattr(ev, "detail", ""),
                    by=ev.by,
                    seq=rec.seq,
                    requested_at=ev.at,
                )
        elif op_id in ops:
            ops[op_id] = _evolve(ops[op_id], rec.seq, ev)
    return list(ops.values())


def _evolve(op: Operation, seq: int, ev: Any) -> Operation:
    replace = msgspec.structs.replace
    if isinstance(ev, StepStarted):
        return replace(
            op,
            steps=op.steps + (OpStep(step=ev.step, attempt=ev.attempt, seq=seq, started_at=ev.at, domain=op.target),),
        )
    if isinstance(ev, PromotionRetargeted):
        return replace(op, target=ev.target, tried=op.tried + (ev.previous,))
    if isinstance(ev, (StepCompleted, StepFailed)):
        ended: dict[str, Any] = {"state": "completed", "finished_at": ev.at, "took_ms": ev.took_ms}
        if isinstance(ev, StepFailed):
            ended.update(state="failed", error_code=ev.error_code, error=ev.error)
        elif ev.skipped:
            ended.update(state="skipped", detail=ev.skipped)
        else:
            ended.update(detail=ev.detail)
        steps = list(op.steps)
        for i in range(len(steps) - 1, -1, -1):
            if steps[i].step == ev.step and steps[i].state == "started":
                steps[i] = replace(steps[i], **ended)
                break
        else:  # an outcome without its start (the start was before the records read)
            steps.append(OpStep(step=ev.step, seq=seq, **ended))
        return replace(op, steps=tuple(steps))
    if isinstance(ev, OperationCompleted):
        return replace(op, state="completed", finished_at=ev.at)
    if isinstance(ev, OperationAborted):
        return replace(op, state="aborted", finished_at=ev.at, error=abort_words(ev.step, ev.error))
    return op


def progress_line(op_id: str, ev: Any) -> str | None:
    """One event of operation `op_id` as a line for a person following it (None: nothing to say)."""
    if isinstance(ev, OperationRequested):
        return f"requested  {getattr(ev, 'reason', 'manual')} {ev.kind} of {ev.target}"
    if isinstance(ev, StepCompleted) and ev.skipped:
        return f"{ev.step:<18} skipped {ev.took_ms:>6} ms  {ev.skipped}"
    if isinstance(ev, StepCompleted):
        detail = f"  {ev.detail}" if ev.detail else ""
        return f"{ev.step:<18} ok      {ev.took_ms:>6} ms{detail}"
    if isinstance(ev, StepFailed):
        return f"{ev.step:<18} FAILED  {ev.took_ms:>6} ms  {ev.error_code}: {ev.error}"
    if isinstance(ev, PromotionRetargeted):
        return f"moved on   {ev.previous} failed {ev.step} ({ev.error}): trying {ev.target}"
    if isinstance(ev, OperationCompleted):
        return f"completed  {op_id}"
    if isinstance(ev, OperationAborted):
        return f"aborted    {op_id} at {abort_words(ev.step, ev.error) or '(no step)'} (routing did not move)"
    return None


def as_doc(op: Operation) -> dict[str, Any]:
    """The operation as JSON: times in ISO 8601, wall durations in ms, a failed step's error with its code."""
    return {
        "op_id": op.op_id,
        "kind": op.kind,
        "target": op.target,
        "source": op.source,
        "reason": op.reason,
        "detail": op.detail,
        "by": op.by,
        "seq": op.seq,
        "requested_at": op.requested_at.isoformat(),
        "finished_at": _iso(op.finished_at),
        "state": op.state,
        "error": op.error,
        "duration_ms": ms_between(op.requested_at, op.finished_at),
        "tried": list(op.tried),
        "steps": [
            {
                "step": s.step,
                "domain": s.domain,
                "attempt": s.attempt,
                "state": s.state,
                "seq": s.seq,
                "started_at": _iso(s.started_at),
                "finished_at": _iso(s.finished_at),
                "duration_ms": ms_between(s.started_at, s.finished_at),
                "took_ms": s.took_ms,
                "detail": s.detail,
                "error": f"{s.error_code}: {s.error}" if s.state == "failed" else "",
            }
            for s in op.steps
        ],
    }


def _iso(t: datetime | None) -> str | None:
    return t.isoformat() if t is not None else None
