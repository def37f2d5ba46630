"""What a plain router should hold for a route intent (haru.core.router_plans), and who is behind
(haru.core.router_acks): given intents and reports, the plans, commands, files and verdicts."""

from __future__ import annotations

import json

from haru.core import router_acks as acks
from haru.core.residency import Answer
from haru.core.router_plans import envoy_eds, haproxy_assign, haproxy_commands, nginx_upstream, plan
from haru.core.views import RouteIntent, Target, Weighted

READY = {"m": Answer(answer="ready")}


def ri(active: str = "a", revision: int = 7, **kw) -> RouteIntent:
    return RouteIntent(
        fleet="f",
        revision=revision,
        active=Target(domain=active, serving_url=f"http://10.0.0.{ord(active) - 96}:8000"),
        answers=READY,
        **kw,
    )


def weighted(d: str, answers=READY) -> Weighted:
    return Weighted(target=Target(domain=d, serving_url=f"http://10.0.0.{ord(d) - 96}:8000"), answers=answers)


def test_the_active_takes_everything_without_a_split():
    p = plan(ri(), seq=12)
    assert (p.revision, p.seq, p.active) == (7, 12, "a")
    assert [(u.domain, u.host, u.port, u.weight) for u in p.upstreams] == [("a", "10.0.0.1", 8000, 100)]
    assert p.notes == ()


def test_a_ready_weighted_domain_takes_its_share_and_one_not_ready_gives_it_back():
    p = plan(ri(weights={"b": 20}, weighted={"b": weighted("b")}))
    assert [(u.domain, u.weight) for u in p.upstreams] == [("a", 80), ("b", 20)]
    warming = {"m": Answer(answer="warming")}
    p = plan(ri(weights={"b": 20}, weighted={"b": weighted("b", warming)}))
    assert [(u.domain, u.weight) for u in p.upstreams] == [("a", 100)]
    assert p.notes == ("b's share (20%) goes to a until it serves (models not ready: m)",)


def test_what_a_router_cannot_follow_is_said():
    p = plan(ri(model_weights={"m": {"b": 50}}))
    assert any("model m has its own split" in n for n in p.notes)
    direct = RouteIntent(fleet="f", revision=1, active=Target(domain="a", serving_url="http://h:1", serve="direct"))
    assert any("serve: direct" in n for n in plan(direct).notes)
    assert plan(RouteIntent(fleet="f")).upstreams == () and plan(RouteIntent(fleet="f")).active == ""


def test_haproxy_keeps_each_domain_in_its_slot_and_readies_the_new_before_it_drains_the_old():
    slots = ("s1", "s2", "s3")
    assigned, notes = haproxy_assign(plan(ri("a")), slots, {})
    assert assigned == {"a": "s1"} and notes == []
    # a flip to b: a's slot goes to maintenance after b's is ready, so no moment has no server
    p = plan(ri("b", revision=9))
    assigned, _ = haproxy_assign(p, slots, assigned)
    assert assigned == {"b": "s2"}
    cmds = haproxy_commands(p, "be", slots, assigned)
    assert cmds == [
        "set server be/s2 addr 10.0.0.2 port 8000",
        "set server be/s2 weight 100",
        "set server be/s2 state ready",
        "set server be/s1 state maint",
        "set server be/s3 state maint",
    ]
    full, notes = haproxy_assign(plan(ri(weights={"b": 10}, weighted={"b": weighted("b")})), ("s1",), {})
    assert full == {"a": "s1"} and notes == ["no free server slot for b: declare more (server-template) in the backend"]


def test_nginx_and_envoy_files():
    text = nginx_upstream(plan(ri(weights={"b": 20}, weighted={"b": weighted("b")})), "haru_f")
    assert "upstream haru_f {" in text
    assert "server 10.0.0.1:8000 weight=80;" in text and "server 10.0.0.2:8000 weight=20;" in text
    assert "server 127.0.0.1:9 down;" in nginx_upstream(plan(RouteIntent(fleet="f")), "haru_f")
    doc = json.loads(envoy_eds(plan(ri(), seq=3), "haru_f"))
    cla = doc["resources"][0]
    assert doc["version_info"] == "3" and cla["cluster_name"] == "haru_f"
    ep = cla["endpoints"][0]["lb_endpoints"][0]
    assert ep["endpoint"]["address"]["socket_address"] == {"address": "10.0.0.1", "port_value": 8000}
    assert ep["load_balancing_weight"] == 100


def report(router: str, revision: int, fleet: str = "f", interval_ms: int = 1000) -> acks.RouterReport:
    return acks.RouterReport(fleet=fleet, router=router, revision=revision, interval_ms=interval_ms)


def test_routers_applied_behind_and_gone():
    book: dict = {}
    book, _ = acks.heard(book, "f", "r1", report("r1", 9), now=100.0)
    book, _ = acks.heard(book, "f", "r2", report("r2", 7), now=100.0)
    book, _ = acks.heard(book, "f", "r3", report("r3", 7), now=90.0)  # silent for 10 s: gone
    w = acks.waiting(book, 9, now=101.0)
    assert (w.applied, w.behind, w.gone) == (("r1",), ("r2",), ("r3",))
    assert [(r.router, r.state, r.silent_s) for r in acks.lag(book, 9, 101.0)] == [
        ("r1", "applied", 1.0),
        ("r2", "behind", 1.0),
        ("r3", "gone", 11.0),
    ]
    assert "still behind: r2" in acks.describe(w, 0.5, timeout=True)


def test_a_report_about_another_fleet_or_router_is_not_counted():
    book, why = acks.heard({}, "f", "r1", report("r1", 9, fleet="g"), now=1.0)
    assert book == {} and "the subject is the authority" in why
    book, why = acks.heard({}, "f", "r1", report("r2", 9), now=1.0)
    assert book == {} and why
