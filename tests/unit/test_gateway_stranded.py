"""Which serving URLs a gateway gives up on when the view calls their domain unreachable (gateway/stranded.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec

from haru.core.events import RouteMoved
from haru.core.record import Record
from haru.core.residency import Answer, Resident
from haru.core.views import DomainView, FleetView, ModelView, RouteIntent, Target
from haru.gateway.metrics import GatewayMetrics
from haru.gateway.routing import RoutingTable, compile_routes
from haru.gateway.state import RouteFollower
from haru.gateway.stranded import stranded


def view(reachable: dict[str, bool | None], *, direct_url: str = "") -> FleetView:
    domains = {
        d: DomainView(
            name=d,
            serving_url=f"http://10.0.0.{i}:9100/v1/",
            reachable=r,
            models={
                "m": ModelView(name="m", admitted=True, url=direct_url, residency=Resident(since=datetime.now(UTC)))
            },
        )
        for i, (d, r) in enumerate(reachable.items(), 1)
    }
    return FleetView(fleet="f", domains=domains, active="a", route_revision=1, seq=1)


def routes(v: FleetView | None):
    return compile_routes("f", v, None)


def test_a_domain_judged_unreachable_strands_its_serving_url_once():
    before = routes(view({"a": True, "b": True}))
    after = routes(view({"a": False, "b": True}))
    assert stranded(before, after) == {"http://10.0.0.1:9100": "a"}
    assert stranded(after, msgspec.structs.replace(after)) == {}  # the same verdict again: nothing new


def test_the_first_view_a_gateway_sees_may_already_say_unreachable():
    assert stranded(None, routes(view({"a": None, "b": False}))) == {"http://10.0.0.2:9100": "b"}


def test_reachable_or_unjudged_domains_and_missing_views_strand_nothing():
    assert stranded(None, routes(view({"a": True, "b": None}))) == {}
    assert stranded(routes(view({"a": True})), routes(None)) == {}


def test_direct_model_urls_are_stranded_with_the_domain():
    before = routes(view({"a": True}, direct_url="http://10.0.0.9:8001/v1"))
    after = routes(view({"a": False}, direct_url="http://10.0.0.9:8001/v1"))
    assert stranded(before, after) == {"http://10.0.0.1:9100": "a", "http://10.0.0.9:8001": "a"}


def test_a_move_off_a_silent_active_strands_it_before_any_view_says_so():
    """The views' stream may elect its leader seconds after the events' (a lost region led both): the route
    move itself says the promoter had judged the old active unreachable, and the gateway acts on it."""
    table = RoutingTable()
    seen: list[dict[str, str]] = []
    table.listeners.append(lambda old, new: seen.append(stranded(old, new)))
    follower = RouteFollower(None, table, GatewayMetrics())  # type: ignore[arg-type]  # no task runs
    intent = RouteIntent(
        fleet="f",
        revision=1,
        active=Target(domain="a", serving_url="http://10.0.0.1:9100/v1/"),
        answers={"m": Answer(answer="ready")},
    )
    table.set_intent("f", intent, 1)
    follower._apply_view("f", view({"a": True, "b": True}), 1)

    def moved(seq: int, **kw) -> Record:
        return Record(
            seq, "haru.evt.f.route", 0, b"%d" % seq, RouteMoved(at=datetime.now(UTC), active="b", previous="a", **kw)
        )

    follower.on_route_record(moved(5, previous_silent=True))
    routes = table.get("f")
    assert routes.active == "b" and routes.view.domains["a"].reachable is False
    assert {"http://10.0.0.1:9100": "a"} in seen
    # a planned move (the old active was heard) strands nothing: its requests finish there
    seen.clear()
    follower._apply_view("f", view({"a": True, "b": True}), 2)
    follower.on_route_record(moved(9))
    assert table.get("f").view.domains["a"].reachable is True and all(s == {} for s in seen)
