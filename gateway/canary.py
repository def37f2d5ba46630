"""What this gateway measured of the domains that carry a share of traffic, reported on the bus.

Every forward is counted per (fleet, domain, model): a request, and an error when the upstream
answered 5xx, was unreachable, or sent no headers in time (`CanaryCounts.count`, a dict increment on
the request path). While a fleet's route intent has a split (haru.core.weights), the `Reporter`
publishes, once per `interval_s`, what was counted since its last report as a `CanaryReport` on
haru.canary.<fleet>.<gateway> (core NATS: not history; the promoter sums the reports of a window and
rolls a failing canary back, recording the figures as its evidence). The gateway is named by the
subject, which its NATS user may publish on (deploy/nats/gen_users.py); counts of fleets without a
split are dropped each interval.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime

import structlog

from haru.core import subjects
from haru.core.weights import CanaryReport, Count, report_encoder
from haru.gateway.routing import RoutingTable
from haru.host.tasks import cancel_and_wait

log = structlog.get_logger("haru.gateway")

__all__ = ["CanaryCounts", "Reporter"]


class CanaryCounts:
    """Requests and errors per (fleet, domain, model) since the last `take`."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str, str], list] = {}

    def count(self, fleet: str, domain: str, model: str, error: str = "") -> None:
        c = self._counts.get((fleet, domain, model))
        if c is None:
            c = self._counts[(fleet, domain, model)] = [0, 0, ""]
        c[0] += 1
        if error:
            c[1] += 1
            c[2] = error

    def take(self) -> dict[str, list[Count]]:
        """Everything counted since the last take, per fleet; the counts start again from zero."""
        counts, self._counts = self._counts, {}
        out: dict[str, list[Count]] = {}
        for (fleet, domain, model), (requests, errors, last) in counts.items():
            out.setdefault(fleet, []).append(
                Count(domain=domain, model=model, requests=requests, errors=errors, last_error=last)
            )
        return out


class Reporter:
    """Publishes each split fleet's counts every `interval_s`. An async context manager."""

    def __init__(
        self, bus, table: RoutingTable, counts: CanaryCounts, gateway: str, *, interval_s: float = 1.0
    ) -> None:
        self.bus = bus
        self.table = table
        self.counts = counts
        self.gateway = gateway
        self.interval_s = interval_s
        self.sent = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Reporter:
        self._task = asyncio.create_task(self._run(), name="gateway-canary-reports")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    def split_fleets(self) -> set[str]:
        out: set[str] = set()
        for fleet in self.table.fleets():
            routes = self.table.get(fleet)
            ri = routes.intent if routes is not None else None
            if ri is not None and (ri.weights or ri.model_weights):
                out.add(fleet)
            elif routes is not None and routes.view is not None and routes.view.adapters:
                out.add(
                    fleet
                )  # LoRA adapters: a canary, or a promoted version, is judged per version (gateway.adapters)
        return out

    async def report(self, interval_ms: int) -> None:
        """Publish what was counted, for the fleets with a split now."""
        taken = self.counts.take()
        wanted = self.split_fleets()
        now = datetime.now(UTC)
        for fleet, counts in taken.items():
            if fleet not in wanted:
                continue
            body = report_encoder.encode(CanaryReport(fleet=fleet, at=now, interval_ms=interval_ms, counts=counts))
            with contextlib.suppress(Exception):  # the bus away: these counts are lost, the next ones go
                await self.bus.publish(subjects.canary_report(fleet, self.gateway), body)
                self.sent += 1

    async def _run(self) -> None:
        interval_ms = int(self.interval_s * 1000)
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.report(interval_ms)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop the gateway: say it, go on
                log.exception("gateway.canary_report_failed")
