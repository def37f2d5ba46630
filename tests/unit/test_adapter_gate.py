"""The probe gate of LoRA adapters: given the view, then the `adapter_routed` it decides. Pure."""

from __future__ import annotations

import msgspec

from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.fold import fold
from haru.core.weights import Tally
from haru.promoter import adapter_gate
from tests.support.adapters import BASE, SERVED, published, routed
from tests.support.fold import F, at, declarations

ROUTE = (sj.route(F), ev.RouteMoved(at=at(0), active="a"))


def loaded(version: str, s: float = 3, state: str = "resident", probe: str = "passed", detail: str = "ok"):
    return (
        sj.model(F, "a", BASE),
        ev.AdapterStateChanged(
            at=at(s),
            domain="a",
            model=BASE,
            adapter="sql",
            version=version,
            state=state,
            probe=probe,
            probe_detail=detail,
            detail="" if state == "resident" else detail,
        ),
    )


def view_of(items):
    return fold((i + 1, subject, event) for i, (subject, event) in enumerate([*declarations(), ROUTE, *items]))[F]


def decide(items, now: float = 10, tallies=None):
    out = adapter_gate.decide(view_of(items), tallies or {}, at(now))
    assert all(a.subject == sj.weights(F) for a in out)
    return [a.event for a in out]


def test_the_first_version_serves_once_the_active_runtime_holds_it_and_its_probe_passed():
    assert decide([published("run-1")]) == []  # nothing loaded on the active yet: wait
    assert decide([published("run-1"), loaded("run-1", state="loading", probe="")]) == []
    (e,) = decide([published("run-1"), loaded("run-1", detail="'SELECT' -> 'SELECT 1'")])
    assert (e.reason, e.current, e.canary, e.version) == ("probe_passed", "run-1", "", "run-1")
    assert "SELECT 1" in e.detail


def test_a_version_whose_probe_failed_never_serves():
    (e,) = decide([published("run-1"), loaded("run-1", probe="failed", detail="expected 'ok', answered 'x'")])
    assert (e.reason, e.version, e.current) == ("rolled_back", "run-1", "")
    assert "evaluation probe failed" in e.detail and "answered 'x'" in e.detail


def test_a_version_the_runtime_refused_is_rolled_back_in_its_words():
    (e,) = decide([published("run-1"), loaded("run-1", state="failed", probe="", detail="rank 64 > 16")])
    assert e.reason == "rolled_back" and "rank 64 > 16" in e.detail


SERVING = [published("run-1"), routed(4, current="run-1", reason="probe_passed", version="run-1"), loaded("run-1")]


def test_a_new_version_goes_out_as_a_canary_then_takes_everything():
    (e,) = decide([*SERVING, published("run-2", 5), loaded("run-2", 6)])
    assert (e.reason, e.current, e.canary, e.percent) == ("canary_started", "run-1", "run-2", 10)
    started = routed(7, current="run-1", canary="run-2", percent=10, reason="canary_started", version="run-2")
    items = [*SERVING, published("run-2", 5), loaded("run-2", 6), started]
    assert decide(items, now=7 + 30) == []  # holding: adapter_canary_ms is 60 s
    (e,) = decide(items, now=7 + 61)
    assert (e.reason, e.current, e.canary, e.previous) == ("promoted", "run-2", "", "run-1")


def test_a_canary_over_the_error_rate_is_rolled_back_with_the_gateways_figures():
    started = routed(7, current="run-1", canary="run-2", percent=10, reason="canary_started", version="run-2")
    items = [*SERVING, published("run-2", 5), loaded("run-2", 6), started]
    name = f"{SERVED}@run-2"
    (e,) = decide(items, tallies={"a": {name: Tally(requests=40, errors=10, gateways=["g1"], last_error="HTTP 500")}})
    assert (e.reason, e.version, e.current, e.canary) == ("rolled_back", "run-2", "run-1", "")
    assert "25.0%" in e.detail and "g1" in e.detail and "HTTP 500" in e.detail
    few = {"a": {name: Tally(requests=3, errors=3, gateways=["g1"])}}
    assert decide(items, tallies=few) == []  # under canary_min_requests: no verdict yet


def test_a_promoted_version_that_fails_returns_to_the_previous_one_still_loaded():
    items = [
        *SERVING,
        published("run-2", 5),
        loaded("run-2", 6),
        routed(8, current="run-2", previous="run-1", reason="promoted", version="run-2"),
        loaded("run-2", 9, state="failed", probe="", detail="CUDA error"),
    ]
    (e,) = decide(items)
    assert (e.reason, e.version, e.current, e.previous) == ("rolled_back", "run-2", "run-1", "")
    assert "CUDA error" in e.detail


def test_nothing_is_decided_for_a_model_the_active_does_not_serve():
    view = view_of([published("run-1"), loaded("run-1")])
    view = msgspec.structs.replace(view, active="nowhere")
    assert adapter_gate.decide(view, {}, at(10)) == []
