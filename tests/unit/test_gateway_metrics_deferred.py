"""The gateway's hot-path metrics are counted in plain ints and added at collection (issue 20): a
scrape must read exactly what prometheus_client's own observe/inc would have produced."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from haru.gateway.metrics import _LATENCY_BUCKETS, GatewayMetrics

VALUES = [0.0, 0.0004, 0.001, 0.0010001, 0.0025, 0.07, 1, 2.5, 299.9, 300, 301, 1e9]


def _samples(registry: CollectorRegistry, name: str) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for m in registry.collect()
        for s in m.samples
        if s.name.startswith(name) and not s.name.endswith("_created")
    }


def test_deferred_histograms_and_counts_read_as_direct_ones():
    metrics = GatewayMetrics()
    ttfb, latency = metrics.upstream("default", "a")
    reference = CollectorRegistry()
    ref_ttfb = Histogram(
        "haru_gateway_upstream_ttfb_seconds", "x", ["fleet", "domain"], buckets=_LATENCY_BUCKETS, registry=reference
    )
    ref_requests = Counter("haru_gateway_requests", "x", ["fleet", "model", "status"], registry=reference)
    for _rounds in range(2):  # collected in between: nothing is counted twice, nothing lost
        for v in VALUES:
            ttfb.observe(v)
            ref_ttfb.labels("default", "a").observe(v)
            metrics.request("default", "m", 200)
            ref_requests.labels("default", "m", "200").inc()
        metrics.request("(unknown)", "(unknown)", 404)
        ref_requests.labels("(unknown)", "(unknown)", "404").inc()
        got = _samples(metrics.registry, "haru_gateway_upstream_ttfb")
        assert got == _samples(reference, "haru_gateway_upstream_ttfb") and got
        got = _samples(metrics.registry, "haru_gateway_requests")
        assert got == _samples(reference, "haru_gateway_requests") and got
    assert (
        latency.n == 0
        and b'haru_gateway_upstream_latency_seconds_count{domain="a",fleet="default"} 0.0' in metrics.render()
    )
