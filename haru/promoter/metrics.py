"""The promoter's Prometheus metrics: counted from the log it follows, and read from its views.

Counters and histograms are fed by `PromoterMetrics.record(fleet, rec, view)`, called for every
record the promoter folds. They are therefore the fleet's history since the replica started, not
this replica's deeds: replicas started together report the same figures. A replica starts from the
views stored in KV, not from the first event (`Promoter.resume`), so a restarted one counts from
zero again (a counter reset, which `rate()` and `increase()` allow for); `haru op` and the event log
hold the whole history. Aggregate replicas with `max`, not `sum`.

    haru_promoter_operations_total{fleet, kind, reason, outcome}      finished operations
                                                                       (outcome: completed | aborted)
    haru_promoter_failovers_total{fleet, reason}                      completed promotions that were
                                                                       not manual nor the first route
    haru_promoter_step_duration_seconds{fleet, step, outcome}         step_started.at -> its outcome's at
    haru_promoter_operation_duration_seconds{fleet, kind, outcome}    requested -> completed/aborted
    haru_promoter_failover_duration_seconds{fleet, reason}            the same, for failovers
    haru_promoter_last_operation_duration_seconds{fleet, kind, outcome}   the last finished one
    haru_promoter_declined_total{fleet, reason}                       failover_declined, by a reason
                                                                       class (DECLINE_REASONS)

Gauges read from the promoter's folded views at scrape time:

    haru_promoter_operation_in_flight{fleet, kind, target}            1 while an operation runs
    haru_promoter_operation_running_seconds{fleet}                    how long it has been running
    haru_promoter_active_health{fleet, domain, health}                1 for the active's health
                                                                       (ok | degraded | failed)
    haru_promoter_standby_eligible{fleet, domain}                     1 when that standby could take over now
    haru_promoter_standby_rank{fleet, domain}                         its place in the ranking (1 = promoted first)
    haru_promoter_fit_standbys{fleet}                                 how many standbys could take over now
    haru_promoter_fleet_unprotected{fleet}                            1 when none could (no fit standby)
    haru_promoter_route_revision{fleet}                               the route revision folded
    haru_promoter_domain_reachable{fleet, domain}                     1 / 0 (absent: no verdict yet)
    haru_promoter_events_folded                                       the last sequence folded
"""

from __future__ import annotations

from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from haru.core import ranking
from haru.core.events import (
    FailoverDeclined,
    OperationAborted,
    OperationCompleted,
    StepCompleted,
    StepFailed,
    StepStarted,
    WeightsSet,
)
from haru.core.operations import ms_between
from haru.core.views import FleetView, OperationView
from haru.log.eventlog import Record

# Not a failover: an operator's promotion, and the promoter's first route onto the first domain.
NOT_FAILOVER_REASONS = frozenset({"manual", "initial"})

# failover_declined's `why` is a sentence; its label is the first class whose words it contains.
DECLINE_REASONS: tuple[tuple[str, str], ...] = (
    ("no standby domain declared", "no_standby"),
    ("has not been heard from", "standby_unheard"),
    ("is unreachable", "standby_unreachable"),
    ("is not eligible", "standby_ineligible"),
    ("does not declare model", "standby_missing_model"),
    ("not admitted", "standby_not_admitted"),
    ("is lost", "standby_model_lost"),
    ("is detached", "standby_gpu_detached"),
    ("retrying after", "backing_off"),
    ("'s model", "standby_model_not_ready"),
)

_STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_OP_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800)


def decline_reason(why: str) -> str:
    """The label for a failover_declined `why` (the part after the failure, which says why not)."""
    _, _, tail = why.rpartition("; ")
    for words, label in DECLINE_REASONS:
        if words in (tail or why):
            return label
    return "other"


def op_duration_s(op: OperationView) -> float | None:
    ms = ms_between(op.requested_at, op.finished_at)
    return ms / 1000 if ms is not None else None


class PromoterMetrics:
    """The promoter's registry. `record` is called per folded record; `collect` reads the views."""

    def __init__(self, promoter=None, registry: CollectorRegistry | None = None) -> None:
        self.promoter = promoter
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.operations = Counter(
            "haru_promoter_operations",
            "Finished promotions and demotions.",
            ["fleet", "kind", "reason", "outcome"],
            registry=r,
        )
        self.failovers = Counter(
            "haru_promoter_failovers",
            "Completed promotions that were failovers (not manual, not the first route).",
            ["fleet", "reason"],
            registry=r,
        )
        self.step_duration = Histogram(
            "haru_promoter_step_duration_seconds",
            "Each step from its step_started to its completion or failure (event times).",
            ["fleet", "step", "outcome"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.op_duration = Histogram(
            "haru_promoter_operation_duration_seconds",
            "Operations from their request to completed/aborted (event times).",
            ["fleet", "kind", "outcome"],
            buckets=_OP_BUCKETS,
            registry=r,
        )
        self.failover_duration = Histogram(
            "haru_promoter_failover_duration_seconds",
            "Failovers from the promotion's request to its completion.",
            ["fleet", "reason"],
            buckets=_OP_BUCKETS,
            registry=r,
        )
        self.declined = Counter(
            "haru_promoter_declined", "Failovers declined, by the class of reason.", ["fleet", "reason"], registry=r
        )
        self.canary_rollbacks = Counter(
            "haru_promoter_canary_rollbacks",
            "Canaries rolled back (weights_set canary_rolled_back), by why.",
            ["fleet", "domain", "why"],
            registry=self.registry,
        )
        self._step_started: dict[tuple[str, str, int], datetime] = {}
        self._last_op: dict[tuple[str, str], tuple[str, float]] = {}  # (fleet, kind) -> (outcome, seconds)
        r.register(_ViewCollector(self))

    def record(self, fleet: str, rec: Record, view: FleetView) -> None:
        """One folded record; `view` is the fleet's view after folding it."""
        ev = rec.event
        if isinstance(ev, StepStarted):
            self._step_started[(ev.op_id, ev.step, ev.attempt)] = ev.at
        elif isinstance(ev, (StepCompleted, StepFailed)):
            started = self._pop_started(ev.op_id, ev.step)
            seconds = (ev.at - started).total_seconds() if started is not None else ev.took_ms / 1000
            self.step_duration.labels(
                fleet, ev.step, "completed" if isinstance(ev, StepCompleted) else "failed"
            ).observe(max(0.0, seconds))
        elif isinstance(ev, (OperationCompleted, OperationAborted)):
            op = view.last_operation
            if op is None or op.op_id != ev.op_id:
                return
            outcome = "completed" if isinstance(ev, OperationCompleted) else "aborted"
            self.operations.labels(fleet, op.kind, op.reason, outcome).inc()
            op_seconds = op_duration_s(op)
            if op_seconds is not None:
                self.op_duration.labels(fleet, op.kind, outcome).observe(op_seconds)
                self._last_op[(fleet, op.kind)] = (outcome, op_seconds)
            if op.kind == "promotion" and outcome == "completed" and op.reason not in NOT_FAILOVER_REASONS:
                self.failovers.labels(fleet, op.reason).inc()
                if op_seconds is not None:
                    self.failover_duration.labels(fleet, op.reason).observe(op_seconds)
            for key in [k for k in self._step_started if k[0] == ev.op_id]:
                del self._step_started[key]
        elif isinstance(ev, FailoverDeclined):
            self.declined.labels(fleet, decline_reason(ev.why)).inc()
        elif isinstance(ev, WeightsSet) and ev.reason == "canary_rolled_back":
            self.canary_rollbacks.labels(
                fleet, ev.domain, "probe" if ev.detail.find("probe failed") >= 0 else "error_rate"
            ).inc()

    def _pop_started(self, op_id: str, step: str) -> datetime | None:
        attempts = [k for k in self._step_started if k[0] == op_id and k[1] == step]
        if not attempts:
            return None
        return self._step_started.pop(max(attempts, key=lambda k: k[2]))


class _ViewCollector:
    """Gauges computed from the promoter's folded views when Prometheus scrapes."""

    def __init__(self, metrics: PromoterMetrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []  # dynamic: no fixed families to check for clashes

    def collect(self):
        from haru.promoter.health import active_health

        promoter = self.metrics.promoter
        last = GaugeMetricFamily(
            "haru_promoter_last_operation_duration_seconds",
            "The last finished operation of each kind: request to completed/aborted.",
            labels=["fleet", "kind", "outcome"],
        )
        for (fleet, kind), (outcome, seconds) in sorted(self.metrics._last_op.items()):
            last.add_metric([fleet, kind, outcome], seconds)
        yield last
        if promoter is None:
            return
        now = datetime.now(UTC)
        in_flight = GaugeMetricFamily(
            "haru_promoter_operation_in_flight", "1 while an operation runs.", labels=["fleet", "kind", "target"]
        )
        running = GaugeMetricFamily(
            "haru_promoter_operation_running_seconds",
            "How long the operation in flight has been running (0: none).",
            labels=["fleet"],
        )
        health = GaugeMetricFamily(
            "haru_promoter_active_health", "1 for the active domain's health.", labels=["fleet", "domain", "health"]
        )
        eligible = GaugeMetricFamily(
            "haru_promoter_standby_eligible",
            "1 when the standby could take over now, 0 when it could not.",
            labels=["fleet", "domain"],
        )
        ranks = GaugeMetricFamily(
            "haru_promoter_standby_rank",
            "The standby's place in the failover ranking (1 = promoted first).",
            labels=["fleet", "domain"],
        )
        fit = GaugeMetricFamily("haru_promoter_fit_standbys", "Standbys that could take over now.", labels=["fleet"])
        unprotected = GaugeMetricFamily(
            "haru_promoter_fleet_unprotected",
            "1 when the fleet has no standby that could take over (unprotected).",
            labels=["fleet"],
        )
        revision = GaugeMetricFamily("haru_promoter_route_revision", "The route revision folded.", labels=["fleet"])
        reachable = GaugeMetricFamily(
            "haru_promoter_domain_reachable",
            "1 reachable, 0 unreachable (absent: no verdict yet).",
            labels=["fleet", "domain"],
        )
        for fleet, st in sorted(promoter.fleets.items()):
            view: FleetView = st.view
            op = view.operation
            if op is not None:
                in_flight.add_metric([fleet, op.kind, op.target], 1)
                since = op.requested_at or now
                running.add_metric([fleet], max(0.0, (now - since).total_seconds()))
            else:
                running.add_metric([fleet], 0)
            revision.add_metric([fleet], view.route_revision)
            for name, dv in view.domains.items():
                if dv.reachable is not None:
                    reachable.add_metric([fleet, name], 1 if dv.reachable else 0)
            if view.active:
                h = active_health(view, now)
                for state in ("ok", "degraded", "failed"):
                    health.add_metric([fleet, view.active, state], 1 if h.health == state else 0)
                ranked = ranking.rank(view)
                for r in ranked:
                    eligible.add_metric([fleet, r.domain], 1 if r.fit else 0)
                    ranks.add_metric([fleet, r.domain], r.rank)
                state = ranking.protection(view, ranked)
                if state:
                    fit.add_metric([fleet], ranking.fit_standbys(ranked))
                    unprotected.add_metric([fleet], 1 if state == "unprotected" else 0)
        yield from (in_flight, running, health, eligible, ranks, fit, unprotected, revision, reachable)
        folded = GaugeMetricFamily("haru_promoter_events_folded", "The last HARU_EVENTS sequence folded.")
        folded.add_metric([], promoter.folded)
        yield folded
        quorum = getattr(promoter, "quorum", None)
        if quorum is not None:  # haru/promoter/quorum.py: 1 for the state this promoter is in
            gauge = GaugeMetricFamily(
                "haru_promoter_quorum",
                "Whether this promoter's appends reach a majority (minority: it cannot act until they do).",
                labels=["state"],
            )
            for state in ("majority", "minority"):
                gauge.add_metric([state], 1 if quorum.state == state else 0)
            yield gauge
