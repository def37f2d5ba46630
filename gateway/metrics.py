"""Prometheus metrics of one gateway, in a registry of its own (several gateways can share a process).

    haru_gateway_requests_total{fleet, model, status}        every proxied or refused request
    haru_gateway_upstream_latency_seconds{fleet, domain}     request sent -> response body finished
    haru_gateway_upstream_ttfb_seconds{fleet, domain}        request sent -> upstream response headers
    haru_gateway_inflight_streams{fleet}                     responses being streamed right now
    haru_gateway_route_revision{fleet}                       the route revision the gateway routes by
    haru_gateway_route_updates_total{fleet, kind}            views and intents applied

`fleet` and `model` are labels only for fleets and models that exist; anything else a client sends
counts as "(unknown)", so clients cannot grow the label set.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

UNKNOWN_MODEL = "(unknown)"
UNKNOWN_FLEET = "(unknown)"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "haru_gateway_requests",
            "Requests on the inference paths, by fleet, model and HTTP status.",
            ["fleet", "model", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "haru_gateway_upstream_latency_seconds",
            "Upstream request time, from sending the request to the end of the response body.",
            ["fleet", "domain"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttfb = Histogram(
            "haru_gateway_upstream_ttfb_seconds",
            "Upstream time to first byte: from sending the request to its response headers.",
            ["fleet", "domain"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inflight = Gauge(
            "haru_gateway_inflight_streams",
            "Responses being streamed to clients right now.",
            ["fleet"],
            registry=self.registry,
        )
        self.revision = Gauge(
            "haru_gateway_route_revision",
            "The route revision (sequence of the last route_moved) the gateway routes by.",
            ["fleet"],
            registry=self.registry,
        )
        self.updates = Counter(
            "haru_gateway_route_updates",
            "Fleet views and route intents applied to the routing table.",
            ["fleet", "kind"],
            registry=self.registry,
        )
        # label children cached: .labels() costs a lock and a tuple per call on the hot path
        self._requests: dict[tuple[str, str, int], Counter] = {}
        self._upstream: dict[tuple[str, str], tuple[Histogram, Histogram]] = {}
        self._inflight: dict[str, Gauge] = {}

    def request(self, fleet: str, model: str, status: int) -> None:
        key = (fleet, model, status)
        child = self._requests.get(key)
        if child is None:
            child = self._requests[key] = self.requests.labels(fleet, model, str(status))
        child.inc()

    def upstream(self, fleet: str, domain: str) -> tuple[Histogram, Histogram]:
        """(ttfb, latency) histogram children for one upstream."""
        key = (fleet, domain)
        pair = self._upstream.get(key)
        if pair is None:
            pair = self._upstream[key] = (self.ttfb.labels(fleet, domain), self.latency.labels(fleet, domain))
        return pair

    def streams(self, fleet: str) -> Gauge:
        child = self._inflight.get(fleet)
        if child is None:
            child = self._inflight[fleet] = self.inflight.labels(fleet)
        return child

    def route(self, fleet: str, revision: int, kind: str) -> None:
        self.revision.labels(fleet).set(revision)
        self.updates.labels(fleet, kind).inc()

    def forget(self, fleet: str) -> None:
        try:
            self.revision.remove(fleet)
        except KeyError:
            pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
