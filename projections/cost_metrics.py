"""The accounting as Prometheus gauges on the projector's /metrics (docs/metrics.md, docs/cost.md).

Every fleet the projector folds is costed over the last `window_s` seconds (HARU_COST_WINDOW_S, a day by
default) with `haru.core.cost.account`, from the fleet's history read back from the log. That read grows
with the fleet's history, so it runs in the background at most every `refresh_s` (HARU_COST_REFRESH_S) and
a scrape never waits for it: it shows the last figures computed (none before the first).

Labels are the ones OpenCost-style dashboards join on: fleet, domain, region, provider, gpu_type (and
class, currency, source where they apply).

    haru_cost_hourly_price{fleet,domain,region,provider,gpu_type,currency,source}   the price in force now
    haru_cost_seconds{fleet,domain,region,provider,gpu_type,class}                  seconds of each class
    haru_cost_unpriced_seconds{fleet,domain,region,provider,gpu_type,class}         of those, with no price
    haru_cost{fleet,domain,region,provider,gpu_type,class,currency}                 what each class cost
    haru_cost_training_seconds{fleet,domain,region,provider,gpu_type}               training slot-seconds
    haru_cost_fleet{fleet,currency,figure}          cost | serving | ha_premium | harvested | net |
                                                    two_hot_replicas | difference
    haru_cost_per_million_tokens{fleet,currency,basis}   with_ha | without_ha | net_of_training
    haru_cost_tokens{fleet}                         tokens served in the window (tokens_counted)
    haru_cost_window_seconds                        the window every figure covers
    haru_cost_computed_timestamp_seconds{fleet}     when the figures were computed
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from haru.core import subjects
from haru.core.cost import CLASSES, Accounting, account

log = structlog.get_logger("haru.projector")

__all__ = ["CostCollector", "register_cost"]

_DOMAIN_LABELS = ["fleet", "domain", "region", "provider", "gpu_type"]


class CostCollector:
    """Gauges of each fleet's accounting over the last `window_s`; `refresh()` recomputes in the background."""

    def __init__(
        self,
        events,
        fleets: Callable[[], Iterable[str]],
        *,
        window_s: float = 86_400,
        refresh_s: float = 60,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.events = events
        self.fleets = fleets
        self.window_s = window_s
        self.refresh_s = refresh_s
        self.clock = clock
        self.accounts: dict[str, tuple[float, Accounting]] = {}
        self._last = -float("inf")
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        """Start a recomputation when the figures are older than `refresh_s`, or a fleet has none yet (one the
        projector folded since: a scrape that came before its first fold would otherwise leave it uncosted for
        `refresh_s`), and none is running."""
        now = self.clock()
        if self._task is not None and not self._task.done():
            return
        if now - self._last < self.refresh_s and set(self.fleets()) <= set(self.accounts):
            return
        self._last = now
        self._task = asyncio.create_task(self.compute(now), name="projector-cost")

    async def wait(self) -> None:
        """Wait for a recomputation under way (tests; shutdown)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def compute(self, now: float) -> None:
        until = datetime.fromtimestamp(now, UTC)
        since = until - timedelta(seconds=self.window_s)
        for fleet in sorted(set(self.fleets())):
            try:
                records = await self.events.history(subjects.fleet_events(fleet))
            except Exception as exc:  # the log is away: keep the last figures
                log.warning("projector.cost_not_computed", fleet=fleet, error=str(exc))
                continue
            self.accounts[fleet] = (now, account(records, fleet, since=since, until=until))

    def collect(self):
        price = GaugeMetricFamily(
            "haru_cost_hourly_price",
            "A domain's price an hour now, as the layout or SkyPilot's cost report says it.",
            labels=[*_DOMAIN_LABELS, "currency", "source"],
        )
        seconds = GaugeMetricFamily(
            "haru_cost_seconds", "Seconds of each class in the window.", labels=[*_DOMAIN_LABELS, "class"]
        )
        unpriced = GaugeMetricFamily(
            "haru_cost_unpriced_seconds",
            "Seconds of each class in the window with no price in force (left out of the money).",
            labels=[*_DOMAIN_LABELS, "class"],
        )
        money = GaugeMetricFamily(
            "haru_cost", "What each class cost in the window.", labels=[*_DOMAIN_LABELS, "class", "currency"]
        )
        training = GaugeMetricFamily(
            "haru_cost_training_seconds", "Training slot-seconds in the window.", labels=_DOMAIN_LABELS
        )
        fleet_fig = GaugeMetricFamily(
            "haru_cost_fleet", "The fleet's sums over the window.", labels=["fleet", "currency", "figure"]
        )
        per_m = GaugeMetricFamily(
            "haru_cost_per_million_tokens",
            "Cost per million tokens served in the window.",
            labels=["fleet", "currency", "basis"],
        )
        tokens = GaugeMetricFamily("haru_cost_tokens", "Tokens served in the window.", labels=["fleet"])
        computed = GaugeMetricFamily(
            "haru_cost_computed_timestamp_seconds", "When the figures were computed.", labels=["fleet"]
        )
        for fleet, (at, acct) in sorted(self.accounts.items()):
            cur = acct.currency
            for name, d in acct.domains.items():
                labels = [fleet, name, d.region, d.provider, d.gpu_type]
                if d.prices and d.prices[-1][1] is not None:
                    p = d.prices[-1][1]
                    price.add_metric([*labels, p.currency, p.source], float(p.hourly))
                for cls in CLASSES:
                    seconds.add_metric([*labels, cls], d.us[cls] / 1e6)
                    unpriced.add_metric([*labels, cls], d.unpriced_us[cls] / 1e6)
                    if cur:
                        money.add_metric([*labels, cls, cur], float(d.cost[cls]))
                training.add_metric(labels, d.training_us / 1e6)
            if cur:
                for figure, value in (
                    ("cost", acct.cost),
                    ("serving", acct.serving_cost),
                    ("ha_premium", acct.ha_premium),
                    ("harvested", acct.harvested),
                    ("net", acct.net_cost),
                    ("two_hot_replicas", acct.two_hot_replicas),
                    ("difference", acct.difference),
                ):
                    fleet_fig.add_metric([fleet, cur, figure], float(value))
                for basis, value in (
                    ("with_ha", acct.cost),
                    ("without_ha", acct.serving_cost),
                    ("net_of_training", acct.net_cost),
                ):
                    got = acct.per_million(value)
                    if got is not None:
                        per_m.add_metric([fleet, cur, basis], float(got))
            tokens.add_metric([fleet], acct.total_tokens)
            computed.add_metric([fleet], at)
        window = GaugeMetricFamily("haru_cost_window_seconds", "The window every haru_cost_* figure covers.")
        window.add_metric([], self.window_s)
        yield from (price, seconds, unpriced, money, training, fleet_fig, per_m, tokens, computed, window)


def register_cost(registry: CollectorRegistry, projector, environ=os.environ) -> CostCollector:
    """A `CostCollector` over the projector's fleets, its window and refresh from the environment."""
    collector = CostCollector(
        projector.log,
        lambda: projector.stats.fleets,
        window_s=float(environ.get("HARU_COST_WINDOW_S", "86400")),
        refresh_s=float(environ.get("HARU_COST_REFRESH_S", "60")),
    )
    registry.register(collector)
    return collector
