"""Events to Postgres rows: the pure core of the Postgres read model.

    writes, carry = plan(carry, records)

`records` are log records in stream order (anything with `.seq .subject .time .event .error .data`,
as `haru.log.eventlog.Record` has); `carry` is what spans across batches: the open incidents, the
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
    promotion_retargeted -> the operation's target becomes the next standby, the one left appended to `tried`
    operation_completed/operation_aborted  -> closes the operation, with its duration
    step_started   -> operation_steps (running); a second start of a running step closes the
                      first as `restarted` (a promoter resumed it after a crash)
    step_completed/step_failed -> closes the running step, with its duration and outcome
    domain_declared/domain_changed/domain_retired -> domains (provider, region, ...)
    a body that is not a valid event (or an unparseable subject) -> skipped_events
    an event that may not stand on its subject (`haru.core.authority`: a route_moved on an agent's
    subject, a body naming another domain than its subject) -> skipped_events, error
    "misplaced: seq N: <type> on <subject> by <writer> not applied: <why>", and no other row

Everything else advances the position and writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Protocol

from haru.core import authority, subjects
from haru.core import events as ev
from haru.core.operations import ms_between


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


# Rows a later event of the same batch may still close, by name (a COPY takes them as `row()`, in
# their table's column order: `pg_schema.INCIDENT_COLUMNS`, `STEP_COLUMNS`, `OPERATION_COLUMNS`).


@dataclass(slots=True)
class _Row:
    def row(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))


@dataclass(slots=True)
class IncidentRow(_Row):
    opened_seq: int
    fleet: str
    domain: str
    model: str
    reason: str
    detail: str
    opened_at: datetime | None
    closed_seq: int | None = None
    closed_at: datetime | None = None
    duration_ms: int | None = None


@dataclass(slots=True)
class StepRow(_Row):
    seq: int
    fleet: str
    op_id: str
    step: str
    attempt: int
    started_at: datetime | None
    outcome: str | None = None
    finished_seq: int | None = None
    finished_at: datetime | None = None
    duration_ms: int | None = None
    took_ms: int | None = None
    detail: str = ""
    error_code: str = ""
    error: str = ""


@dataclass(slots=True)
class OperationRow(_Row):
    fleet: str
    op_id: str
    kind: str | None
    target: str
    source: str
    reason: str
    detail: str
    requested_seq: int | None
    requested_at: datetime | None
    outcome: str | None = None
    finished_seq: int | None = None
    finished_at: datetime | None = None
    duration_ms: int | None = None
    failed_step: str = ""
    error: str = ""
    tried: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Writes:
    """One batch's output. `copies` are new rows per table (columns in `pg_schema.COPY_TABLES`
    order); the rest are argument tuples for the statements named after them in `pg_schema`."""

    last_seq: int
    copies: dict[str, list[tuple[Any, ...]]]
    close_incidents: list[tuple[Any, ...]]  # CLOSE_INCIDENT (opened_seq, closed_seq, closed_at, duration_ms)
    insert_operations: list[tuple[Any, ...]]  # INSERT_OPERATION
    finish_operations: list[tuple[Any, ...]]  # FINISH_OPERATION
    finish_steps: list[tuple[Any, ...]]  # FINISH_STEP
    upsert_domains: list[tuple[Any, ...]]  # UPSERT_DOMAIN
    skipped: list[tuple[int, str, str]]  # (seq, subject, error), for the shell to log
    retarget_operations: list[tuple[Any, ...]] = field(default_factory=list)  # RETARGET_OPERATION

    @property
    def row_count(self) -> int:
        return (
            sum(len(rows) for rows in self.copies.values())
            + len(self.close_incidents)
            + len(self.insert_operations)
            + len(self.finish_operations)
            + len(self.finish_steps)
            + len(self.upsert_domains)
            + len(self.retarget_operations)
        )


_UTC = UTC


def utc(t: datetime | None) -> datetime | None:
    """Aware UTC; a naive time is taken to be UTC already (Haru writes UTC)."""
    if t is None or t.tzinfo is _UTC:
        return t
    if t.tzinfo is None:
        return t.replace(tzinfo=UTC)
    return t.astimezone(UTC)


def fleet_of(subject: str) -> tuple[str, str]:
    """(fleet, '') for a Haru event subject, ('', why) for anything else (`haru.core.subjects.read`, memoized)."""
    read = subjects.read(subject)
    return (read.where.fleet, "") if read.where is not None else ("", read.problem)


_STATE: dict[type, str] = {
    ev.ModelPulling: "pulling",
    ev.ModelLoading: "loading",
    ev.ModelResident: "resident",
    ev.ModelSleeping: "sleeping",
    ev.ModelWaking: "waking",
    ev.ModelLost: "lost",
    ev.ModelFailed: "failed",
    ev.ModelStopped: "stopped",
}


def transition_row(seq: int, fleet: str, recorded_at: datetime | None, e: Any) -> tuple[Any, ...]:
    """One residency event as a `residency_transitions` row (TRANSITION_COLUMNS order)."""
    kind = type(e)
    reason = warmup_ms = exit_code = reference = done_bytes = total_bytes = None
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
    elif kind is ev.ModelPulling:  # where the files came from, once every one is verified
        reference, done_bytes, total_bytes, detail = e.reference, e.done_bytes, e.total_bytes, e.origin
    return (
        seq, fleet, e.domain, e.model, state, reason, detail,
        utc(e.at), recorded_at, e.by, warmup_ms, exit_code, reference, done_bytes, total_bytes,
    )  # fmt: skip


def gpu_row(seq: int, fleet: str, recorded_at: datetime | None, e: ev.GpuObserved) -> tuple[Any, ...]:
    return (
        seq, fleet, e.domain, e.index, e.present, e.name, e.memory_total_bytes,
        e.memory_used_bytes, len(e.processes), e.mig, utc(e.at), recorded_at,
    )  # fmt: skip


def plan(carry: Carry, records: list[LogRecord]) -> tuple[Writes, Carry]:
    """The rows and updates one batch of records makes, and the carry after it."""
    batch = _Batch(dict(carry.incidents), dict(carry.operations), dict(carry.steps))
    last_seq = 0
    for rec in records:
        seq = last_seq = rec.seq
        e = rec.event
        if e is None:
            batch.skip(rec, rec.error or "not a valid Haru event")
            continue
        fleet, bad_subject = fleet_of(rec.subject)
        if bad_subject:
            batch.skip(rec, bad_subject)
            continue
        why = authority.misplaced(rec.subject, e)
        if why:  # the subject is the authority: not applied, kept with the skipped bodies
            batch.skip(rec, "misplaced: " + authority.anomaly(seq, rec.subject, e, why))
            continue
        batch.add(seq, fleet, rec.time, e)
    return batch.writes(last_seq), Carry(incidents=batch.incidents, operations=batch.operations, steps=batch.steps)


@dataclass(slots=True)
class _Batch:
    """What one batch has made so far. Rows new in this batch stay open to a later event of the batch."""

    incidents: dict[Key, OpenSpan]
    operations: dict[tuple[str, str], OpenSpan]
    steps: dict[Key, OpenSpan]
    transitions: list[tuple[Any, ...]] = field(default_factory=list)
    gpus: list[tuple[Any, ...]] = field(default_factory=list)
    skipped_rows: list[tuple[Any, ...]] = field(default_factory=list)
    skipped: list[tuple[int, str, str]] = field(default_factory=list)
    new_incidents: dict[int, IncidentRow] = field(default_factory=dict)
    new_steps: dict[int, StepRow] = field(default_factory=dict)
    new_operations: dict[tuple[str, str], OperationRow] = field(default_factory=dict)
    close_incidents: list[tuple[Any, ...]] = field(default_factory=list)
    finish_operations: list[tuple[Any, ...]] = field(default_factory=list)
    finish_steps: list[tuple[Any, ...]] = field(default_factory=list)
    domains: list[tuple[Any, ...]] = field(default_factory=list)
    retargets: list[tuple[Any, ...]] = field(default_factory=list)
    prices: list[tuple[Any, ...]] = field(default_factory=list)
    tokens: list[tuple[Any, ...]] = field(default_factory=list)

    def skip(self, rec: LogRecord, error: str) -> None:
        self.skipped.append((rec.seq, rec.subject, error))
        self.skipped_rows.append((rec.seq, rec.subject, error, utc(rec.time), bytes(rec.data or b"")))

    def add(self, seq: int, fleet: str, time: datetime, e: Any) -> None:
        kind = type(e)
        if kind in _STATE or kind is ev.ModelAdopted:
            self.transitions.append(transition_row(seq, fleet, utc(time), e))
            if kind is ev.ModelLost:
                self.incident_opened(seq, fleet, e)
            elif kind is ev.ModelResident and self.incidents:
                self.incident_closed(seq, fleet, e)
        elif kind is ev.GpuObserved:
            self.gpus.append(gpu_row(seq, fleet, utc(time), e))
        elif issubclass(kind, ev.OperationRequested):
            self.operation_requested(seq, fleet, e)
        elif kind is ev.OperationCompleted or kind is ev.OperationAborted:
            self.operation_ended(seq, fleet, e, aborted=kind is ev.OperationAborted)
        elif kind is ev.StepStarted:
            self.step_started(seq, fleet, e)
        elif kind is ev.PromotionRetargeted:
            op = self.new_operations.get((fleet, e.op_id))
            if op is not None:
                op.target, op.tried = e.target, [*op.tried, e.previous]
            else:
                self.retargets.append((fleet, e.op_id, e.target, e.previous))
        elif kind is ev.StepCompleted or kind is ev.StepFailed:
            self.step_ended(seq, fleet, e)
        elif kind is ev.DomainDeclared or kind is ev.DomainChanged:
            s = e.spec
            self.domains.append(
                (fleet, s.name, s.provider, s.region, s.serving_url, s.serve, len(s.gpus), seq, utc(e.at), None)
            )
        elif kind is ev.DomainRetired:
            at = utc(e.at)
            self.domains.append((fleet, e.domain, None, None, None, None, None, seq, at, at))
        elif kind is ev.PriceDeclared:
            p = e.price
            self.prices.append(
                (seq, fleet, e.domain, Decimal(p.per_hour) if p else None, p.currency if p else None,
                 p.source if p else "", p.basis if p else "", utc(e.at))
            )  # fmt: skip
        elif kind is ev.TokensCounted:
            for m in e.models:
                self.tokens.append((seq, m.model, fleet, e.gateway, m.prompt, m.completion, m.responses, utc(e.at)))

    def incident_opened(self, seq: int, fleet: str, e: ev.ModelLost) -> None:
        key = (fleet, e.domain, e.model)
        if key not in self.incidents:  # the first loss is the cause; later ones while unresolved do not reopen it
            at = utc(e.at)
            self.incidents[key] = OpenSpan(seq, at)
            self.new_incidents[seq] = IncidentRow(seq, fleet, e.domain, e.model, e.reason, e.detail, at)

    def incident_closed(self, seq: int, fleet: str, e: ev.ModelResident) -> None:
        span = self.incidents.pop((fleet, e.domain, e.model), None)
        if span is None:
            return
        at = utc(e.at)
        duration = ms_between(span.at, at)
        incident = self.new_incidents.get(span.seq)
        if incident is not None:
            incident.closed_seq, incident.closed_at, incident.duration_ms = seq, at, duration
        else:
            self.close_incidents.append((span.seq, seq, at, duration))

    def operation_requested(self, seq: int, fleet: str, e: ev.OperationRequested) -> None:
        key = (fleet, e.op_id)
        if key in self.operations or key in self.new_operations:
            return  # a second request for an operation already recorded adds nothing
        at = utc(e.at)
        self.operations[key] = OpenSpan(seq, at)
        self.new_operations[key] = OperationRow(
            fleet,
            e.op_id,
            e.kind,
            e.target,
            getattr(e, "source", ""),
            getattr(e, "reason", "manual"),
            getattr(e, "detail", ""),
            seq,
            at,
        )

    def operation_ended(self, seq: int, fleet: str, e: Any, *, aborted: bool) -> None:
        key = (fleet, e.op_id)
        at = utc(e.at)
        outcome = "aborted" if aborted else "completed"
        failed_step, error = (e.step, e.error) if aborted else ("", "")
        span = self.operations.pop(key, None)
        duration = ms_between(span.at, at) if span is not None else None
        op = self.new_operations.get(key)
        if op is not None:
            op.outcome, op.finished_seq, op.finished_at, op.duration_ms = outcome, seq, at, duration
            op.failed_step, op.error = failed_step, error
        elif span is not None:
            self.finish_operations.append((fleet, e.op_id, outcome, seq, at, duration, failed_step, error))
        else:  # its request predates what this read model saw: record what is known
            self.new_operations[key] = OperationRow(
                fleet,
                e.op_id,
                None,
                "",
                "",
                "",
                "",
                None,
                None,
                outcome=outcome,
                finished_seq=seq,
                finished_at=at,
                failed_step=failed_step,
                error=error,
            )

    def step_started(self, seq: int, fleet: str, e: ev.StepStarted) -> None:
        key = (fleet, e.op_id, e.step)
        at = utc(e.at)
        previous = self.steps.get(key)
        if previous is not None:  # restarted: close the abandoned attempt
            self.finish_step(previous, "restarted", seq, at, None, "", "", "")
        self.steps[key] = OpenSpan(seq, at)
        self.new_steps[seq] = StepRow(seq, fleet, e.op_id, e.step, e.attempt, at)

    def step_ended(self, seq: int, fleet: str, e: ev.StepCompleted | ev.StepFailed) -> None:
        at = utc(e.at)
        if isinstance(e, ev.StepFailed):
            outcome, detail, code, error = "failed", "", e.error_code, e.error
        else:
            outcome, detail, code, error = "completed", e.detail, "", ""
        span = self.steps.pop((fleet, e.op_id, e.step), None)
        if span is None:  # no start seen: a row of its own, keyed by this event
            self.new_steps[seq] = StepRow(
                seq,
                fleet,
                e.op_id,
                e.step,
                1,
                None,
                outcome=outcome,
                finished_seq=seq,
                finished_at=at,
                took_ms=e.took_ms,
                detail=detail,
                error_code=code,
                error=error,
            )
        else:
            self.finish_step(span, outcome, seq, at, e.took_ms, detail, code, error)

    def finish_step(
        self,
        span: OpenSpan,
        outcome: str,
        seq: int,
        at: datetime | None,
        took_ms: int | None,
        detail: str,
        code: str,
        error: str,
    ) -> None:
        duration = ms_between(span.at, at)
        row = self.new_steps.get(span.seq)
        if row is not None:
            row.outcome, row.finished_seq, row.finished_at, row.duration_ms = outcome, seq, at, duration
            row.took_ms, row.detail, row.error_code, row.error = took_ms, detail, code, error
        else:
            self.finish_steps.append((span.seq, outcome, seq, at, duration, took_ms, detail, code, error))

    def writes(self, last_seq: int) -> Writes:
        return Writes(
            last_seq=last_seq,
            copies={
                "residency_transitions": self.transitions,
                "gpu_observations": self.gpus,
                "incidents": [r.row() for r in self.new_incidents.values()],
                "operation_steps": [r.row() for r in self.new_steps.values()],
                "skipped_events": self.skipped_rows,
                "prices": self.prices,
                "tokens": self.tokens,
            },
            close_incidents=self.close_incidents,
            insert_operations=[r.row() for r in self.new_operations.values()],
            finish_operations=self.finish_operations,
            finish_steps=self.finish_steps,
            upsert_domains=self.domains,
            skipped=self.skipped,
            retarget_operations=self.retargets,
        )


def carry_from_rows(
    incidents: list[Sequence[Any]], operations: list[Sequence[Any]], steps: list[Sequence[Any]]
) -> Carry:
    """The carry from the `OPEN_INCIDENTS`, `OPEN_OPERATIONS` and `RUNNING_STEPS` rows."""
    return Carry(
        incidents={(r[0], r[1], r[2]): OpenSpan(r[3], r[4]) for r in incidents},
        operations={(r[0], r[1]): OpenSpan(r[2] or 0, r[3]) for r in operations},
        steps={(r[0], r[1], r[2]): OpenSpan(r[3], r[4]) for r in steps},
    )
