"""The accounting fold (haru.core.cost) over a scripted day, figures checked against the same day worked out by
hand (tests/support/cost_day.py), to the second and the cent; and its honest edges."""

from __future__ import annotations

from datetime import timedelta

import pytest

from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.cost import CLASSES, account
from haru.core.prices import Price
from haru.core.record import Record, datetime_to_ns
from haru.core.specs import DomainSpec, GpuSpec, Policy
from tests.support import cost_day as day


def _day_json() -> dict:
    return account(day.records(), day.FLEET, since=day.SINCE, until=day.UNTIL).to_builtins()


def test_the_scripted_day_agrees_with_the_hand_computed_figures_to_the_second_and_the_cent():
    got = _day_json()
    want = day.expected()
    for d in ("a", "b"):
        for cls in CLASSES:
            assert got["domains"][d]["seconds"][cls] == want["seconds"][d].get(cls, 0), (d, cls)
            assert got["domains"][d]["cost"][cls] == want["cost_by_class"][d].get(cls, "0.00"), (d, cls)
        assert got["domains"][d]["total_cost"] == want["domain_cost"][d]
    for key in ("cost", "serving_cost", "ha_premium", "harvested", "net_cost", "two_hot_replicas", "difference"):
        assert got[key] == want[key], key
    assert got["per_million_tokens"] == want["per_million_tokens"]
    assert got["total_tokens"] == day.TOKENS
    assert got["complete"] is True and got["unpriced_seconds"] == 0
    assert got["currency"] == "USD"


def test_the_day_s_training_and_failovers():
    got = _day_json()
    for d, (seconds, runs, stopped, stopped_seconds) in day.TRAINING.items():
        dom = got["domains"][d]
        assert (
            dom["training_seconds"],
            dom["training_runs"],
            dom["training_stopped_by_failover"],
            dom["training_stopped_by_failover_seconds"],
        ) == (seconds, runs, stopped, stopped_seconds), d
    assert [(f["op_id"], f["source"], f["target"], f["reason"], f["seconds"]) for f in got["failovers"]] == (
        day.FAILOVERS
    )
    assert all(f["outcome"] == "completed" for f in got["failovers"])


def test_the_day_s_prices_say_where_they_came_from():
    got = _day_json()
    a = [(p["from"][11:19], p["per_hour"], p["source"]) for p in got["domains"]["a"]["prices"]]
    assert a == [("00:00:00", "2", "layout"), ("06:00:00", "2.5", "layout")]
    b = [(p["from"][11:19], p["per_hour"], p["source"]) for p in got["domains"]["b"]["prices"]]
    assert b == [("00:00:00", "3", "layout"), ("00:10:00", "2.88", "skypilot:haru-day-b"), ("13:10:00", "3", "layout")]
    assert got["domains"]["b"]["provider"] == "skypilot" and got["domains"]["a"]["gpu_type"] == "2xL4"


def test_a_window_inside_the_day_counts_only_its_seconds():
    """[07:00, 09:00): a active 1 h then lost 1 h; b training to the failover, then active."""
    got = account(day.records(), day.FLEET, since=day.t("07:00:00"), until=day.t("09:00:00")).to_builtins()
    a = got["domains"]["a"]["seconds"]
    assert (a["active"], a["lost"]) == (3600, 3600)
    b = got["domains"]["b"]["seconds"]
    assert b["standby_training"] == 3600 + 12 and b["active"] == 3600 - 20
    assert sum(b.values()) == 7200
    assert got["total_tokens"] == 0 and got["per_million_tokens"]["with_ha"] is None


def _records(*items: tuple[str, ev.Event]) -> list[Record]:
    return [Record(i, s, datetime_to_ns(e.at), ev.encode(e), e) for i, (s, e) in enumerate(items, start=1)]


def test_hours_with_no_price_are_reported_unpriced_not_free():
    decl = sj.decl("f")
    t0 = day.DAY
    recs = _records(
        (decl, ev.FleetDeclared(at=t0, fleet="f", policy=Policy())),
        (decl, ev.DomainDeclared(at=t0, spec=DomainSpec(name="a", gpus=[GpuSpec(index=0, memory_bytes=1)]))),
        (sj.route("f"), ev.RouteMoved(at=t0, active="a")),
        (
            decl,
            ev.PriceDeclared(at=t0 + timedelta(hours=1), domain="a", price=Price(per_hour="4", currency="EUR")),
        ),
        (decl, ev.PriceDeclared(at=t0 + timedelta(hours=2), domain="a", price=None)),
    )
    got = account(recs, "f", since=t0, until=t0 + timedelta(hours=3)).to_builtins()
    a = got["domains"]["a"]
    assert a["seconds"]["active"] == 3 * 3600
    assert a["unpriced_seconds"]["active"] == 2 * 3600
    assert got["cost"] == "4.00" and got["currency"] == "EUR"
    assert got["complete"] is False and got["unpriced_seconds"] == 7200


def test_an_unreachable_hour_is_its_own_class_not_idle():
    got = _day_json()
    assert got["domains"]["b"]["seconds"]["unreachable"] == 3600
    assert got["domains"]["b"]["cost"]["unreachable"] == "2.88"


def test_a_misplaced_event_is_not_applied_and_is_named():
    t0 = day.DAY
    recs = _records(
        (sj.decl("f"), ev.DomainDeclared(at=t0, spec=DomainSpec(name="a", gpus=[GpuSpec(index=0, memory_bytes=1)]))),
        # a price on an agent's subject: only `haru apply` (the decl subject) declares prices
        (sj.agent("f", "a"), ev.PriceDeclared(at=t0, domain="a", price=Price(per_hour="0", currency="USD"))),
    )
    got = account(recs, "f", since=t0, until=t0 + timedelta(hours=1))
    assert got.unpriced_us == 3600 * 10**6
    assert any("price_declared" in p and "not applied" in p for p in got.problems)


@pytest.mark.parametrize(
    ("price", "message"),
    [
        ({"per_hour": -1, "currency": "USD"}, "per_hour -1 is negative"),
        ({"per_hour": "2.4", "currency": "usd"}, "did you mean 'USD'?"),
        ({"per_hour": "2.4", "currency": "DOLLARS"}, "not an ISO 4217 code"),
        ({"per_hour": "lots", "currency": "USD"}, "is not a number"),
        ({"per_hour": 1, "currency": "USD", "tax": 1}, "unknown key 'tax'"),
    ],
)
def test_a_bad_price_is_refused_with_its_path_and_the_fix(price, message):
    from haru.core.errors import LayoutError
    from haru.core.layout import parse_layout

    layout = _layout({"price": price}, {})
    with pytest.raises(LayoutError) as err:
        parse_layout(layout)
    assert message in str(err.value) and "$.domains[0].price" in str(err.value) and "Fix:" in str(err.value)


def _layout(a_extra: dict, b_extra: dict, **top) -> dict:
    def dom(name: str, gpu: str, extra: dict) -> dict:
        return {
            "name": name,
            "gpus": [{"index": 0, "memory": "24GiB", "name": gpu}],
            "slots": [{"name": "chat", "gpu": 0, "models": [{"name": "m1", "vram": "8GiB", "source": "x/y"}]}],
            **extra,
        }

    return {"fleet": "f", "domains": [dom("a", "L4", a_extra), dom("b", "A10", b_extra)], **top}


def test_mixed_currencies_in_one_fleet_are_refused_naming_the_fix():
    from haru.core.errors import LayoutError
    from haru.core.layout import parse_layout

    with pytest.raises(LayoutError) as err:
        parse_layout(
            _layout({"price": {"per_hour": 1, "currency": "USD"}}, {"price": {"per_hour": 1, "currency": "EUR"}})
        )
    assert "2 currencies" in str(err.value) and "one currency" in str(err.value)


def test_gpu_prices_price_a_domain_by_its_gpus_and_a_domain_s_own_price_wins():
    from haru.core.layout import parse_layout

    layout = parse_layout(
        _layout(
            {},
            {"price": {"per_hour": "5.10", "currency": "USD"}},
            gpu_prices={"L4": {"per_hour": 0.8, "currency": "USD"}},
        )
    )
    assert layout.prices["a"] == Price(per_hour="0.8", currency="USD", basis="1 x L4 at 0.8")
    assert layout.prices["b"] == Price(per_hour="5.1", currency="USD")


def test_apply_records_a_price_change_as_a_declaration_and_nothing_when_unchanged():
    from datetime import UTC, datetime

    from haru.core.apply import diff, fold_declarations
    from haru.core.layout import parse_layout
    from haru.core.planner import plan

    now = datetime(2026, 12, 1, tzinfo=UTC)
    first = parse_layout(_layout({"price": {"per_hour": 1, "currency": "USD"}}, {}))
    events = diff(fold_declarations([]), first, plan(first), now)
    assert [(e.domain, e.price) for e in events if isinstance(e, ev.PriceDeclared)] == [
        ("a", Price(per_hour="1", currency="USD"))
    ]
    current = fold_declarations(events)
    assert [e for e in diff(current, first, plan(first), now) if isinstance(e, ev.PriceDeclared)] == []
    second = parse_layout(_layout({"price": {"per_hour": "1.5", "currency": "USD"}}, {}))
    changed = [e for e in diff(current, second, plan(second), now) if isinstance(e, ev.PriceDeclared)]
    assert [(e.domain, e.price.per_hour if e.price else None) for e in changed] == [("a", "1.5")]
