"""Manual promotions and demotions: what `haru promote`/`haru demote` and the control API call.

    result = await request_operation(log, "default", "promotion", "b", by="cli:alice", now=now)
    result.status   # noop | accepted | joined | conflict | refused | not_found
    result.op_id    # the operation accepted or joined (or the one in the way, for conflict)

It reads the fleet's current state by folding the fleet's history (`haru.evt.<fleet>.>`) with
`projections.fleet.evolve`: correctness over speed. A fleet's history grows with every residency
and step event, so this costs one replay per request (milliseconds for thousands of events); a
control API under load could start from the projected KV view plus the op subject's last sequence
instead, at the price of trusting the projector's lag. The append is sequence-checked on the op
subject, so a request can never slip in beside an operation in flight: on a Conflict it reads
and decides again, a few times.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec

from haru import subjects
from haru.errors import Conflict, InvalidName
from haru.promoter.decider import fold, judge_request
from haru.promoter.service import new_op_id
from projections.fleet import evolve

RETRIES = 5


class RequestResult(msgspec.Struct, frozen=True, kw_only=True):
    status: Literal["noop", "accepted", "joined", "conflict", "refused", "not_found"]
    op_id: str = ""
    message: str = ""
    seq: int = 0  # the stream sequence of the request event (accepted only)


async def request_operation(
    log, fleet: str, kind: Literal["promotion", "demotion"], target: str, *, by: str, now: datetime
) -> RequestResult:
    """Request a promotion or demotion of `target` in `fleet`; see the module docstring."""
    try:
        subjects.check_name("fleet", fleet)
        subjects.check_name("domain", target)
    except InvalidName as exc:
        return RequestResult(status="not_found", message=str(exc))
    op_subject = subjects.op(fleet)
    op_id = new_op_id()
    verdict = None
    for _ in range(RETRIES):
        records = await log.history(subjects.fleet_events(fleet))
        if not records:
            return RequestResult(status="not_found", message=f"no fleet {fleet!r}; declare it with `haru apply`")
        view, last = fold(fleet, records, evolve)
        verdict = judge_request(view, kind, target, op_id=op_id, by=by, now=now)
        if verdict.event is None:
            return RequestResult(status=verdict.status, op_id=verdict.op_id, message=verdict.message)
        try:
            seq = await log.append(op_subject, verdict.event, expect=last.get(op_subject, 0))
        except Conflict:
            continue
        return RequestResult(status="accepted", op_id=op_id, message=verdict.message, seq=seq)
    return RequestResult(
        status="conflict",
        message=f"the op subject of fleet {fleet} kept moving while deciding ({RETRIES} tries); try again",
    )
