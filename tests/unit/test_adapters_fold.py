"""Adapters served at run time, as the view folds them: given events, then the view. Pure, no I/O."""

from __future__ import annotations

from haru.core import subjects as sj
from haru.core.adapters import AdapterView, pending, pick, runtime_name, split_runtime_name, wanted
from haru.core.fold import fold
from tests.support.adapters import BASE, SERVED, published, routed, state
from tests.support.fold import F, at, declarations


def run(items):
    return fold((i + 1, subject, event) for i, (subject, event) in enumerate([*declarations(), *items]))[F]


def test_a_published_version_waits_for_its_probe_and_every_runtime_is_asked_to_hold_it():
    view = run([published("run-1")])
    av = view.adapters[SERVED]
    assert list(av.versions) == ["run-1"] and av.versions["run-1"].domain == "b"
    assert av.versions["run-1"].metrics == {"loss": 0.5} and av.versions["run-1"].data.startswith("data/sql")
    assert av.current == "" and pending(av) == "run-1" and wanted(av) == ["run-1"]
    assert pick(av, 0) == ""  # nothing serves before its probe passed
    assert view.anomalies == 0


def test_a_canary_takes_its_percent_and_a_rollback_names_its_evidence():
    view = run(
        [
            published("run-1"),
            routed(current="run-1", reason="probe_passed", version="run-1"),
            published("run-2", 4),
            routed(
                5, current="run-1", canary="run-2", percent=10, previous="", reason="canary_started", version="run-2"
            ),
        ]
    )
    av = view.adapters[SERVED]
    assert [pick(av, n) for n in range(100)].count("run-2") == 10
    assert wanted(av) == ["run-1", "run-2"]
    view = run(
        [
            published("run-1"),
            routed(current="run-1", reason="probe_passed", version="run-1"),
            published("run-2", 4),
            routed(5, current="run-1", canary="run-2", percent=10, reason="canary_started", version="run-2"),
            routed(6, current="run-1", reason="rolled_back", version="run-2", detail="probe: 'ping' answered 'x'"),
        ]
    )
    av = view.adapters[SERVED]
    assert av.canary == "" and av.percent == 0 and {pick(av, n) for n in range(100)} == {"run-1"}
    assert av.rolled_back == {"run-2": "probe: 'ping' answered 'x'"}
    assert pending(av) == "" and wanted(av) == ["run-1"]  # the rolled-back version is unloaded everywhere
    assert av.change is not None and av.change.reason == "rolled_back" and av.change.version == "run-2"


def test_each_domain_says_what_its_runtime_holds():
    view = run([published("run-1"), state("run-1", "loading"), state("run-1", "failed", "b", "rank 64 > 16")])
    av = view.adapters[SERVED]
    assert av.copy("a", "run-1").state == "loading"
    assert av.copy("b", "run-1").state == "failed" and av.copy("b", "run-1").detail == "rank 64 > 16"


def test_a_version_published_twice_keeps_the_first_and_is_an_anomaly():
    view = run([published("run-1"), published("run-1", 2)])
    assert view.anomalies == 1 and "already published" in view.last_anomaly
    assert view.adapters[SERVED].versions["run-1"].published_at == at(1)


def test_an_adapter_state_on_another_domains_subject_is_not_applied():
    subject, event = state("run-1", "resident", domain="a")
    view = run([published("run-1"), (sj.model(F, "b", BASE), event)])
    assert view.adapters[SERVED].copies == {} and view.anomalies == 1


def test_runtime_names_round_trip_with_colons_in_the_base_model_id():
    name = runtime_name(BASE, "sql", "run-7")
    assert name == "qwen3.6:27b:sql@run-7" and split_runtime_name(name) == (SERVED, "run-7")
    assert split_runtime_name(BASE) is None and split_runtime_name("plain@x") is None


def test_previous_is_kept_loaded_after_a_promotion():
    av = AdapterView(model=BASE, adapter="sql", current="run-2", previous="run-1")
    av = AdapterView(
        model=BASE,
        adapter="sql",
        versions={v: run([published(v)]).adapters[SERVED].versions[v] for v in ("run-1", "run-2")},
        current=av.current,
        previous=av.previous,
    )
    assert wanted(av) == ["run-2", "run-1"] and pick(av, 3) == "run-2"
