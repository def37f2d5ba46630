"""The projector's Prometheus metrics, read from its `Stats` at scrape time (the fold pays nothing).

haru_projector_events_folded_total             records folded into a fleet's view
haru_projector_events_skipped_total            records at or below their fleet's view, or off-fleet
haru_projector_events_invalid_total            bodies that were not valid events
haru_projector_fold_failures_total             records the fold raised on (a bug), skipped
haru_projector_view_writes_total               views written to KV haru_views
haru_projector_view_conflicts_total            view writes that lost a compare-and-swap
haru_projector_views_adopted_total             newer views written by another projector, adopted
haru_projector_intents_published_total         route intents published on haru.route.<fleet>
haru_projector_intent_conflicts_total          intent publishes that lost the expected-sequence check
haru_projector_replay_restarts_total           replays started again (stalled, reconnected, interrupted)
haru_projector_log_rewinds_total               the log found behind what was folded (it lost events):
                                               every fleet folded again from sequence 1
haru_projector_last_seq                        the last HARU_EVENTS sequence handled
haru_projector_stream_last_seq                 the stream's last sequence, read at scrape time
haru_projector_lag_events                      stream_last_seq - last_seq
haru_projector_lag_seconds                     0 when caught up; otherwise how long ago the last
                                               handled event was recorded (an upper bound on the
                                               age of the oldest event not yet folded)
haru_projector_fleets                          fleets this projector folds
haru_cost_*                                    each fleet's accounting over a window (cost_metrics.py)
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from haru.projections.cost_metrics import CostCollector, register_cost

_COUNTERS = (
    # (metric name without _total, Stats field, help)
    ("haru_projector_events_folded", "handled", "Records folded into a fleet's view."),
    (
        "haru_projector_events_skipped",
        "skipped",
        "Records at or below their fleet's stored view, or not on a fleet subject.",
    ),
    (
        "haru_projector_events_invalid",
        "invalid",
        "Bodies that were not valid events (counted in the view's anomalies).",
    ),
    ("haru_projector_fold_failures", "failures", "Records the fold raised on (a bug): logged and skipped."),
    ("haru_projector_view_writes", "view_writes", "Fleet views written to KV haru_views."),
    (
        "haru_projector_view_conflicts",
        "view_conflicts",
        "View writes that lost the compare-and-swap to another writer.",
    ),
    ("haru_projector_views_adopted", "views_adopted", "Newer views written by another projector, adopted."),
    ("haru_projector_intents_published", "intents_published", "Route intents published on haru.route.<fleet>."),
    ("haru_projector_intent_conflicts", "intent_conflicts", "Intent publishes that lost the expected-sequence check."),
    (
        "haru_projector_replay_restarts",
        "replay_restarts",
        "Replays started again (stalled, after a NATS reconnect, or interrupted).",
    ),
    (
        "haru_projector_log_rewinds",
        "log_rewinds",
        "The event log found behind what was folded (it lost events): every fleet folded again from sequence 1.",
    ),
)


class ProjectorCollector:
    """A prometheus-client collector over one `Projector`. `refresh()` reads the stream's last sequence."""

    def __init__(self, projector) -> None:
        self.projector = projector
        self.stream_last_seq = 0
        self.cost: CostCollector | None = None  # the haru_cost_* gauges (projections/cost_metrics.py)

    async def refresh(self) -> None:
        self.stream_last_seq = await self.projector.log.last_seq()
        if self.cost is not None:
            await self.cost.refresh()  # starts a recomputation in the background when due

    def collect(self):
        stats = self.projector.stats
        for name, field, doc in _COUNTERS:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], getattr(stats, field))
            yield c
        last = stats.last_seq
        stream_last = max(self.stream_last_seq, last)
        lag = stream_last - last
        yield _gauge("haru_projector_last_seq", "The last HARU_EVENTS sequence handled.", last)
        yield _gauge("haru_projector_stream_last_seq", "HARU_EVENTS' last sequence, read at scrape time.", stream_last)
        yield _gauge("haru_projector_lag_events", "Events in the stream not yet handled.", lag)
        lag_s = 0.0
        if lag > 0:
            at_ns = stats.last_time_ns or int(self.projector.started_wall * 1e9)
            lag_s = max(0.0, time.time() - at_ns / 1e9) if at_ns else 0.0
        yield _gauge(
            "haru_projector_lag_seconds",
            "0 when caught up; otherwise how long ago the last handled event was recorded.",
            lag_s,
        )
        yield _gauge("haru_projector_fleets", "Fleets this projector folds.", len(stats.fleets))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g


def register(registry: CollectorRegistry, projector) -> ProjectorCollector:
    collector = ProjectorCollector(projector)
    registry.register(collector)
    collector.cost = register_cost(registry, projector)
    return collector
