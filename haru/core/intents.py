"""Route intents: what routers act on, as a pure function of a `FleetView`. No I/O, no clock.

    ri = intent(view)              # what the projector publishes on haru.route.<fleet>
    ri = intent(view, now)         # the same, with `for_ms` of warming answers computed at `now`
    if changed(last, ri): publish
    fresh = at(ri, now)            # a reader's view of a published intent: for_ms as of now

An intent carries:

- `revision`: the stream sequence of the last `route_moved` (0 = never routed),
- `active` and `standby` Targets (the standby is the first-ranked one): serving URL (the declared one, else the one the
  agent announced),
  reachability, eligibility with why, degraded flags, and for `serve: direct` domains the URL of
  each admitted model,
- `answers`: one router answer per model declared on the active domain (`haru.core.residency.answer`),
- `standbys`: every standby ranked (`haru.core.ranking`), each with `fit` and `why`, and `protection`:
  `protected`, `unprotected` (no fit standby) or '' (no route yet, one domain),
- `operation`: the op_id of the promotion or demotion in flight, and `view_seq`,
- `weights` and `model_weights`: the traffic splits in force ({} = the active takes everything), and
  `weighted`: every other domain with a share, its Target and one answer per model it declares
  (haru.core.weights; a router sends a domain its share only while that answer is `ready`).

Volatile values stay out. `for_ms` of a warming answer depends on the reader's clock, so the
projector publishes intents computed with `now=None` (`for_ms` = 0, `since` set) and a reader
recomputes it with `at(intent, now)`. An intent is then a deterministic function of the view: two
projectors compute byte-identical intents, and `changed` (which ignores `view_seq`) publishes only
when something a router acts on moved.

Eligibility (may this domain serve?): reachable is not False, the promoter's `eligibility_changed`
flag, every declared GPU present (an honest None counts as present), and no admitted model lost or
failed. `why` says the first reason that fails.

Degraded: an admitted model is `lost` for a reason other than `gpu_detached`; `degraded_since` is
the earliest such loss. A `gpu_detached` loss is not degradation but failure (docs/design.md, auto
failover): the Target is ineligible with why `gpu_detached`. `failed` (the runtime refused to load)
makes a domain ineligible but is not degradation: it is the operator's to fix, and the same model
would fail on the other domain.

Model URLs (`serve: direct` only): the model's declared `url` (external runtimes), else the endpoint
the agent reported when it became resident or started loading (`http://` added when missing),
else the host of the domain's serving URL with the model's port, else `http://127.0.0.1:<port>`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from urllib.parse import urlsplit

import msgspec

from haru.core import ranking, residency
from haru.core.events import RouteMoved
from haru.core.residency import Answer, Failed, Loading, Lost, NotAdmitted, Resident
from haru.core.views import DomainView, FleetView, ModelView, RankedStandby, RouteIntent, Target, Weighted

__all__ = ["at", "changed", "intent", "target"]

_replace = msgspec.structs.replace
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _model_answer(model: ModelView, now: datetime | None) -> Answer:
    state = model.residency
    if model.admitted is False and not isinstance(state, NotAdmitted):
        state = NotAdmitted(short_by_bytes=model.short_by_bytes, since=state.since, seq=state.seq)
    ans = residency.answer(state, now if now is not None else (state.since or _EPOCH))
    if now is None and ans.for_ms:
        ans = _replace(ans, for_ms=0)
    return ans


def _url_of(domain: DomainView, model: ModelView) -> str:
    if model.url:
        return model.url
    state = model.residency
    endpoint = getattr(state, "endpoint", "") if isinstance(state, (Resident, Loading)) else ""
    if endpoint:
        return endpoint if "://" in endpoint else f"http://{endpoint}"
    if not model.port:
        return ""
    base = domain.serving_url or domain.agent.serving_url
    host = urlsplit(base).hostname if base else None
    if host:
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{model.port}"
    return f"http://127.0.0.1:{model.port}"


def target(domain: DomainView) -> Target:
    """One domain as routers see it."""
    why = ""
    if domain.reachable is False:
        why = "domain unreachable (agent heartbeat silent)"
    elif not domain.eligible:
        why = domain.ineligible_why or "marked ineligible"
    else:
        for g in domain.gpus:
            if g.present is False:
                why = f"GPU {g.index} not present (detached by the provider)"
                break
    degraded_since: datetime | None = None
    degraded_why = ""
    for name, m in domain.models.items():
        if m.admitted is False:
            continue
        state = m.residency
        if isinstance(state, Lost):
            if not why:
                why = f"model {name} lost: {state.reason.replace('_', ' ')}"
            if state.reason != "gpu_detached":
                if degraded_since is None or (state.since is not None and state.since < degraded_since):
                    degraded_since = state.since
                    degraded_why = f"model {name} lost: {state.reason.replace('_', ' ')}"
                elif not degraded_why:
                    degraded_why = f"model {name} lost: {state.reason.replace('_', ' ')}"
        elif isinstance(state, Failed) and not why:
            why = f"model {name} failed: {state.runtime_said}" if state.runtime_said else f"model {name} failed"
    degraded = bool(degraded_why)
    model_urls: dict[str, str] = {}
    if domain.serve == "direct":
        for name, m in domain.models.items():
            if m.admitted is not False:
                url = _url_of(domain, m)
                if url:
                    model_urls[name] = url
    return Target(
        domain=domain.name,
        serving_url=domain.serving_url or domain.agent.serving_url,
        serve=domain.serve,
        reachable=domain.reachable,
        eligible=not why,
        why=why or degraded_why,
        degraded=degraded,
        degraded_since=degraded_since if degraded else None,
        model_urls=model_urls,
    )


def intent(view: FleetView, now: datetime | None = None) -> RouteIntent:
    """The route intent of a fleet's view. With `now=None`, warming answers carry `for_ms=0`."""
    active = view.domains.get(view.active) if view.active else None
    standby: DomainView | None = None
    ranked: list[RankedStandby] = []
    if active is not None:
        ranked = ranking.rank(view)
        standby = view.domains.get(ranked[0].domain) if ranked else None
    answers: dict[str, Answer] = {}
    if active is not None:
        for name, m in active.models.items():
            answers[name] = _model_answer(m, now)
    weighted: dict[str, Weighted] = {}
    if active is not None:
        shares = [view.weights, *view.model_weights.values()]
        for name, d in view.domains.items():
            if name != active.name and any(split.get(name, 0) > 0 for split in shares):
                weighted[name] = Weighted(
                    target=target(d), answers={m: _model_answer(mv, now) for m, mv in d.models.items()}
                )
    return RouteIntent(
        fleet=view.fleet,
        revision=view.route_revision,
        active=target(active) if active is not None else None,
        standby=target(standby) if standby is not None else None,
        answers=answers,
        operation=view.operation.op_id if view.operation is not None else "",
        view_seq=view.seq,
        standbys=ranked,
        protection=ranking.protection(view, ranked) if active is not None else "",
        weights=dict(view.weights),
        model_weights={m: dict(w) for m, w in view.model_weights.items()},
        weighted=weighted,
    )


def changed(last: RouteIntent | None, new: RouteIntent) -> bool:
    """Whether `new` says something a router acts on that `last` did not (`view_seq` aside)."""
    if last is None:
        return True
    return _replace(last, view_seq=0) != _replace(new, view_seq=0)


def at(ri: RouteIntent, now: datetime) -> RouteIntent:
    """A published intent as of `now`: `for_ms` of warming answers recomputed from their `since`."""
    answers = ri.answers
    if ri.weighted:
        ri = _replace(ri, weighted={d: _replace(w, answers=_fresh(w.answers, now)) for d, w in ri.weighted.items()})
    if not any(a.answer == "warming" and a.since is not None for a in answers.values()):
        return ri
    return _replace(ri, answers=_fresh(answers, now))


def _fresh(answers: dict[str, Answer], now: datetime) -> dict[str, Answer]:
    fresh: dict[str, Answer] = {}
    for name, a in answers.items():
        if a.answer == "warming" and a.since is not None:
            a = _replace(a, for_ms=max(0, int((now - a.since).total_seconds() * 1000)))
        fresh[name] = a
    return fresh


def pointer_held(ri: RouteIntent, route_subject: str, subject: str | None, event: object) -> bool:
    """Whether the log still holds the route pointer `ri` names: the record now at stream sequence
    `ri.revision` (its `subject` and decoded `event`, None when the log holds nothing there) is a
    `route_moved` on the fleet's `route_subject` to `ri.active`. An intent that never routed (revision
    0, or no active domain) names no pointer. After a store forgot, the last surviving intent may name
    a `route_moved` the log lost or whose sequence now holds another event: a reader must not act on it."""
    if ri.revision == 0 or ri.active is None:
        return True
    return subject == route_subject and isinstance(event, RouteMoved) and event.active == ri.active.domain
