"""The console's pure part: what the browser is sent, folded from views and records. No I/O.

    snapshot(routes, now)            one fleet's live state: its FleetView, RouteIntent and route
    operations(records)              every operation on a fleet's op subject, with its steps' durations
    story_items(records)             a model's `why` story as JSON items, newest first
    OPERATION_MEANING                what the control API's status codes mean to an operator
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from haru.core.events import (
    OperationAborted,
    OperationCompleted,
    OperationRequested,
    StepCompleted,
    StepFailed,
    StepStarted,
    payload,
    tag_of,
)
from haru.promoter.decider import KINDS, flow

if TYPE_CHECKING:
    from gateway.routing import FleetRoutes
    from haru.log.eventlog import Record  # the type only: this module reads records, it never reads the log

# Each kind's steps in order, read from the promoter's transition table (the stepper's columns).
FLOWS: dict[str, list[str]] = {kind: flow(kind) for kind in KINDS}

# The console says what a promote/demote answer means, not only its number.
OPERATION_MEANING: dict[int, str] = {
    200: "no-op: that domain is already where you asked",
    202: "accepted: the operation started (or you joined the one already running for that target)",
    400: "refused: the request was not understood",
    401: "refused: the API token is missing or wrong",
    404: "refused: no such fleet or domain",
    409: "conflict: another operation is in flight, or the active domain cannot be demoted",
    503: "unavailable: the event log cannot be reached",
}


def snapshot(fleet: str, routes: FleetRoutes | None, now: float) -> dict[str, Any]:
    """The live state of one fleet as the console draws it."""
    if routes is None:
        return {"fleet": fleet, "deleted": True, "server_time": now}
    return {
        "fleet": fleet,
        "server_time": now,
        "active": routes.active,
        "revision": routes.revision,
        "intent_seq": routes.intent_seq,
        "view": routes.view,
        "intent": routes.intent,
    }


def hello() -> dict[str, Any]:
    """Sent once when a stream opens: the tables the page reads (steps per kind, status meanings)."""
    return {"flows": FLOWS, "meanings": {str(k): v for k, v in OPERATION_MEANING.items()}}


def _ms_between(a: datetime | None, b: datetime | None) -> int | None:
    if a is None or b is None:
        return None
    return max(0, int((b - a).total_seconds() * 1000))


def operations(records: list[Record]) -> list[dict[str, Any]]:
    """Operations on one fleet's op subject, newest first, each with its steps in order: when each
    started, when it ended, its wall duration (event times) and the agents' own `took_ms`."""
    ops: dict[str, dict[str, Any]] = {}
    open_steps: dict[tuple[str, str], dict[str, Any]] = {}
    for rec in records:
        ev = rec.event
        op_id = getattr(ev, "op_id", "") if ev is not None else ""
        if not op_id:
            continue
        if isinstance(ev, OperationRequested):
            ops[op_id] = {
                "op_id": op_id,
                "kind": ev.kind,
                "target": ev.target,
                "source": getattr(ev, "source", ""),
                "reason": getattr(ev, "reason", "manual"),
                "detail": getattr(ev, "detail", ""),
                "by": ev.by,
                "seq": rec.seq,
                "requested_at": ev.at.isoformat(),
                "finished_at": None,
                "state": "running",
                "error": "",
                "duration_ms": None,
                "steps": [],
                "_at": ev.at,
            }
            continue
        op = ops.get(op_id)
        if op is None:
            continue
        if isinstance(ev, StepStarted):
            step: dict[str, Any] = {"step": ev.step, "attempt": ev.attempt, "state": "started", "seq": rec.seq,
                    "started_at": ev.at.isoformat(), "finished_at": None, "duration_ms": None, "took_ms": None,
                    "detail": "", "error": "", "_at": ev.at}
            op["steps"].append(step)
            open_steps[(op_id, ev.step)] = step
        elif isinstance(ev, (StepCompleted, StepFailed)):
            started = open_steps.pop((op_id, ev.step), None)
            if started is not None:
                step = started
            else:  # an outcome without its start (the start was before the records read)
                step = {"step": ev.step, "attempt": 1, "seq": rec.seq, "started_at": None, "_at": None}
                op["steps"].append(step)
            step.update(state="completed" if isinstance(ev, StepCompleted) else "failed", finished_at=ev.at.isoformat(),
                        duration_ms=_ms_between(step.get("_at"), ev.at), took_ms=ev.took_ms,
                        detail=getattr(ev, "detail", ""),
                        error=(f"{ev.error_code}: {ev.error}" if isinstance(ev, StepFailed) else ""))
        elif isinstance(ev, (OperationCompleted, OperationAborted)):
            op["state"] = "completed" if isinstance(ev, OperationCompleted) else "aborted"
            op["finished_at"] = ev.at.isoformat()
            op["duration_ms"] = _ms_between(op["_at"], ev.at)
            if isinstance(ev, OperationAborted):
                op["error"] = ev.error if not ev.step or ev.error.startswith(ev.step) else f"{ev.step}: {ev.error}"
    out = []
    for op in reversed(list(ops.values())):
        op.pop("_at", None)
        for step in op["steps"]:
            step.pop("_at", None)
        out.append(op)
    return out


def story_items(picked: list[Record]) -> list[dict[str, Any]]:
    """A model's story (haru.log.history.story's records) as items, newest first."""
    items = []
    for rec in reversed(picked):
        ev = rec.event
        if ev is None:
            continue
        items.append({
            "seq": rec.seq,
            "time": rec.time.isoformat(),
            "at": ev.at.isoformat(),
            "subject": rec.subject,
            "type": tag_of(ev),
            "domain": getattr(ev, "domain", ""),
            "cause": ev.cause,
            "payload": payload(ev),
        })
    return items
