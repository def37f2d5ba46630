"""The fold obeys the subject, not the body: given a fleet and a forged event, then the view is as if
the forgery were not there, except for its position and an anomaly naming it. Pure, no I/O."""

from __future__ import annotations

from datetime import UTC, datetime

from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.fold import Folder, add_one, empty, evolve, fold
from haru.core.residency import Lost, Sleeping
from haru.core.specs import ModelSpec
from haru.promoter.decider import decide
from haru.promoter.decisions import Facts
from tests.support.fold import F, at, declarations

FORGER = "agent:default/a@host-a"


def base() -> list[tuple[str, ev.Event]]:
    """Declarations, a route on a, b's model asleep, both domains reachable."""
    return declarations() + [
        (sj.route(F), ev.RouteMoved(at=at(1), active="a", by="promoter:p1")),
        (sj.model(F, "b", "qwen3.6:27b"), ev.ModelSleeping(at=at(2), domain="b", model="qwen3.6:27b")),
        (sj.liveness(F, "a"), ev.DomainReachable(at=at(3), domain="a")),
        (sj.liveness(F, "b"), ev.DomainReachable(at=at(3), domain="b")),
    ]


def views(items: list[tuple[str, ev.Event]]):
    return fold((i + 1, s, e) for i, (s, e) in enumerate(items))[F]


FORGERIES: list[tuple[str, ev.Event, str]] = [
    (sj.agent(F, "a"), ev.RouteMoved(at=at(5), active="b", by=FORGER), "route_moved belongs on haru.evt.<fleet>.route"),
    (sj.model(F, "a", "qwen3.6:27b"),
     ev.ModelLost(at=at(5), domain="b", model="qwen3.6:27b", reason="gpu_detached", by=FORGER),
     "its body says domain 'b', its subject says 'a'"),
    (sj.gpu(F, "a", 0), ev.GpuObserved(at=at(5), domain="b", index=0, present=False, by=FORGER), "domain 'b'"),
    (sj.agent(F, "a"), ev.DomainUnreachable(at=at(5), domain="b", by=FORGER), "domain_unreachable belongs on"),
    (sj.training(F, "a", "lora"), ev.PromotionRequested(at=at(5), op_id="op-x", target="b", by=FORGER),
     "promotion_requested belongs on"),
    (sj.model(F, "a", "qwen3.6:27b"),
     ev.ModelDeclared(at=at(5), domain="a", spec=ModelSpec(name="evil", slot="s", gpu_index=0), by=FORGER),
     "model_declared belongs on"),
]  # fmt: skip


def test_each_forgery_is_not_applied_and_is_named():
    clean = views(base())
    for subject, forged, why in FORGERIES:
        items = base() + [(subject, forged)]
        view = views(items)
        n = len(items)
        assert view.seq == n and view.anomalies == clean.anomalies + 1
        assert view.last_anomaly.startswith(f"seq {n}: {ev.tag_of(forged)} on {subject} by {FORGER} not applied: ")
        assert why in view.last_anomaly
        # Everything but the position and the anomaly is as if the forgery were not there.
        assert view.domains == clean.domains and view.active == "a" and view.operation is None
        assert view.route_revision == clean.route_revision and view.updated_at == clean.updated_at


def test_a_route_moved_on_an_agent_subject_moves_nothing_and_the_decider_keeps_the_real_revision():
    items = base()
    route_seq = next(i + 1 for i, (s, _) in enumerate(items) if s == sj.route(F))
    items.append((sj.agent(F, "a"), ev.RouteMoved(at=at(5), active="b", by=FORGER)))
    view = views(items)
    assert view.active == "a" and view.route_revision == route_seq and view.route_seq == route_seq
    # The decider decides against the route subject's real sequence (what the flip will expect).
    b = view.domains["b"].models["qwen3.6:27b"].residency
    assert isinstance(b, Sleeping)
    facts = Facts(
        now=at(6), me="promoter:p1", new_op_id="op-1", silent_ms={"a": 10_000_000, "b": 1}, listening_ms=10**9
    )
    lost = views(items + [(sj.liveness(F, "a"), ev.DomainUnreachable(at=at(6), domain="a"))])
    requested = [a.event for a in decide(lost, facts) if isinstance(a.event, ev.PromotionRequested)]
    assert requested and requested[0].route_revision == route_seq


def test_a_misplaced_event_on_the_route_subject_moves_its_real_last_sequence_not_the_revision():
    # Only the promoter role can write the route subject; even its mistakes must not wedge the flip.
    items = base() + [(sj.route(F), ev.ModelLost(at=at(5), domain="a", model="qwen3.6:27b", reason="evicted"))]
    view = views(items)
    assert view.route_seq == len(items) and view.route_revision == len(items) - 4
    assert view.active == "a" and view.anomalies == views(base()).anomalies + 1
    assert not isinstance(view.domains["a"].models["qwen3.6:27b"].residency, Lost)


def test_evolve_fold_and_the_folder_agree_on_a_forgery():
    items = base()
    n = len(items)
    for subject, forged, _ in FORGERIES:
        one = evolve(views(items), forged, seq=n + 1, subject=subject)
        by_fold = fold([*((i + 1, s, e) for i, (s, e) in enumerate(items)), (n + 1, subject, forged)])
        folders: dict[str, Folder] = {}
        for i, (s, e) in enumerate(items):
            add_one(folders, e, seq=i + 1, subject=s)
        add_one(folders, forged, seq=n + 1, subject=subject)
        assert folders[F].misplaced_seq == n + 1
        direct = Folder(views(items))
        direct.add(forged, seq=n + 1, subject=subject)
        assert one == by_fold[F] == folders[F].view() == direct.view()


def test_an_event_on_a_subject_that_is_no_event_subject_is_counted_for_its_fleet():
    view = evolve(empty(F), ev.AgentStarted(at=at(1), domain="a", by=FORGER), seq=3, subject="haru.evt.default.a.bogus")
    assert view.seq == 3 and view.anomalies == 1 and "not a Haru event subject" in view.last_anomaly
    assert view.updated_at is None


def test_at_is_not_taken_from_a_misplaced_body():
    view = evolve(
        views(base()), ev.RouteMoved(at=datetime(2099, 1, 1, tzinfo=UTC), active="b"), seq=99, subject=sj.agent(F, "a")
    )
    assert view.updated_at == at(3)
