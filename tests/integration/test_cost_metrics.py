"""The haru_cost_* gauges (projections/cost_metrics.py) over the scripted day read back from a real
nats-server, with the clock at the day's end: the same figures as worked out by hand, labelled for joins."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from haru.projections.cost_metrics import CostCollector
from tests.support import cost_day as day


def samples(registry: CollectorRegistry) -> dict[str, list[tuple[dict, float]]]:
    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


@pytest.mark.timeout(60)
async def test_the_cost_gauges_carry_the_day_s_figures_with_joinable_labels(event_log):
    await day.append_script(event_log)
    registry = CollectorRegistry()
    cost = CostCollector(event_log, lambda: [day.FLEET], window_s=86_400, clock=lambda: day.UNTIL.timestamp())
    registry.register(cost)
    assert "haru_cost_seconds" not in samples(registry)  # nothing computed yet: nothing claimed
    await cost.refresh()
    await cost.wait()
    m = samples(registry)
    want = day.expected()
    b = {"fleet": "day", "domain": "b", "region": "us-east-1", "provider": "skypilot", "gpu_type": "A100-80GB"}
    assert ({**b, "class": "unreachable"}, 3600.0) in m["haru_cost_seconds"]
    assert ({**b, "class": "standby_training"}, float(want["seconds"]["b"]["standby_training"])) in m[
        "haru_cost_seconds"
    ]
    assert ({**b, "currency": "USD", "source": "layout"}, 3.0) in m["haru_cost_hourly_price"]
    fleet = {s[0]["figure"]: s[1] for s in m["haru_cost_fleet"]}
    for figure, key in (("cost", "cost"), ("ha_premium", "ha_premium"), ("harvested", "harvested")):
        assert abs(fleet[figure] - float(want[key])) <= 0.005, figure  # a gauge is a float: to the cent
    per_m = {s[0]["basis"]: s[1] for s in m["haru_cost_per_million_tokens"]}
    assert abs(per_m["with_ha"] - float(want["per_million_tokens"]["with_ha"])) <= 0.005
    assert m["haru_cost_tokens"] == [({"fleet": "day"}, float(day.TOKENS))]
    await cost.refresh()  # within refresh_s: no second computation
    assert cost._task is not None and cost._task.done()


@pytest.mark.timeout(60)
async def test_a_fleet_folded_after_the_first_scrape_is_costed_at_the_next_one_not_a_refresh_later(event_log):
    """A scrape that came before the projector folded any fleet computed nothing; the fleet it folds next is
    costed at the following scrape, not `refresh_s` later (a service-metrics test waited 30 s for it)."""
    await day.append_script(event_log)
    fleets: list[str] = []
    registry = CollectorRegistry()
    cost = CostCollector(event_log, lambda: fleets, window_s=86_400, clock=lambda: day.UNTIL.timestamp())
    registry.register(cost)
    await cost.refresh()
    await cost.wait()
    assert "haru_cost_seconds" not in samples(registry)
    fleets.append(day.FLEET)  # folded now
    await cost.refresh()  # the same instant: within refresh_s, but this fleet has no figures yet
    await cost.wait()
    assert {s[0]["domain"] for s in samples(registry)["haru_cost_seconds"]} == {"a", "b"}
    first = cost._task
    await cost.refresh()  # every fleet costed, within refresh_s: nothing recomputed
    assert cost._task is first
