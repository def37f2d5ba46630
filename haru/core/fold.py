"""The fleet fold: `HARU_EVENTS` -> one `FleetView` per fleet. Pure: no I/O, no clock, no logging.

    view = evolve(view, event, seq=record.seq, subject=record.subject)
    views = fold([(seq, subject, event), ...], views)

`evolve` handles every event type in `haru.core.events.AnyEvent`:

    declarations   fleet_declared, policy_changed, domain_*, model_*, training_* (declared,
                   changed, retired) and admission_decided build `domains`, their `models` and
                   `training`, in declaration order
    residency      model_loading .. model_stopped move `ModelView.residency` through
                   `haru.core.residency.evolve`; an illegal transition found in the log is folded
                   leniently (the state the event establishes, `haru.core.residency.to_state`) and
                   counted in `anomalies`: the log is what the agent observed
    GPUs           gpu_observed -> the observed fields of `GpuView` (a GPU observed but never
                   declared is added, in index order)
    training       training_started/stopped -> `TrainingView`
    agent          agent_started/stopping -> `AgentView`
    liveness       domain_unreachable/reachable -> `DomainView.reachable`
    operations     every kind's request (ev.OPERATION_REQUESTS), step_*, operation_completed/aborted ->
                   `operation` (in flight) and `last_operation` (finished), with their steps
    decisions      failover_declined -> `declined`; eligibility_changed -> `eligible`
    route pointer  route_moved -> `active`, `route_revision` (= its stream sequence), `route_moved_at`;
                   it resets the traffic weights (the new active takes everything)
    weights        weights_set -> `weights` (the fleet's split) or `model_weights[model]`, and
                   `weights_change` (why, by whom, a rollback's evidence); haru.core.weights

This module is the fold's dispatch: the table of handlers, `evolve`, and the incremental `Folder`.
The handlers live by kind: `haru.core.fold_declarations` (declarations, admission),
`haru.core.fold_observations` (residency, GPUs, training, agent, liveness, eligibility) and
`haru.core.fold_operations` (operations, decisions, route pointer, weights); `haru.core.fold_anomalies`
keeps the count of what could not be folded as written.

Every event sets `view.seq` (the last stream sequence folded) and `updated_at` (its `at`); events on
the fleet-level subjects also set `decl_seq`, `op_seq` or `route_seq`.

An event that may not stand on the subject it was stored on (`haru.core.authority`: a `route_moved`
anywhere but `haru.evt.<fleet>.route`, a `model_lost` whose body names another domain than its
subject) is NOT applied: it only bumps `seq` (and `decl_seq`/`op_seq`/`route_seq` on those
subjects, which are the subjects' real last sequences) and is counted in `anomalies`, with
`last_anomaly` naming its sequence, subject and writer. The subject is the authority, not the body.

Events about a domain, model or training slot that is not declared (never declared, or retired)
are NOT folded into the view: they only bump `seq` and are counted in `anomalies` with
`last_anomaly` saying which. Creating entries lazily would resurrect a retired model when its
agent reports it stopped after the retirement, which is the normal order of things.
A GPU index that was not declared is different: it is an observed fact about the host, and is shown.

Events at or below a view's `seq` are skipped by `fold` (not by `evolve`), so replaying a log
from before a stored view's sequence is idempotent.

There is one fold: `Folder`, incremental, and `evolve` is its specification. `add` stages residency
events (the bulk of a log) per (domain, model) in a mutable accumulator instead of building a new
frozen view per event, and `view()` materializes the view only when something reads it. Every
other event materializes first and goes through `evolve`. The projector, the promoter, `haru
promote`'s reads and `fold` all fold with it (`add_one` for a dict of fleets); `evolve` is what the
tests hold it to: `Folder(v).add(...)...view()` equals folding the same events with `evolve`, event
by event (tests/unit/test_fold_incremental.py proves it on random histories, legal and not,
materialized at random points). Subjects are read by `haru.core.subjects.read` (memoized).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from haru.core import authority, fold_adapters, residency, subjects
from haru.core import events as ev
from haru.core import fold_anomalies as anomalies
from haru.core import fold_declarations as declarations
from haru.core import fold_observations as observations
from haru.core import fold_operations as operations
from haru.core.errors import IllegalTransition
from haru.core.subjects import fleet_of
from haru.core.views import FleetView, ModelView

__all__ = [
    "HANDLED",
    "Folder",
    "add_one",
    "empty",
    "evolve",
    "fleet_of",
    "fold",
    "invalid",
    "misplaced",
]

_replace = msgspec.structs.replace


def empty(fleet: str) -> FleetView:
    """The view of a fleet before any event."""
    return FleetView(fleet=fleet)


def _kind(subject: str) -> str:
    # The fourth token names the fleet-level subjects; that is all `evolve` needs from a subject.
    return subjects.read(subject).level


# --------------------------------------------------------------------------------------- table

# Event type -> how it changes the view, by the module of its kind (fold_declarations, fold_observations,
# fold_operations). Residency events are handled by `fold_observations.residency_observed`.
_HANDLERS: dict[type, Callable[[FleetView, Any, int], FleetView]] = {
    ev.FleetDeclared: declarations.fleet_declared,
    ev.PolicyChanged: declarations.policy_changed,
    ev.DomainDeclared: declarations.domain_declared,
    ev.DomainChanged: declarations.domain_declared,
    ev.DomainRetired: declarations.domain_retired,
    ev.ModelDeclared: declarations.model_declared,
    ev.ModelChanged: declarations.model_declared,
    ev.ModelRetired: declarations.model_retired,
    ev.TrainingDeclared: declarations.training_declared,
    ev.TrainingChanged: declarations.training_declared,
    ev.TrainingRetired: declarations.training_retired,
    ev.GpuObserved: observations.gpu_observed,
    ev.TrainingStarted: observations.training_started,
    ev.TrainingStopped: observations.training_stopped,
    ev.AgentStarted: observations.agent_started,
    ev.AgentStopping: observations.agent_stopping,
    ev.FailureSignalled: observations.failure_signalled,
    ev.DomainUnreachable: observations.reachability,
    ev.DomainReachable: observations.reachability,
    **{cls: operations.operation_requested for cls in ev.OPERATION_REQUESTS.values()},
    ev.StepStarted: operations.step_started,
    ev.StepCompleted: operations.step_ended,
    ev.StepFailed: operations.step_ended,
    ev.PromotionRetargeted: operations.promotion_retargeted,
    ev.OperationCompleted: operations.operation_completed,
    ev.OperationAborted: operations.operation_aborted,
    ev.FailoverDeclined: operations.failover_declined,
    ev.EligibilityChanged: observations.eligibility,
    ev.RouteMoved: operations.route_moved,
    ev.WeightsSet: operations.weights_set,
    ev.ModelFetched: lambda view, e, seq: view,  # provenance of model files: history (`haru why`), not state
    ev.AdapterPublished: fold_adapters.adapter_published,
    ev.Checkpoint: lambda view, e, seq: view,  # a record of where history stood: it changes no fact
    ev.AdapterStateChanged: fold_adapters.adapter_state_changed,
    ev.AdapterRouted: fold_adapters.adapter_routed,
    ev.PriceDeclared: lambda view, e, seq: view,  # prices and tokens are the accounting's (haru.core.cost),
    ev.TokensCounted: lambda view, e, seq: view,  # not the fleet view's
}
# Handlers that need the subject the event stood on (what it may claim depends on who wrote it).
_BY_SUBJECT: dict[type, Callable[[FleetView, Any, int, str], FleetView]] = {
    ev.LogRegressed: anomalies.log_regressed,
    ev.DomainLogRegressed: anomalies.log_regressed,
}
_RESIDENCY = frozenset(ev.RESIDENCY_EVENTS)
# Events about a domain after which a declined failover of that domain may be over (it is healthy).
_RECOVERY = frozenset({ev.DomainReachable, ev.GpuObserved, ev.AgentStarted})

HANDLED: frozenset[type] = frozenset(_HANDLERS) | frozenset(_BY_SUBJECT) | _RESIDENCY | {ev.AdmissionDecided}
"""Every event type the fold understands (the tests check this is all of `AnyEvent`)."""


def evolve(view: FleetView, event: ev.Event, *, seq: int, subject: str) -> FleetView:
    """The view after one event recorded at stream sequence `seq` on `subject` (a misplaced one is
    not applied: see `misplaced`)."""
    why = authority.misplaced(subject, event)
    if why:
        return misplaced(view, event, seq=seq, subject=subject, why=why)
    return _evolve(view, event, seq, subject, _kind(subject))


def _evolve(view: FleetView, event: ev.Event, seq: int, subject: str, kind: str) -> FleetView:
    cls = type(event)
    if cls in _RESIDENCY:
        return observations.residency_observed(view, event, seq, subject)  # sets seq and updated_at itself
    if isinstance(event, ev.AdmissionDecided):
        out = declarations.admission_decided(view, event, seq, subject)
    elif cls in _BY_SUBJECT:
        out = _BY_SUBJECT[cls](view, event, seq, subject)
    else:
        handler = _HANDLERS.get(cls)
        out = (
            handler(view, event, seq)
            if handler is not None
            else anomalies.anomaly(
                view, f"seq {seq}: event type {cls.__name__} is not known to this projector", event.at
            )
        )
        if out.anomalies != view.anomalies and out.last_anomaly_at is not event.at:
            out = _replace(out, last_anomaly_at=event.at)
        if cls in _RECOVERY:
            out = anomalies.decline_over(out, event)
        elif isinstance(event, (ev.ModelDeclared, ev.ModelChanged)):
            out = anomalies.anomaly_cleared(out, f"{event.domain}/{event.spec.name}", event.at)
    if kind == "decl":
        return _replace(out, seq=seq, updated_at=event.at, decl_seq=seq)
    if kind == "op":
        return _replace(out, seq=seq, updated_at=event.at, op_seq=seq)
    if kind == "route":
        return _replace(out, seq=seq, updated_at=event.at, route_seq=seq)
    if kind == "weights":
        return _replace(out, seq=seq, updated_at=event.at, weights_seq=seq)
    return _replace(out, seq=seq, updated_at=event.at)


def _stored_on(view: FleetView, seq: int, kind: str) -> FleetView:
    # Something was stored at `seq` on a subject of `kind` without being applied: the view's
    # position moves, and so does the fleet-level subject's last sequence (what a writer expects).
    if kind == "decl":
        return _replace(view, seq=seq, decl_seq=seq)
    if kind == "op":
        return _replace(view, seq=seq, op_seq=seq)
    if kind == "route":
        return _replace(view, seq=seq, route_seq=seq)
    if kind == "weights":
        return _replace(view, seq=seq, weights_seq=seq)
    return _replace(view, seq=seq)


def invalid(view: FleetView, *, seq: int, subject: str, error: str) -> FleetView:
    """The view after a body on one of its subjects that is not a valid event: skipped, counted."""
    first = error.splitlines()[0] if error else "not a valid event"
    return _stored_on(anomalies.anomaly(view, f"seq {seq}: body on {subject} skipped: {first}"), seq, _kind(subject))


def misplaced(view: FleetView, event: ev.Event, *, seq: int, subject: str, why: str) -> FleetView:
    """The view after an event that may not stand on `subject` (`haru.core.authority.misplaced` said
    `why`): not applied, counted, and named in `last_anomaly` with its sequence, subject and writer."""
    return _stored_on(
        anomalies.anomaly(view, authority.anomaly(seq, subject, event, why), event.at), seq, _kind(subject)
    )


# ------------------------------------------------------------------------- incremental folding


class Folder:
    """One fleet's view, folded incrementally: `add` events, read `view()` when needed.

    Residency events (the hot path) only stage the model's new state, `seq`, `updated_at` and the
    anomaly count; `view()` applies what is staged (one copy of each touched domain's `models`,
    one of `domains`) and caches the result until the next `add`. Any other event, and a body that
    did not decode, materializes first and is folded by `evolve`/`invalid` as it is. The output is
    equal to `evolve`'s, event for event.
    """

    __slots__ = (
        "fleet",
        "seq",
        "misplaced_seq",
        "_view",
        "_staged",
        "_measured",
        "_at",
        "_anomalies",
        "_last_anomaly",
        "_anomaly_at",
        "_anomaly_about",
        "_anomaly_cleared_at",
        "_dirty",
    )

    def __init__(self, view: FleetView) -> None:
        self.fleet = view.fleet
        self.misplaced_seq = 0  # the sequence of the last misplaced event added (for the shell's log)
        self._reset(view)

    def _reset(self, view: FleetView) -> None:
        self._staged: dict[tuple[str, str], residency.Residency] = {}
        self._measured: dict[tuple[str, str], dict[str, int]] = {}  # `observations.measured` figures staged with them
        self._set(view)

    def _set(self, view: FleetView) -> None:
        # A view with nothing staged on top (the caller materialized first): take its scalars.
        self._view = view  # the materialized view, without what is staged
        self.seq = view.seq  # the last sequence added (what `add_one` compares against)
        self._at = view.updated_at
        self._anomalies = view.anomalies
        self._last_anomaly = view.last_anomaly
        self._anomaly_at = view.last_anomaly_at
        self._anomaly_about = view.anomaly_about
        self._anomaly_cleared_at = view.anomaly_cleared_at
        self._dirty = False  # something is staged that `_view` does not have

    def reset(self, view: FleetView) -> None:
        """Start over from `view` (an adopted view, a moved checkpoint); drops what is staged."""
        if view.fleet != self.fleet:
            raise ValueError(f"a view of fleet {view.fleet!r} given to the folder of {self.fleet!r}")
        self._reset(view)

    def view(self) -> FleetView:
        """The view after everything added so far."""
        if self._dirty:
            self._materialize()
        return self._view

    def add(self, event: ev.Event, *, seq: int, subject: str) -> None:
        """Fold one event recorded at `seq` on `subject` (like `evolve`: no skipping here)."""
        _, level, place, _ = subjects.read(subject)
        self._add(event, seq, subject, level, place)

    def _add(self, event: ev.Event, seq: int, subject: str, level: str, place: subjects.Where | None) -> None:
        if type(event) in _RESIDENCY:
            # The common case, the authority check inlined: a residency event stands on its own
            # model's subject (`authority.misplaced_at` says why when it does not).
            if (
                place is not None
                and place.kind == "model"
                and event.domain == place.domain  # type: ignore[attr-defined]
                and event.model == place.model  # type: ignore[attr-defined]
            ):
                if self._view.declined and event.domain == self._view.declined_domain:  # type: ignore[attr-defined]
                    self._set(_evolve(self.view(), event, seq, subject, level))  # may clear the decline
                else:
                    self._residency(event, seq, subject)
            else:
                self.add_misplaced(event, seq=seq, subject=subject, why=authority.misplaced_at(place, event))
            return
        why = authority.misplaced_at(place, event)
        if why:
            self.add_misplaced(event, seq=seq, subject=subject, why=why)
        else:
            self._set(_evolve(self.view(), event, seq, subject, level))

    def add_misplaced(self, event: ev.Event, *, seq: int, subject: str, why: str) -> None:
        """An event that may not stand on `subject` (see `misplaced`): counted, not applied."""
        self._set(misplaced(self.view(), event, seq=seq, subject=subject, why=why))
        self.misplaced_seq = seq

    def add_invalid(self, *, seq: int, subject: str, error: str) -> None:
        """A body on one of the fleet's subjects that is not a valid event (see `invalid`)."""
        self._set(invalid(self.view(), seq=seq, subject=subject, error=error))

    def _residency(self, e: Any, seq: int, subject: str) -> None:
        # `fold_observations.residency_observed` without the copies: the model's current state is the staged
        # one, else the view's.
        key = (e.domain, e.model)
        old = self._staged.get(key)
        if old is None:
            domain = self._view.domains.get(e.domain)
            model = domain.models.get(e.model) if domain is not None else None
            if model is None:
                self._anomalies += 1
                self._last_anomaly = (
                    f"seq {seq}: {ev.tag_of(e)} for model {e.model!r} on domain {e.domain!r}, which is not declared"
                )
                self._anomaly_at, self._anomaly_about, self._anomaly_cleared_at = e.at, f"{e.domain}/{e.model}", None
                self.seq = seq
                self._at = e.at
                self._dirty = True
                return
            old = model.residency
        try:
            state = residency.evolve(old, e, seq=seq, subject=subject)
        except IllegalTransition as exc:
            state = residency.to_state(e, seq=seq)
            self._anomalies += 1
            self._last_anomaly = f"seq {seq}: {exc}"
            self._anomaly_at, self._anomaly_about, self._anomaly_cleared_at = e.at, f"{e.domain}/{e.model}", None
        else:
            if self._anomaly_cleared_at is None and self._anomaly_about == f"{e.domain}/{e.model}":
                self._anomaly_cleared_at = e.at
        if state is not old:
            self._staged[key] = state
            if type(e) is ev.ModelResident:
                measured = observations.measured(old, e)
                if measured:
                    self._measured.setdefault(key, {}).update(measured)
        self.seq = seq
        self._at = e.at
        self._dirty = True

    def _materialize(self) -> None:
        view = self._view
        staged = self._staged
        if staged:
            domains = dict(view.domains)
            touched: dict[str, dict[str, ModelView]] = {}
            for (d, m), state in staged.items():
                models = touched.get(d)
                if models is None:
                    models = touched[d] = dict(domains[d].models)
                models[m] = _replace(models[m], residency=state, **self._measured.get((d, m), {}))
            for d, models in touched.items():
                domains[d] = _replace(domains[d], models=models)
            staged.clear()
            self._measured.clear()
            view = _replace(view, domains=domains)
        self._view = _replace(
            view,
            seq=self.seq,
            updated_at=self._at,
            anomalies=self._anomalies,
            last_anomaly=self._last_anomaly,
            last_anomaly_at=self._anomaly_at,
            anomaly_about=self._anomaly_about,
            anomaly_cleared_at=self._anomaly_cleared_at,
        )
        self._dirty = False


def add_one(
    folders: dict[str, Folder], event: ev.Event | None, *, seq: int, subject: str, error: str = ""
) -> Folder | None:
    """Fold one event into `folders` (fleet -> Folder, updated in place): what every service folds with.

    Returns the fleet's folder, or None when the event was skipped: its subject names no fleet, or
    the fleet already folded `seq` (a replay from before the view's own checkpoint). `event=None` is
    a body that did not decode (`error` says why): it is counted, not folded.
    """
    fleet, level, place, _ = subjects.read(subject)
    if not fleet:
        return None
    folder = folders.get(fleet)
    if folder is None:
        folder = folders[fleet] = Folder(empty(fleet))
    elif seq <= folder.seq:
        return None
    if event is None:
        folder.add_invalid(seq=seq, subject=subject, error=error)
    else:
        folder._add(event, seq, subject, level, place)
    return folder


def fold(
    entries: Iterable[tuple[int, str, ev.Event | None]], views: Mapping[str, FleetView] | None = None
) -> dict[str, FleetView]:
    """Fold `(seq, subject, event)` entries, in stream order, into views keyed by fleet.

    Starts from `views` (not modified) or from nothing. Entries at or below a fleet's view `seq`
    are skipped, so folding a replay that overlaps the views is idempotent. An entry whose event is
    None (a body that did not decode) is counted in its fleet's anomalies.
    """
    out = dict(views) if views else {}
    folders = {fleet: Folder(view) for fleet, view in out.items()}
    for seq, subject, event in entries:
        add_one(folders, event, seq=seq, subject=subject)
    out.update((fleet, folder.view()) for fleet, folder in folders.items())
    return out
