"""What routers that follow a fleet say they applied, and who is behind. Pure: time arrives as arguments.

Each `haru route follow` publishes a `RouterReport` on `haru.router.<fleet>.<router>` (core NATS, not
history) when it applies a route intent and every `interval_ms` besides: the report is both the
acknowledgement (the route revision it applied) and the liveness (a router not heard for three intervals,
and at least `GONE_MIN_S`, is gone). The subject is the authority: the fleet and the router are the
subject's; a body that names another fleet is not counted (`heard` returns why).

    book = heard(book, fleet, router, report, now)   # (book, why-not '' when counted)
    w = waiting(book, revision, now)                 # Waiting: applied / behind / gone router names
    rows = lag(book, revision, now)                  # one Lag a router, for `haru status` and the console
"""

from __future__ import annotations

from datetime import datetime

import msgspec

__all__ = [
    "GONE_MIN_S",
    "Heard",
    "Lag",
    "RouterReport",
    "Waiting",
    "describe",
    "lines",
    "gone_after",
    "heard",
    "lag",
    "report_decoder",
    "waiting",
]

GONE_MIN_S = 3.0  # a router not heard for max(3 intervals, this) is gone


class RouterReport(msgspec.Struct, frozen=True, kw_only=True):
    """What one route follower has applied to its router."""

    fleet: str
    router: str
    kind: str = ""  # haproxy | nginx | envoy | exec
    revision: int = 0  # the route revision (route_moved sequence) of the intent it applied; 0 = none yet
    seq: int = 0  # that intent's sequence on HARU_ROUTE
    active: str = ""  # the domain it sends the active share to
    wanted: int = 0  # the route revision of the newest intent it has read (== revision when caught up)
    error: str = ""  # why the newest intent is not applied (the router refused, the command failed)
    notes: list[str] = []  # what the intent says that this router cannot follow
    interval_ms: int = 1000
    applied_at: datetime | None = None
    at: datetime | None = None


report_decoder = msgspec.json.Decoder(RouterReport)


class Heard(msgspec.Struct, frozen=True):
    report: RouterReport
    heard_at: float  # the hearer's monotonic clock


class Waiting(msgspec.Struct, frozen=True):
    applied: tuple[str, ...]
    behind: tuple[str, ...]
    gone: tuple[str, ...]


class Lag(msgspec.Struct, frozen=True, kw_only=True):
    router: str
    kind: str
    revision: int
    active: str
    state: str  # applied | behind | gone
    silent_s: float  # since it was last heard
    error: str = ""
    notes: tuple[str, ...] = ()


def gone_after(report: RouterReport) -> float:
    return max(GONE_MIN_S, 3 * report.interval_ms / 1000)


def heard(
    book: dict[str, Heard], fleet: str, router: str, report: RouterReport, now: float
) -> tuple[dict[str, Heard], str]:
    """`book` with `router`'s report, when the body agrees with the subject (`fleet`, `router`)."""
    if report.fleet != fleet or report.router != router:
        return book, (
            f"a report on haru.router.{fleet}.{router} says fleet {report.fleet!r} router {report.router!r}: "
            "not counted (the subject is the authority)"
        )
    return {**book, router: Heard(report, now)}, ""


def _state(h: Heard, revision: int, now: float) -> str:
    if now - h.heard_at > gone_after(h.report):
        return "gone"
    return "applied" if h.report.revision >= revision else "behind"


def waiting(book: dict[str, Heard], revision: int, now: float) -> Waiting:
    """Which routers have applied route revision `revision` (or a later one), which are behind, which gone."""
    out: dict[str, list[str]] = {"applied": [], "behind": [], "gone": []}
    for name in sorted(book):
        out[_state(book[name], revision, now)].append(name)
    return Waiting(tuple(out["applied"]), tuple(out["behind"]), tuple(out["gone"]))


def lag(book: dict[str, Heard], revision: int, now: float) -> list[Lag]:
    """One row a router: what it applied against the fleet's route revision, and how long since it spoke."""
    rows = []
    for name in sorted(book):
        h = book[name]
        rows.append(
            Lag(
                router=name,
                kind=h.report.kind,
                revision=h.report.revision,
                active=h.report.active,
                state=_state(h, revision, now),
                silent_s=round(max(0.0, now - h.heard_at), 1),
                error=h.report.error,
                notes=tuple(h.report.notes),
            )
        )
    return rows


def describe(w: Waiting, waited_s: float, timeout: bool) -> str:
    """One line for the settle step's record: which routers, how long."""
    parts = []
    if w.applied:
        parts.append(f"applied by {', '.join(w.applied)}")
    if w.behind:
        parts.append(f"still behind: {', '.join(w.behind)}")
    if w.gone:
        parts.append(f"gone (not heard): {', '.join(w.gone)}")
    if not parts:
        return "no router follows this fleet"
    how = f"gave up after {waited_s:.2f} s (router_ack_timeout_ms)" if timeout else f"after {waited_s:.2f} s"
    return f"routers: {'; '.join(parts)}; {how}"


def lines(rows: list[Lag], revision: int, active: str) -> list[str]:
    """`haru status`'s routers section: each router's applied revision against the fleet's, and how long
    since it was heard. Empty when no router reported."""
    if not rows:
        return []
    behind = sum(1 for r in rows if r.state != "applied")
    head = f"routers following the route (haru route follow): {len(rows)}"
    head += f", {behind} not on revision {revision}" if behind else f", all on revision {revision} → {active}"
    out = [head]
    for r in rows:
        if r.state == "applied":
            what = f"applied revision {r.revision} → {r.active}"
        elif r.state == "behind":
            held = f"{r.revision} → {r.active or '(nothing)'}"
            what = f"BEHIND: holds revision {held}, the route is at {revision} → {active}"
        else:
            what = (
                f"GONE: not heard for {r.silent_s:.0f} s (last held revision {r.revision} → {r.active or '(nothing)'})"
            )
        line = f"  {r.router} ({r.kind or '?'}): {what}; heard {r.silent_s:.1f} s ago"
        if r.error:
            line += f"; not applied: {r.error}"
        out.append(line)
        out.extend(f"      cannot follow: {n}" for n in r.notes)
    return out
