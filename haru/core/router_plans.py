"""What a router that is not Haru's should hold, as a pure function of a route intent. No I/O, no clock.

    p = plan(intent, seq)                       # Plan: every domain a plain router sends to, its weight
    lines = haproxy_commands(p, "haru", slots, assigned)   # runtime API commands, and the new slot assignment
    text = nginx_upstream(p, "haru_default")    # an upstream block for an include file
    doc = envoy_eds(p, "haru_default")          # a ClusterLoadAssignment for file-based EDS (JSON is YAML)

A plain router (HAProxy, nginx, Envoy) balances connections to addresses; it does not read a request's
body, so it cannot choose by `model`, and it cannot hold a request while a domain wakes. What it can
express: which domains get traffic and in what proportion. So a plan carries:

- the active domain's serving URL, with the weight the fleet's split leaves it (100 without a split),
- every weighted domain (`RouteIntent.weighted`) whose every model answers `ready`, with its share;
  a weighted domain that is not ready gives its share back to the active (the gateway does the same per
  model),
- `notes`: what the intent says that the router cannot follow (per-model weights, `serve: direct`
  per-model URLs, an active that is not eligible), one line each, so the follower can say so.

Weights are percentages (1..100): HAProxy takes 0..256 and nginx and Envoy take >= 1, so all three take
them as they are.
"""

from __future__ import annotations

import ipaddress
import json
from urllib.parse import urlsplit

import msgspec

from haru.core.views import RouteIntent, Target

__all__ = ["Plan", "Upstream", "envoy_eds", "haproxy_assign", "haproxy_commands", "nginx_upstream", "plan"]


class Upstream(msgspec.Struct, frozen=True, kw_only=True):
    """One domain a plain router sends to: where, and its share of the traffic (percent)."""

    domain: str
    host: str
    port: int
    weight: int


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """What a plain router should hold for one fleet at one route intent."""

    fleet: str
    revision: int  # the route revision (seq of the last route_moved) the intent was computed at
    seq: int  # the intent's sequence on HARU_ROUTE
    active: str  # '' = no route yet: the router should send nowhere
    upstreams: tuple[Upstream, ...] = ()
    notes: tuple[str, ...] = ()


def _address(t: Target) -> tuple[str, int] | None:
    if not t.serving_url:
        return None
    parts = urlsplit(t.serving_url if "://" in t.serving_url else f"http://{t.serving_url}")
    if not parts.hostname:
        return None
    try:
        port = parts.port
    except ValueError:
        return None
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


def plan(ri: RouteIntent, seq: int = 0) -> Plan:
    """The plan of a route intent (`seq`: its sequence on HARU_ROUTE, carried for the acknowledgement)."""
    notes: list[str] = []
    if ri.active is None:
        return Plan(fleet=ri.fleet, revision=ri.revision, seq=seq, active="", notes=("no active domain yet",))
    active = ri.active
    where = _address(active)
    if where is None:
        notes.append(f"the active domain {active.domain} has no serving URL: nothing to send to")
    if active.serve == "direct":
        notes.append(
            f"{active.domain} serves each model on its own port (serve: direct): a router that does not read "
            "the body cannot choose by model; it is sent to the domain's serving URL"
        )
    if not active.eligible:
        notes.append(f"the active domain {active.domain} is not eligible ({active.why}); a failover is due")
    for model in sorted(ri.model_weights):
        notes.append(
            f"model {model} has its own split: a router that does not read the body cannot follow it "
            "(use Haru's gateway, or --exec with a router that routes by model)"
        )
    others: list[Upstream] = []
    for name in sorted(ri.weights):
        share = ri.weights[name]
        if name == active.domain or share <= 0:
            continue
        w = ri.weighted.get(name)
        if w is None:
            continue
        not_ready = sorted(m for m, a in w.answers.items() if a.answer != "ready")
        addr = _address(w.target)
        if not_ready or addr is None or not w.target.eligible:
            why = f"models not ready: {', '.join(not_ready)}" if not_ready else (w.target.why or "no serving URL")
            notes.append(f"{name}'s share ({share}%) goes to {active.domain} until it serves ({why})")
            continue
        others.append(Upstream(domain=name, host=addr[0], port=addr[1], weight=share))
    ups: list[Upstream] = []
    if where is not None:
        left = max(1, 100 - sum(u.weight for u in others))
        ups.append(Upstream(domain=active.domain, host=where[0], port=where[1], weight=left))
    ups.extend(others)
    return Plan(
        fleet=ri.fleet, revision=ri.revision, seq=seq, active=active.domain, upstreams=tuple(ups), notes=tuple(notes)
    )


# ----------------------------------------------------------------------------------------- HAProxy


def haproxy_assign(plan_: Plan, slots: tuple[str, ...], assigned: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Which server slot of the backend holds which domain: a domain keeps its slot while it stays in the
    plan (so a flip readies one slot and puts the other in maintenance, and connections in flight on the
    old one finish), a new one takes the first free slot. Returns (domain -> slot, notes)."""
    wanted = [u.domain for u in plan_.upstreams]
    out = {d: s for d, s in assigned.items() if d in wanted and s in slots}
    vacated = {s for d, s in assigned.items() if d not in out}
    # slots just left go last: the old active's connections in flight finish on its slot, untouched
    free = [s for s in slots if s not in out.values() and s not in vacated] + [s for s in slots if s in vacated]
    notes: list[str] = []
    for d in wanted:
        if d in out:
            continue
        if not free:
            notes.append(f"no free server slot for {d}: declare more (server-template) in the backend")
            continue
        out[d] = free.pop(0)
    return out, notes


def haproxy_commands(plan_: Plan, backend: str, slots: tuple[str, ...], assigned: dict[str, str]) -> list[str]:
    """The runtime API commands that make `backend`'s `slots` hold `plan_` under the assignment `assigned`
    (from `haproxy_assign`): the new servers first (address, weight, ready), then every other slot in
    maintenance, so no moment has no ready server. HAProxy wants an IP address: `host` must be one."""
    by_domain = {u.domain: u for u in plan_.upstreams}
    ready: list[str] = []
    for domain, slot in sorted(assigned.items(), key=lambda kv: slots.index(kv[1])):
        u = by_domain.get(domain)
        if u is None:
            continue
        server = f"{backend}/{slot}"
        ready += [
            f"set server {server} addr {u.host} port {u.port}",
            f"set server {server} weight {u.weight}",
            f"set server {server} state ready",
        ]
    used = {s for d, s in assigned.items() if d in by_domain}
    maint = [f"set server {backend}/{s} state maint" for s in slots if s not in used]
    return ready + maint


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


# ------------------------------------------------------------------------------------------- nginx


def nginx_upstream(plan_: Plan, name: str) -> str:
    """An `upstream` block for an nginx include file. With nothing to send to, one server marked `down`
    (nginx refuses an empty upstream), so clients get a 502 at once rather than a wrong domain."""
    lines = [
        f"# Written by `haru route follow` for fleet {plan_.fleet}: route revision {plan_.revision}, "
        f"intent {plan_.seq}. Do not edit: the next route change replaces it.",
        f"upstream {name} {{",
    ]
    for u in plan_.upstreams:
        host = f"[{u.host}]" if ":" in u.host else u.host
        lines.append(f"    server {host}:{u.port} weight={u.weight};  # {u.domain}")
    if not plan_.upstreams:
        lines.append("    server 127.0.0.1:9 down;  # no active domain")
    for note in plan_.notes:
        lines.append(f"    # cannot follow: {note}")
    lines.append("    keepalive 32;")
    lines.append("}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- Envoy


def envoy_eds(plan_: Plan, cluster: str) -> str:
    """A file-based EDS document (a DiscoveryResponse with one ClusterLoadAssignment), as JSON, which is
    YAML too: the cluster's `eds_cluster_config` points at the file with `path_config_source`."""
    endpoints = [
        {
            "endpoint": {"address": {"socket_address": {"address": u.host, "port_value": u.port}}},
            "load_balancing_weight": u.weight,
            "health_status": "HEALTHY",
        }
        for u in plan_.upstreams
    ]
    doc = {
        "version_info": str(plan_.seq),
        "resources": [
            {
                "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
                "cluster_name": cluster,
                "endpoints": [{"lb_endpoints": endpoints}] if endpoints else [],
            }
        ],
    }
    return json.dumps(doc, indent=2) + "\n"
