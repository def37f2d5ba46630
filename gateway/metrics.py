"""Prometheus metrics of one gateway, in a registry of its own (several gateways can share a process).

    haru_gateway_requests_total{fleet, model, status}        every proxied or refused request
    haru_gateway_upstream_latency_seconds{fleet, domain}     request sent -> response body finished
    haru_gateway_upstream_ttfb_seconds{fleet, domain}        request sent -> upstream response headers
    haru_gateway_inflight_streams{fleet}                     responses being streamed right now
    haru_gateway_route_revision{fleet}                       the route revision the gateway routes by
    haru_gateway_route_updates_total{fleet, kind}            views and intents applied
    haru_gateway_held_total{fleet, outcome}                  requests held through a failover (gateway/hold.py):
                                                             released | expired | aborted | dropped | full
    haru_gateway_held_seconds{fleet}                         how long they were held
    haru_gateway_retried_total{fleet, why}                   requests sent a second time, none of whose
                                                             response had reached the client: unreachable |
                                                             runtime_gone | asleep
    haru_gateway_stream_resumes_total{fleet, outcome}        streams cut mid-generation: continued | error_event
    haru_gateway_tokens_total{fleet, model, kind}            tokens the responses' `usage` reported: prompt |
                                                             completion (a continued stream's: the whole request's)

`fleet` and `model` are labels only for fleets and models that exist; anything else a client sends
counts as "(unknown)", so clients cannot grow the label set.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from haru.gateway.usage import Usage
    from haru.gateway.usage_log import Ledger

UNKNOWN_MODEL = "(unknown)"
UNKNOWN_FLEET = "(unknown)"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _Deferred:
    """A histogram child whose observations are counted into buckets here and added to the
    prometheus child when the registry is collected: a C bisect and two additions a request instead of
    prometheus_client's locked per-bucket loop (issue 20). What a scrape sees is the same."""

    __slots__ = ("child", "bounds", "counts", "sum", "n")

    def __init__(self, child: Histogram) -> None:
        self.child = child
        self.bounds = list(child._upper_bounds)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.n += 1

    def flush(self) -> None:
        if not self.n:
            return
        child = self.child
        child._sum.inc(self.sum)
        buckets = child._buckets
        counts = self.counts
        for i, n in enumerate(counts):
            if n:
                buckets[i].inc(n)
                counts[i] = 0
        self.sum = 0.0
        self.n = 0


def _deferrable(child: Histogram) -> bool:
    return all(hasattr(child, a) for a in ("_upper_bounds", "_buckets", "_sum"))


class _Flush:
    """Registered first: collecting the registry first adds what the hot path counted."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        self.metrics.flush()
        return []


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_Flush(self))
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
        self.held_requests = Counter(
            "haru_gateway_held",
            "Requests held through a failover, by how the hold ended.",
            ["fleet", "outcome"],
            registry=self.registry,
        )
        self.held_seconds = Histogram(
            "haru_gateway_held_seconds",
            "How long requests were held through a failover.",
            ["fleet"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.retried_requests = Counter(
            "haru_gateway_retried",
            "Requests sent a second time because the first domain died before any response byte reached the client.",
            ["fleet", "why"],
            registry=self.registry,
        )
        self.stream_resumes = Counter(
            "haru_gateway_stream_resumes",
            "Streamed completions cut mid-generation: continued on a live domain, or ended with an SSE error event.",
            ["fleet", "outcome"],
            registry=self.registry,
        )
        self.token_counts = Counter(
            "haru_gateway_tokens",
            "Tokens served, as the responses' usage reported them (a continued stream's: the whole request's).",
            ["fleet", "model", "kind"],
            registry=self.registry,
        )
        # Label children resolved once, and the request counts and histogram observations of the hot
        # path kept in plain ints here until the registry is collected (`flush`): prometheus_client
        # takes a lock per increment and loops over the buckets in Python (issue 20).
        self._counts: dict[tuple[str, str, int], int] = {}
        self._tokens: dict[tuple[str, str], list[int]] = {}
        self.ledger: Ledger | None = None  # the tokens to record in the log, when the gateway has one
        self._upstream: dict[tuple[str, str], tuple] = {}
        self._deferred: list[_Deferred] = []
        self._inflight: dict[str, Gauge] = {}

    def request(self, fleet: str, model: str, status: int) -> None:
        key = (fleet, model, status)
        counts = self._counts
        counts[key] = counts.get(key, 0) + 1

    def tokens(self, fleet: str, model: str, usage: Usage | None) -> None:
        """Count a response's `usage` (None: it had none)."""
        if usage is None:
            return
        if self.ledger is not None:  # recorded in the log too (gateway.usage_log)
            self.ledger.count(fleet, model, usage.prompt_tokens, usage.completion_tokens)
        pair = self._tokens.get((fleet, model))
        if pair is None:
            pair = self._tokens[(fleet, model)] = [0, 0]
        pair[0] += usage.prompt_tokens
        pair[1] += usage.completion_tokens

    def upstream(self, fleet: str, domain: str) -> tuple:
        """(ttfb, latency) for one upstream: objects with `observe(seconds)`."""
        key = (fleet, domain)
        pair = self._upstream.get(key)
        if pair is None:
            ttfb, latency = self.ttfb.labels(fleet, domain), self.latency.labels(fleet, domain)
            if _deferrable(ttfb) and _deferrable(latency):
                pair = (_Deferred(ttfb), _Deferred(latency))
                self._deferred.extend(pair)
            else:  # a prometheus_client without the internals: observe directly
                pair = (ttfb, latency)
            self._upstream[key] = pair
        return pair

    def flush(self) -> None:
        """Add what the hot path counted to the prometheus metrics (collecting the registry does it)."""
        counts, self._counts = self._counts, {}
        for (fleet, model, status), n in counts.items():
            self.requests.labels(fleet, model, str(status)).inc(n)
        tokens, self._tokens = self._tokens, {}
        for (fleet, model), (prompt, completion) in tokens.items():
            if prompt:
                self.token_counts.labels(fleet, model, "prompt").inc(prompt)
            if completion:
                self.token_counts.labels(fleet, model, "completion").inc(completion)
        for d in self._deferred:
            d.flush()

    def streams(self, fleet: str) -> Gauge:
        child = self._inflight.get(fleet)
        if child is None:
            child = self._inflight[fleet] = self.inflight.labels(fleet)
        return child

    def route(self, fleet: str, revision: int, kind: str) -> None:
        self.revision.labels(fleet).set(revision)
        self.updates.labels(fleet, kind).inc()

    def held(self, fleet: str, outcome: str, seconds: float) -> None:
        self.held_requests.labels(fleet, outcome).inc()
        if outcome != "full":
            self.held_seconds.labels(fleet).observe(seconds)

    def retried(self, fleet: str, why: str) -> None:
        self.retried_requests.labels(fleet, why).inc()

    def resumed(self, fleet: str, outcome: str) -> None:
        self.stream_resumes.labels(fleet, outcome).inc()

    def forget(self, fleet: str) -> None:
        try:
            self.revision.remove(fleet)
        except KeyError:
            pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
