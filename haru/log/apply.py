"""`haru apply`, its shell: append to `haru.evt.<fleet>.decl` what differs between the log and a layout.

    result = await apply(log, layout, now)       # reads the subject, diffs, appends; ApplyResult

It reads the decl subject, asks the core what differs (`haru.core.apply.diff` over the folded
declarations and the planner's verdicts; a domain that declares no host RAM is planned against what
its agent measured at its last start, `haru.core.planner.with_measured_host_ram`), and appends each
event with the subject's expected last sequence; when another writer wins the race (`Conflict`) it re-reads and
re-diffs, a bounded number of
times. It reaches the log only through the seam (`EventStore`): `haru apply`, `haru up` and the
simulated hosts hand it whichever log they hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from haru.core import subjects
from haru.core.apply import diff, fold_declarations
from haru.core.authority import misplaced
from haru.core.causes import admission_cause, declaration_seqs, with_cause
from haru.core.errors import Conflict
from haru.core.events import AgentStarted, Event
from haru.core.planner import Plan, with_measured_host_ram
from haru.core.planner import plan as plan_layout
from haru.core.specs import Layout
from haru.log.seam import EventStore

__all__ = ["ApplyResult", "apply", "measured_host_ram", "DEFAULT_RETRIES"]

DEFAULT_RETRIES = 5


@dataclass
class ApplyResult:
    fleet: str
    plan: Plan
    events: list[Event]  # the differences (appended unless dry_run)
    seqs: list[int]  # their stream sequences ([] for a dry run or no change)
    last_seq: int  # the decl subject's last sequence after apply (before, for a dry run)
    dry_run: bool = False
    attempts: int = 1


async def measured_host_ram(log: EventStore, layout: Layout) -> dict[str, int]:
    """Each domain's host RAM as its agent last measured it at start (`agent_started` on the domain's
    agent subject; the subject, not the body, says whose), for the domains that declare none."""
    out: dict[str, int] = {}
    for d in layout.domains:
        if d.spec.host_ram_bytes:
            continue
        subject = subjects.agent(layout.fleet, d.spec.name)
        for rec in reversed(await log.history(subject)):
            if isinstance(rec.event, AgentStarted) and not misplaced(rec.subject, rec.event):
                out[d.spec.name] = rec.event.host_ram_total_bytes
                break
    return out


async def apply(
    log: EventStore,
    layout: Layout,
    now: datetime,
    *,
    dry_run: bool = False,
    retries: int = DEFAULT_RETRIES,
    by: str = "",
) -> ApplyResult:
    """Append the differences between the log and `layout` to `haru.evt.<fleet>.decl`.

    Each append carries the subject's expected last sequence. On Conflict (another writer appended),
    re-read, re-diff, and try again, up to `retries` times; then the Conflict propagates.
    """
    subject = subjects.decl(layout.fleet)
    the_plan = plan_layout(with_measured_host_ram(layout, await measured_host_ram(log, layout)))
    attempt = 0
    while True:
        attempt += 1
        records = await log.history(subject)
        last = records[-1].seq if records else 0
        # The subject is the authority: an event that may not stand on the decl subject (a
        # fleet_declared naming another fleet, anything but a declaration) is not a declaration.
        current = fold_declarations(
            r.event for r in records if r.event is not None and not misplaced(r.subject, r.event)
        )
        events = diff(current, layout, the_plan, now, by=by)
        if dry_run or not events:
            return ApplyResult(layout.fleet, the_plan, events, [], last, dry_run=dry_run, attempts=attempt)
        seqs: list[int] = []
        try:
            declared = declaration_seqs((r.seq, r.event) for r in records if r.event is not None)
            for e in events:
                e = with_cause(e, admission_cause(e, declared))
                last = await log.append(subject, e, expect=last)
                declared.update(declaration_seqs([(last, e)]))
                seqs.append(last)
        except Conflict:
            if attempt > retries:
                raise
            continue
        return ApplyResult(layout.fleet, the_plan, events, seqs, last, attempts=attempt)
