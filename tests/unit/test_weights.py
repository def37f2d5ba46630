"""Traffic weights and canaries, pure: parsing and resolving a split (haru.core.weights), its fold
and route intent, and the gateway's per-request split (gateway.split via the routing table)."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from haru.core import events as ev
from haru.core import subjects
from haru.core.errors import InvalidWeights
from haru.core.fold import fold
from haru.core.intents import at, intent
from haru.core.residency import Answer, Resident, Sleeping
from haru.core.views import DomainView, FleetView, ModelView, RouteIntent, Target, Weighted
from haru.core.weights import describe, gaining, parse_pairs, resolve, split_of, spread
from haru.gateway.routing import Forward, Refusal, RoutingTable

T0 = datetime(2026, 12, 2, 0, 0, tzinfo=UTC)
M, N = "qwen3:0.6b", "other"
DOMAINS = ["a", "b", "c"]


# ---------------------------------------------------------------------------------- parse, resolve


def test_parse_pairs_reads_domain_percent():
    assert parse_pairs(["b=10", " c = 5 "]) == {"b": 10, "c": 5}


@pytest.mark.parametrize(
    "item, says",
    [
        ("b10", "is not DOMAIN=PERCENT"),
        ("b=", "is not DOMAIN=PERCENT"),
        ("b=ten", "is not a whole percent"),
        ("B=10", "did you mean 'b'"),
    ],
)
def test_parse_pairs_refuses_with_the_item_and_the_fix(item, says):
    with pytest.raises(InvalidWeights, match=says):
        parse_pairs([item])


def test_parse_pairs_refuses_a_domain_given_twice():
    with pytest.raises(InvalidWeights, match="given twice"):
        parse_pairs(["b=10", "b=20"])


def test_resolve_gives_the_active_what_the_others_leave():
    assert resolve({"b": 10}, domains=DOMAINS, active="a") == {"a": 90, "b": 10}
    assert resolve({"b": 10, "c": 5}, domains=DOMAINS, active="a") == {"a": 85, "b": 10, "c": 5}
    assert resolve({"a": 70, "c": 30}, domains=DOMAINS, active="a") == {"a": 70, "c": 30}


def test_resolve_back_to_the_default_is_empty():
    assert resolve({"b": 0}, domains=DOMAINS, active="a") == {}
    assert resolve({"a": 100}, domains=DOMAINS, active="a") == {}
    assert resolve({}, domains=DOMAINS, active="a") == {}


@pytest.mark.parametrize(
    "given_, says",
    [
        ({"z": 10}, "no domain 'z' in this fleet \\(declared: a, b, c\\)"),
        ({"b": -1}, "between 0 and 100"),
        ({"b": 101}, "between 0 and 100"),
        ({"a": 80, "b": 10}, "add up to 90"),
        ({"b": 60, "c": 50}, "over 100"),
        ({"b": 100}, "promote the other domain \\(haru promote b\\)"),
        ({"a": 0, "b": 100}, "leave nothing for the active"),
    ],
)
def test_resolve_refuses_what_cannot_be_applied(given_, says):
    with pytest.raises(InvalidWeights, match=says):
        resolve(given_, domains=DOMAINS, active="a")


def test_resolve_refuses_without_an_active_domain():
    with pytest.raises(InvalidWeights, match="no active domain"):
        resolve({"b": 10}, domains=DOMAINS, active="")


def test_split_of_prefers_the_models_own_then_the_fleets_then_the_default():
    assert split_of({}, {}, M, "a") == {"a": 100}
    assert split_of({"a": 90, "b": 10}, {}, M, "a") == {"a": 90, "b": 10}
    assert split_of({"a": 90, "b": 10}, {M: {"a": 50, "c": 50}}, M, "a") == {"a": 50, "c": 50}
    assert split_of({"a": 90, "b": 10}, {M: {"a": 50, "c": 50}}, N, "a") == {"a": 90, "b": 10}


def test_gaining_names_only_new_shares_off_the_active():
    assert gaining({}, {"a": 90, "b": 10}, "a") == ["b"]
    assert gaining({"a": 90, "b": 10}, {"a": 80, "b": 20}, "a") == []
    assert gaining({"a": 90, "b": 10}, {"a": 80, "b": 10, "c": 10}, "a") == ["c"]


def test_describe():
    assert describe({}, "a") == "a 100 (default)"
    assert describe({"b": 10, "a": 90}, "a") == "a 90, b 10"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=100), min_size=1, max_size=5), st.integers(1, 3000))
def test_spread_keeps_every_run_within_one_request_of_the_shares(shares, n):
    split = {f"d{i}": w for i, w in enumerate(shares)}
    total = sum(shares)
    table = spread(split)
    counts = Counter(table[i % len(table)] for i in range(n))
    for d, w in split.items():
        assert abs(counts[d] - n * w / total) <= len(split), (d, counts[d], n * w / total)


def test_spread_interleaves():
    assert spread({"a": 90, "b": 10}).count("b") == 1
    assert len(spread({"a": 90, "b": 10})) == 10
    assert spread({}) == ()


# ------------------------------------------------------------------------------------ fold, intent


def _decl() -> list[tuple[int, str, ev.Event]]:
    from haru.core.specs import DomainSpec, ModelSpec, Policy

    out: list[tuple[int, str, ev.Event]] = [
        (1, subjects.decl("f"), ev.FleetDeclared(at=T0, fleet="f", policy=Policy()))
    ]
    seq = 2
    for d in DOMAINS:
        out.append(
            (seq, subjects.decl("f"), ev.DomainDeclared(at=T0, spec=DomainSpec(name=d, serving_url=f"http://{d}:1")))
        )
        seq += 1
        out.append(
            (seq, subjects.decl("f"), ev.ModelDeclared(at=T0, domain=d, spec=ModelSpec(name=M, slot="s0", gpu_index=0)))
        )
        seq += 1
    for d in DOMAINS:
        out.append((seq, subjects.model("f", d, M), ev.ModelResident(at=T0, domain=d, model=M)))
        seq += 1
    out.append((seq, subjects.route("f"), ev.RouteMoved(at=T0, active="a")))
    return out


def test_weights_set_folds_into_the_view_and_the_intent():
    entries = _decl()
    seq = entries[-1][0] + 1
    entries.append(
        (seq, subjects.weights("f"), ev.WeightsSet(at=T0, by="promoter:x", weights={"a": 90, "b": 10}, op_id="op-1"))
    )
    entries.append((seq + 1, subjects.weights("f"), ev.WeightsSet(at=T0, model=M, weights={"a": 80, "c": 20})))
    v = fold(entries)["f"]
    assert v.weights == {"a": 90, "b": 10}
    assert v.model_weights == {M: {"a": 80, "c": 20}}
    assert v.weights_seq == seq + 1
    assert v.weights_change is not None and v.weights_change.model == M
    ri = intent(v)
    assert ri.weights == {"a": 90, "b": 10} and ri.model_weights == {M: {"a": 80, "c": 20}}
    assert set(ri.weighted) == {"b", "c"}
    assert ri.weighted["b"].answers[M].answer == "ready"
    assert at(ri, T0).weighted == ri.weighted


def test_a_route_move_resets_the_weights():
    entries = _decl()
    seq = entries[-1][0] + 1
    entries.append((seq, subjects.weights("f"), ev.WeightsSet(at=T0, weights={"a": 90, "b": 10})))
    entries.append((seq + 1, subjects.route("f"), ev.RouteMoved(at=T0, active="b", previous="a")))
    v = fold(entries)["f"]
    assert v.weights == {} and v.active == "b"
    assert intent(v).weighted == {}


def test_weights_set_anywhere_but_the_weights_subject_is_not_applied():
    entries = _decl()
    seq = entries[-1][0] + 1
    entries.append((seq, subjects.op("f"), ev.WeightsSet(at=T0, weights={"a": 90, "b": 10})))
    v = fold(entries)["f"]
    assert v.weights == {}
    assert "weights_set" in v.last_anomaly and "haru.evt.<fleet>.weights" in v.last_anomaly


def test_an_old_intent_without_weights_still_decodes():
    from haru.core.views import intent_decoder

    ri = intent_decoder.decode(b'{"fleet":"f","revision":3}')
    assert ri.weights == {} and ri.weighted == {}


def test_a_domain_cannot_be_called_weights():
    from haru.core.errors import InvalidName

    with pytest.raises(InvalidName, match="reserved"):
        subjects.check_name("domain", "weights")


# ------------------------------------------------------------------------------- the gateway's split


def _table(split: dict[str, int], *, b_answer: str = "ready", model_split: bool = False) -> RoutingTable:
    ri = RouteIntent(
        fleet="f",
        revision=4,
        active=Target(domain="a", serving_url="http://a:1"),
        answers={M: Answer(answer="ready"), N: Answer(answer="ready")},
        weights={} if model_split else split,
        model_weights={M: split} if model_split else {},
        weighted={
            "b": Weighted(
                target=Target(domain="b", serving_url="http://b:1/v1"),
                answers={M: Answer(answer=b_answer), N: Answer(answer="ready")},
            )
        },
    )
    t = RoutingTable()
    t.set_intent("f", ri, 1)
    return t


def test_the_table_splits_by_weight_per_request():
    t = _table({"a": 90, "b": 10})
    got = Counter(t.resolve("f", M, 0.0).domain for _ in range(2000))  # type: ignore[union-attr]
    assert got == {"a": 1800, "b": 200}
    fwd = next(f for f in (t.resolve("f", M, 0.0) for _ in range(10)) if f.domain == "b")  # type: ignore[union-attr]
    assert fwd == Forward("http://b:1", "f", "b", M, 4)


def test_a_model_split_leaves_other_models_on_the_active():
    t = _table({"a": 50, "b": 50}, model_split=True)
    assert Counter(t.resolve("f", M, 0.0).domain for _ in range(100)) == {"a": 50, "b": 50}  # type: ignore[union-attr]
    assert {t.resolve("f", N, 0.0).domain for _ in range(100)} == {"a"}  # type: ignore[union-attr]


def test_a_share_on_a_domain_not_ready_stays_with_the_active():
    t = _table({"a": 90, "b": 10}, b_answer="asleep")
    assert {t.resolve("f", M, 0.0).domain for _ in range(100)} == {"a"}  # type: ignore[union-attr]


def test_a_model_the_active_refuses_is_not_sent_to_the_canary_alone():
    ri = RouteIntent(
        fleet="f",
        revision=4,
        active=Target(domain="a", serving_url="http://a:1"),
        answers={M: Answer(answer="asleep")},
        weights={"a": 50, "b": 50},
        weighted={
            "b": Weighted(target=Target(domain="b", serving_url="http://b:1"), answers={M: Answer(answer="ready")})
        },
    )
    t = RoutingTable()
    t.set_intent("f", ri, 1)
    assert isinstance(t.resolve("f", M, 0.0), Refusal)


def test_fleet_view_defaults_have_no_weights():
    v = FleetView(
        fleet="f", domains={"a": DomainView(name="a", models={M: ModelView(name=M, residency=Sleeping(since=T0))})}
    )
    assert v.weights == {} and v.model_weights == {} and v.weights_change is None
    assert Resident  # used above in the fold fixtures


def test_an_update_keeps_the_splits_place_in_its_rotation():
    t = _table({"a": 50, "b": 50})
    first = t.resolve("f", M, 0.0).domain  # type: ignore[union-attr]
    routes = t.get("f")
    assert routes is not None and routes.intent is not None
    t.set_intent("f", routes.intent, 2)  # the same split, published again
    assert t.resolve("f", M, 0.0).domain != first  # type: ignore[union-attr]
