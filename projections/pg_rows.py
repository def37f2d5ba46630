"""Events to Postgres rows: the pure core of the Postgres read model.

    writes, carry = plan(carry, records)

`records` are log records in stream order (anything with `.seq .subject .time .event .error .data`,
as `haru.eventlog.Record` has); `carry` is what spans across batches: the open incidents, the
operations in flight and the running steps, keyed so a later event can close them. `plan` returns
the rows to append (COPY), the updates to rows written by earlier batches, and the new carry; it
never mutates its arguments, so a batch whose transaction fails leaves the caller's carry intact.

Mapping (fleet comes from the subject; every time is timezone-aware UTC):

    model_loading/resident/sleeping/waking/lost/failed/stopped -> residency_transitions
        state = the tag without `model_`; reason = the loss reason (lost only);
        detail = the loss detail, the runtime's words (failed) or the stop detail (stopped)
    model_lost     opens an incident on (fleet, domain, model) unless one is open already
                   (the first loss is the cause; later losses while unresolved do not reopen it)
    model_resident closes the open incident there: closed_at - opened_at is its duration
    gpu_observed   -> gpu_observations (present may be NULL: no NVML, honestly unknown)
    promotion_requested/demotion_requested -> operations (in flight)
    operation_completed/operation_aborted  -> closes the operation, with its duration
    step_started   -> operation_steps (running); a second start of a running step closes the
                      first as `restarted` (a promoter resumed it after a crash)
    step_completed/step_failed -> closes the running step, with its duration and outcome
    domain_declared/domain_changed/domain_retired -> domains (provider, region, ...)
    a body that is not a valid event (or an unparseable subject) -> skipped_events
    an event that may not stand on its subject (`haru.authority`: a route_moved on an agent's
    subject, a body naming another domain than its subject) -> skipped_events, error
    "misplaced: seq N: <type> on <subject> by <writer> not applied: <why>", and no other row

Everything else advances the position and writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from datetime import datetime, timezone
from typing import Any, Protocol

from haru import authority
from haru import events as ev
from haru.errors import InvalidName
from haru.subjects import parse


class LogRecord(Protocol):
    seq: int
    subject: str
    time: datetime
    data: bytes
    event: Any
    error: str


Key = tuple[str, str, str]  # (fleet, domain, model) or (fleet, op_id, step)


@dataclass(frozen=True, slots=True)
class OpenSpan:
    """A span started by event `seq` at `at` (observed time), not yet closed."""

    seq: int
    at: datetime | None


@dataclass(frozen=True, slots=True)
class Carry:
    """State that spans batches. Rebuilt from the database on start (`OPEN_*` queries)."""

    incidents: dict[Key, OpenSpan] = field(default_factory=dict)  # (fleet, domain, model)
    operations: dict[tuple[str, str], OpenSpan] = field(default_factory=dict)  # (fleet, op_id)
    steps: dict[Key, OpenSpan] = field(default_factory=dict)  # (fleet, op_id, step)


@dataclass(frozen=True, slots=True)
class Writes:
    """One batch's output. `copies` are new rows per table (columns in `pg_schema.COPY_TABLES`
    order); the rest are argument tuples for the statements named after them in `pg_schema`."""

    last_seq: int
    copies: dict[str, list[tuple]]
    close_incidents: list[tuple]  # CLOSE_INCIDENT (opened_seq, closed_seq, closed_at, duration_ms)
    insert_operations: list[tuple]  # INSERT_OPERATION
    finish_operations: list[tuple]  # FINISH_OPERATION
    finish_steps: list[tuple]  # FINISH_STEP
    upsert_domains: list[tuple]  # UPSERT_DOMAIN
    skipped: list[tuple[int, str, str]]  # (seq, subject, error), for the shell to log

    @property
    def row_count(self) -> int:
        return (
            sum(len(rows) for rows in self.copies.values())
            + len(self.close_incidents)
            + len(self.insert_operations)
            + len(self.finish_operations)
            + len(self.finish_steps)
            + len(self.upsert_domains)
        )


_UTC = timezone.utc


def utc(t: datetime | None) -> datetime | None:
    """Aware UTC; a naive time is taken to be UTC already (Haru writes UTC)."""
    if t is None or t.tzinfo is _UTC:
        return t
    if t.tzinfo is None:
        return t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc)


def millis(start: datetime | None, end: datetime | None) -> int | None:
    if start is None or end is None:
        return None
    delta = end - start
    return delta.days * 86_400_000 + delta.seconds * 1000 + delta.microseconds // 1000


@lru_cache(maxsize=65536)
def fleet_of(subject: str) -> tuple[str, str]:
    """(fleet, '') for a Haru event subject, ('', why) for anything else. Cached: subjects repeat."""
    try:
        return parse(subject).fleet, ""
    except InvalidName as exc:
        return "", str(exc)


_STATE = {
    ev.ModelLoading: "loading",
    ev.ModelResident: "resident",
    ev.ModelSleeping: "sleeping",
    ev.ModelWaking: "waking",
    ev.ModelLost: "lost",
    ev.ModelFailed: "failed",
    ev.ModelStopped: "stopped",
}


def transition_row(seq: int, fleet: str, recorded_at: datetime, e: Any) -> tuple:
    """One residency event as a `residency_transitions` row (TRANSITION_COLUMNS order)."""
    kind = type(e)
    reason = warmup_ms = exit_code = None
    detail = ""
    if kind is ev.ModelAdopted:  # a runtime kept through an agent restart: its state is how it was found
        state = "sleeping" if e.asleep else "resident"
        detail = e.detail
    else:
        state = _STATE[kind]
    if kind is ev.ModelResident:
        warmup_ms = e.warmup_ms
    elif kind is ev.ModelLost:
        reason, detail, exit_code = e.reason, e.detail, e.exit_code
    elif kind is ev.ModelStopped:
        detail = e.detail
    elif kind is ev.ModelFailed:
        detail = e.runtime_said
    return (
        seq, fleet, e.domain, e.model, state, reason, detail,
        utc(e.at), recorded_at, e.by, warmup_ms, exit_code,
    )  # fmt: skip


def gpu_row(seq: int, fleet: str, recorded_at: datetime, e: ev.GpuObserved) -> tuple:
    return (
        seq, fleet, e.domain, e.index, e.present, e.name, e.memory_total_bytes,
        e.memory_used_bytes, len(e.processes), e.mig, utc(e.at), recorded_at,
    )  # fmt: skip


def plan(carry: Carry, records: list[LogRecord]) -> tuple[Writes, Carry]:
    """The rows and updates one batch of records makes, and the carry after it."""
    incidents = dict(carry.incidents)
    operations = dict(carry.operations)
    steps = dict(carry.steps)

    transitions: list[tuple] = []
    gpus: list[tuple] = []
    skipped_rows: list[tuple] = []
    skipped: list[tuple[int, str, str]] = []
    # Rows new in this batch that a later event of the same batch may still close: kept as lists.
    new_incidents: dict[int, list] = {}
    new_steps: dict[int, list] = {}
    new_operations: dict[tuple[str, str], list] = {}
    close_incidents: list[tuple] = []
    finish_operations: list[tuple] = []
    finish_steps: list[tuple] = []
    domains: list[tuple] = []
    last_seq = 0

    for rec in records:
        seq = rec.seq
        last_seq = seq
        e = rec.event
        recorded_at = utc(rec.time)
        if e is None:
            error = rec.error or "not a valid Haru event"
            skipped.append((seq, rec.subject, error))
            skipped_rows.append((seq, rec.subject, error, recorded_at, bytes(rec.data or b"")))
            continue
        fleet, bad_subject = fleet_of(rec.subject)
        if bad_subject:
            skipped.append((seq, rec.subject, bad_subject))
            skipped_rows.append((seq, rec.subject, bad_subject, recorded_at, bytes(rec.data or b"")))
            continue
        why = authority.misplaced(rec.subject, e)
        if why:  # the subject is the authority: not applied, kept with the skipped bodies
            error = "misplaced: " + authority.anomaly(seq, rec.subject, e, why)
            skipped.append((seq, rec.subject, error))
            skipped_rows.append((seq, rec.subject, error, recorded_at, bytes(rec.data or b"")))
            continue
        kind = type(e)

        if kind in _STATE or kind is ev.ModelAdopted:
            row = transition_row(seq, fleet, recorded_at, e)
            transitions.append(row)
            if kind is ev.ModelLost:
                key = (fleet, e.domain, e.model)
                at = row[7]
                if key not in incidents:
                    incidents[key] = OpenSpan(seq, at)
                    new_incidents[seq] = [
                        seq, fleet, e.domain, e.model, e.reason, e.detail, at, None, None, None,
                    ]  # fmt: skip
            elif kind is ev.ModelResident and incidents:
                span = incidents.pop((fleet, e.domain, e.model), None)
                if span is not None:
                    at = row[7]
                    duration = millis(span.at, at)
                    new_row = new_incidents.get(span.seq)
                    if new_row is not None:
                        new_row[7:10] = [seq, at, duration]
                    else:
                        close_incidents.append((span.seq, seq, at, duration))

        elif kind is ev.GpuObserved:
            gpus.append(gpu_row(seq, fleet, recorded_at, e))

        elif issubclass(kind, ev.OperationRequested):
            key2 = (fleet, e.op_id)
            if key2 in operations or key2 in new_operations:
                continue  # a second request for an operation already recorded adds nothing
            at = utc(e.at)
            operations[key2] = OpenSpan(seq, at)
            row = [fleet, e.op_id, e.kind, e.target, getattr(e, "source", ""), getattr(e, "reason", "manual"),
                   getattr(e, "detail", "")]
            new_operations[key2] = row + [seq, at, None, None, None, None, "", ""]

        elif kind is ev.OperationCompleted or kind is ev.OperationAborted:
            key2 = (fleet, e.op_id)
            at = utc(e.at)
            aborted = kind is ev.OperationAborted
            outcome = "aborted" if aborted else "completed"
            failed_step = e.step if aborted else ""
            error = e.error if aborted else ""
            span = operations.pop(key2, None)
            duration = millis(span.at, at) if span is not None else None
            if key2 in new_operations:
                new_operations[key2][9:15] = [outcome, seq, at, duration, failed_step, error]
            elif span is not None:
                finish_operations.append((fleet, e.op_id, outcome, seq, at, duration, failed_step, error))
            else:  # its request predates what this read model saw: record what is known
                new_operations[key2] = [
                    fleet, e.op_id, None, "", "", "", "", None, None,
                    outcome, seq, at, None, failed_step, error,
                ]  # fmt: skip

        elif kind is ev.StepStarted:
            key3 = (fleet, e.op_id, e.step)
            at = utc(e.at)
            previous = steps.get(key3)
            if previous is not None:  # restarted: close the abandoned attempt
                _finish_step(new_steps, finish_steps, previous, "restarted", seq, at, None, "", "", "")
            steps[key3] = OpenSpan(seq, at)
            new_steps[seq] = [
                seq, fleet, e.op_id, e.step, e.attempt, at, None, None, None, None, None, "", "", "",
            ]  # fmt: skip

        elif kind is ev.StepCompleted or kind is ev.StepFailed:
            key3 = (fleet, e.op_id, e.step)
            at = utc(e.at)
            failed = kind is ev.StepFailed
            outcome = "failed" if failed else "completed"
            detail = "" if failed else e.detail
            code = e.error_code if failed else ""
            error = e.error if failed else ""
            span = steps.pop(key3, None)
            if span is None:  # no start seen: a row of its own, keyed by this event
                new_steps[seq] = [
                    seq, fleet, e.op_id, e.step, 1, None, outcome, seq, at, None, e.took_ms,
                    detail, code, error,
                ]  # fmt: skip
            else:
                _finish_step(new_steps, finish_steps, span, outcome, seq, at, e.took_ms, detail, code, error)

        elif kind is ev.DomainDeclared or kind is ev.DomainChanged:
            s = e.spec
            domains.append(
                (fleet, s.name, s.provider, s.region, s.serving_url, s.serve, len(s.gpus), seq, utc(e.at), None)
            )
        elif kind is ev.DomainRetired:
            at = utc(e.at)
            domains.append((fleet, e.domain, None, None, None, None, None, seq, at, at))

    writes = Writes(
        last_seq=last_seq,
        copies={
            "residency_transitions": transitions,
            "gpu_observations": gpus,
            "incidents": [tuple(r) for r in new_incidents.values()],
            "operation_steps": [tuple(r) for r in new_steps.values()],
            "skipped_events": skipped_rows,
        },
        close_incidents=close_incidents,
        insert_operations=[tuple(r) for r in new_operations.values()],
        finish_operations=finish_operations,
        finish_steps=finish_steps,
        upsert_domains=domains,
        skipped=skipped,
    )
    return writes, Carry(incidents=incidents, operations=operations, steps=steps)


def _finish_step(
    new_steps: dict[int, list],
    finish_steps: list[tuple],
    span: OpenSpan,
    outcome: str,
    seq: int,
    at: datetime | None,
    took_ms: int | None,
    detail: str,
    code: str,
    error: str,
) -> None:
    duration = millis(span.at, at)
    row = new_steps.get(span.seq)
    if row is not None:
        row[6:14] = [outcome, seq, at, duration, took_ms, detail, code, error]
    else:
        finish_steps.append((span.seq, outcome, seq, at, duration, took_ms, detail, code, error))


def carry_from_rows(incidents: list, operations: list, steps: list) -> Carry:
    """The carry from the `OPEN_INCIDENTS`, `OPEN_OPERATIONS` and `RUNNING_STEPS` rows."""
    return Carry(
        incidents={(r[0], r[1], r[2]): OpenSpan(r[3], r[4]) for r in incidents},
        operations={(r[0], r[1]): OpenSpan(r[2] or 0, r[3]) for r in operations},
        steps={(r[0], r[1], r[2]): OpenSpan(r[3], r[4]) for r in steps},
    )
