"""What a fold and `haru verify` believe of a writer's record that the log lost acknowledged events: the
ranges on subjects that writer may write (known from the subject its record stands on), nothing else."""

from __future__ import annotations

from datetime import UTC, datetime

from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.fold import empty, evolve
from haru.core.receipts import Regression, in_scope, regressed

T = datetime(2026, 12, 6, tzinfo=UTC)


def lost(subject: str, acknowledged: int = 9, held: int = 4) -> ev.LostRange:
    return ev.LostRange(subject=subject, acknowledged=acknowledged, held=held, reason="behind", expected="ab" * 32)


def test_an_agent_is_believed_about_its_own_domain_and_the_promoter_about_the_fleet_subjects_it_writes():
    mine = sj.domain_integrity("f", "a")
    assert in_scope(mine, lost(sj.model("f", "a", "m")))
    assert in_scope(mine, lost(sj.gpu("f", "a", 0)))
    assert not in_scope(mine, lost(sj.model("f", "b", "m")))  # another domain's
    assert not in_scope(mine, lost(sj.route("f")))  # the promoter's
    assert not in_scope(mine, lost(sj.model("g", "a", "m")))  # another fleet's
    fleet = sj.integrity("f")
    assert in_scope(fleet, lost(sj.route("f"))) and in_scope(fleet, lost(sj.liveness("f", "a")))
    assert not in_scope(fleet, lost(sj.model("f", "a", "m"))) and not in_scope(fleet, lost(sj.decl("f")))


def test_a_record_folds_as_an_anomaly_naming_only_the_ranges_believed():
    event = ev.DomainLogRegressed(at=T, domain="a", lost=[lost(sj.model("f", "a", "m")), lost(sj.route("f"), 30, 0)])
    view = evolve(empty("f"), event, seq=12, subject=sj.domain_integrity("f", "a"))
    assert view.anomalies == 1
    assert view.last_anomaly == (
        "seq 12: the event log lost acknowledged events (the agent of a noticed): "
        "haru.evt.f.a.model.m after 4 up to 9 (expected abababababab)"
    )
    forged = ev.DomainLogRegressed(at=T, domain="a", lost=[lost(sj.route("f"))])
    view = evolve(view, forged, seq=13, subject=sj.domain_integrity("f", "a"))
    assert view.anomalies == 2 and "names no subject it writes: not believed" in view.last_anomaly


def test_what_a_writer_found_becomes_one_record_per_fleet_on_its_own_subject():
    found = [
        Regression(sj.model("f", "a", "m"), 9, 4, "behind", "h1"),
        Regression(sj.gpu("f", "a", 0), 7, 0, "rewritten", "h2"),
        Regression(sj.model("g", "a", "m"), 3, 1, "behind", "h3"),
    ]
    [(s1, e1), (s2, e2)] = regressed(found, at=T, domain="a")
    assert (s1, s2) == (sj.domain_integrity("f", "a"), sj.domain_integrity("g", "a"))
    assert isinstance(e1, ev.DomainLogRegressed) and [r.expected for r in e1.lost] == ["h1", "h2"]
    [(s, e)] = regressed([Regression(sj.route("f"), 5, 0, "behind", "h")], at=T)
    assert s == sj.integrity("f") and isinstance(e, ev.LogRegressed) and e.fleet == "f"


def test_an_agent_restates_the_state_a_model_is_in_and_nothing_for_what_no_agent_event_states():
    from haru.core import residency as r
    from haru.core.receipts import restated

    resident = restated(r.Resident(warmup_ms=40, endpoint="e", sleeps=False), domain="a", model="m", at=T)
    assert resident == ev.ModelResident(at=T, domain="a", model="m", endpoint="e", warmup_ms=40, sleeps=False)
    assert isinstance(restated(r.Sleeping(level=1), domain="a", model="m", at=T), ev.ModelSleeping)
    lost = restated(r.Lost(reason="gpu_detached", detail="gone"), domain="a", model="m", at=T)
    assert isinstance(lost, ev.ModelLost) and lost.reason == "gpu_detached"
    assert restated(r.UNKNOWN, domain="a", model="m", at=T) is None
    assert restated(r.NotAdmitted(short_by_bytes=1), domain="a", model="m", at=T) is None


def test_the_promoter_puts_a_rewound_route_back_only_on_a_fit_domain_with_no_operation_in_flight():
    import msgspec

    from haru.core.receipts import route_to_restore
    from haru.core.residency import Lost
    from haru.core.views import DomainView, ModelView, OperationView

    def view(active: str, b_model=None, operation=None):
        models = {"m": ModelView(name="m", admitted=True, residency=b_model)} if b_model is not None else {}
        domains = {"a": DomainView(name="a"), "b": DomainView(name="b", models=models)}
        return msgspec.structs.replace(empty("f"), active=active, domains=domains, operation=operation)

    moved = route_to_restore(view("a"), "b", at=T)
    assert moved is not None and (moved.active, moved.previous, moved.op_id) == ("b", "a", "")
    assert route_to_restore(view("b"), "b", at=T) is None  # the log still says so
    assert route_to_restore(view("a"), "c", at=T) is None  # no longer declared
    assert route_to_restore(view("a", b_model=Lost(reason="evicted")), "b", at=T) is None  # not fit
    op = OperationView(op_id="op-1", kind="promotion", target="b")
    assert route_to_restore(view("a", operation=op), "b", at=T) is None  # its saga resumes from the log
