"""Operator requests, appended: what `haru promote`/`demote`/`roll`/`op abort`/`route weight` and the
control API call. The verdicts are pure (haru.core.requests, haru.core.weighing); this module reads the
fleet's state, asks for the verdict and appends its event on the op subject.

    result = await request_operation(log, "default", "promotion", "b", by="cli:alice", now=now)
    result.status   # noop | accepted | joined | conflict | refused | not_found
    result.op_id    # the operation accepted or joined (or the one in the way, for conflict)
    result = await abort_operation(log, "default", "op-...", by="cli:alice", now=now)
    result = await request_weights(log, "default", {"b": 10}, model="", by="cli:alice", now=now)

It reads the fleet's current state without replaying its history: the projector's view of the
fleet (KV `haru_views`, `fleet.<fleet>`) plus the fleet's events stored after the view's position
(`from_seq` = position + 1: as many as the projector lags behind, usually none), folded onto it
with the one fold (`haru.core.fold.Folder`). The cost does not grow with the log. Only when there is no view
(no projector has ever run for this fleet) does it fold the fleet's whole history. The append is
sequence-checked on the op subject (its real last sequence, from the view's `op_seq` or the events
after it), so a request can never slip in beside an operation in flight, however stale the view:
on a Conflict it reads and decides again, a few times. The promoter drives what was accepted.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Literal, Protocol

import msgspec

from haru.core import ranking, subjects
from haru.core.errors import Conflict, InvalidName
from haru.core.events_fleet import OperationAborted, OperationCompleted
from haru.core.fold import Folder, empty
from haru.core.requests import Judgment, judge_abort, judge_request
from haru.core.views import FleetView, view_decoder
from haru.core.weighing import judge_weights
from haru.log.seam import EventStore, ViewStore

__all__ = [
    "RequestLog",
    "RequestResult",
    "abort_operation",
    "current_view",
    "new_op_id",
    "request_operation",
    "request_weights",
    "stored_view",
]

RETRIES = 5


class RequestLog(EventStore, ViewStore, Protocol):
    """What a request needs of the log: its events (read and appended) and the projector's views."""


def new_op_id() -> str:
    """A fresh operation id (`op-` and 12 hex digits)."""
    return f"op-{uuid.uuid4().hex[:12]}"


class RequestResult(msgspec.Struct, frozen=True, kw_only=True):
    status: Literal["noop", "accepted", "joined", "conflict", "refused", "not_found", "invalid"]
    op_id: str = ""
    message: str = ""
    seq: int = 0  # the stream sequence of the request event (accepted only)


async def request_operation(
    log: RequestLog,
    fleet: str,
    kind: str,
    target: str,
    *,
    by: str,
    now: datetime,
    reason: str = "",
    detail: str = "",
    cause: int = 0,
) -> RequestResult:
    """Request an operation of `kind` (a key of `haru.core.saga.KINDS`) on `target` in `fleet`; see the module
    docstring.

    `reason`/`detail` replace the request event's own (when it has such fields; default: manual), and
    `cause` is the event it answers (a rolling change cites the declaration that asked for it)."""
    try:
        subjects.check_name("fleet", fleet)
        if target:
            subjects.check_name("domain", target)
    except InvalidName as exc:
        return RequestResult(status="not_found", message=str(exc))
    op_id = new_op_id()

    def judge(view: FleetView | None) -> Judgment:
        # no target: the best fit standby (haru.core.ranking; else the first-ranked, whose refusal says
        # why), and a promotion then cascades to the next fit one if it fails before the flip
        chosen = target or (ranking.first_fit(view) if view is not None else "") or (view.standby() if view else "")
        verdict = judge_request(view, kind, chosen, op_id=op_id, by=by, now=now)
        if verdict.event is None:
            return verdict
        fields: dict[str, object] = {
            k: v for k, v in (("reason", reason), ("detail", detail)) if v and hasattr(verdict.event, k)
        }
        if not target and hasattr(verdict.event, "cascade"):
            fields["cascade"] = True
        if cause:
            fields["cause"] = cause
        return (
            msgspec.structs.replace(verdict, event=msgspec.structs.replace(verdict.event, **fields))
            if fields
            else verdict
        )

    return await _judged_append(log, fleet, judge)


async def abort_operation(
    log: RequestLog, fleet: str, op_id: str = "", *, by: str, now: datetime, why: str = ""
) -> RequestResult:
    """Abort the operation in flight in `fleet` (`op_id` '' = whichever it is) if it has not reached the
    step from which its kind cannot be aborted (the flip, for a promotion): `operation_aborted` on
    the op subject, appended against its last sequence, so it never lands after a step that started
    meanwhile. The promoter then drives nothing more of it; a step already running finishes, and its
    outcome is refused by the log (the abort took its place)."""
    try:
        subjects.check_name("fleet", fleet)
    except InvalidName as exc:
        return RequestResult(status="not_found", message=str(exc))
    result = await _judged_append(log, fleet, lambda view: judge_abort(view, op_id, by=by, now=now, why=why))
    if result.status == "not_found" and op_id:
        # neither in flight nor the last to end (the promoter may have started another since): its own end
        ended = await _how_it_ended(log, fleet, op_id)
        if ended:
            return RequestResult(status="noop", op_id=op_id, message=f"{op_id} already {ended}")
    return result


async def _how_it_ended(log: RequestLog, fleet: str, op_id: str) -> str:
    """'aborted' or 'completed' for an operation of `fleet` that ended, '' for one the op subject never saw
    end. Reads the op subject: the error path of an abort only."""
    for record in reversed(await log.history(subjects.op(fleet))):
        event = record.event
        if getattr(event, "op_id", None) == op_id:
            if isinstance(event, OperationAborted):
                return "aborted"
            return "completed" if isinstance(event, OperationCompleted) else ""
    return ""


async def _judged_append(log: RequestLog, fleet: str, judge: Callable[[FleetView | None], Judgment]) -> RequestResult:
    """Read the fleet's view, judge, append the verdict's event against the op subject's last
    sequence; on a Conflict read and judge again, a few times."""
    op_subject = subjects.op(fleet)
    for _ in range(RETRIES):
        current = await current_view(log, fleet)
        if current is None:
            return RequestResult(status="not_found", message=f"no fleet {fleet!r}; declare it with `haru apply`")
        view, op_last = current
        verdict: Judgment = judge(view)
        if verdict.event is None:
            return RequestResult(status=verdict.status, op_id=verdict.op_id, message=verdict.message)
        try:
            seq = await log.append(op_subject, verdict.event, expect=op_last)
        except Conflict:
            continue
        return RequestResult(status="accepted", op_id=verdict.op_id, message=verdict.message, seq=seq)
    return RequestResult(
        status="conflict",
        message=f"the op subject of fleet {fleet} kept moving while deciding ({RETRIES} tries); try again",
    )


async def stored_view(log: ViewStore, fleet: str) -> FleetView | None:
    """The projector's view of `fleet` from KV, or None (none stored, or of another version)."""
    got = await log.get_view(subjects.view_key(fleet))
    if got is None:
        return None
    try:
        view = view_decoder.decode(got[0])
    except msgspec.DecodeError:
        return None
    return view if view.fleet == fleet else None


async def current_view(log: RequestLog, fleet: str) -> tuple[FleetView, int] | None:
    """(the fleet's view as of now, the op subject's last sequence), or None for no such fleet.

    The stored view plus the fleet's events after its position; the whole history only when no view
    was ever stored."""
    op_subject = subjects.op(fleet)
    view = await stored_view(log, fleet)
    if view is None:
        records = await log.history(subjects.fleet_events(fleet))
        if not records:
            return None
        view = empty(fleet)
    else:
        records = await log.history(subjects.fleet_events(fleet), from_seq=max(view.seq, view.checkpoint) + 1)
    folder = Folder(view)
    op_last = view.op_seq
    for rec in records:
        if rec.subject == op_subject:
            op_last = rec.seq
        if rec.event is not None:
            folder.add(rec.event, seq=rec.seq, subject=rec.subject)
    return folder.view(), op_last


async def request_weights(
    log: RequestLog,
    fleet: str,
    given: Mapping[str, int],
    *,
    model: str = "",
    reset: bool = False,
    by: str,
    now: datetime,
) -> RequestResult:
    """Ask for new weights in `fleet` (see the module docstring); appended against the op subject's last sequence."""
    try:
        subjects.check_name("fleet", fleet)
        if model:
            subjects.check_model_id(model)
    except InvalidName as exc:
        return RequestResult(status="invalid", message=str(exc))
    op_id = new_op_id()
    return await _judged_append(
        log, fleet, lambda view: judge_weights(view, given, model=model, reset=reset, op_id=op_id, by=by, now=now)
    )
