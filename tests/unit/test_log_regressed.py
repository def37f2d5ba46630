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
