"""The console's pure part: what the browser is sent, folded from views and records. No I/O.

snapshot(routes, now)            one fleet's live state: its FleetView, RouteIntent and route
operations(records)              every operation on a fleet's op subject, with its steps' durations
story_items(records)             a model's `why` story as JSON items, newest first
OPERATION_MEANING                what the control API's status codes mean to an operator
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from haru.core.events import payload, tag_of
from haru.core.operations import as_doc, fold_operations
from haru.core.saga import KINDS, flow

if TYPE_CHECKING:
    from haru.core.record import Record  # the type only: this module reads records, it never reads the log
    from haru.gateway.routing import FleetRoutes

# Each kind's steps in order, read from the sagas' transition table (haru.core.saga) (the stepper's columns).
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


def operations(records: list[Record]) -> list[dict[str, Any]]:
    """Operations on one fleet's op subject, newest first, each with its steps in order: when each
    started, when it ended, its wall duration (event times) and the agents' own `took_ms`
    (haru.core.operations, the fold `haru op` prints too)."""
    return [as_doc(op) for op in reversed(fold_operations(records))]


def story_items(picked: list[Record]) -> list[dict[str, Any]]:
    """A model's story (haru.log.history.story's records) as items, newest first."""
    items = []
    for rec in reversed(picked):
        ev = rec.event
        if ev is None:
            continue
        items.append(
            {
                "seq": rec.seq,
                "time": rec.time.isoformat(),
                "at": ev.at.isoformat(),
                "subject": rec.subject,
                "type": tag_of(ev),
                "domain": getattr(ev, "domain", ""),
                "cause": ev.cause,
                "payload": payload(ev),
            }
        )
    return items
