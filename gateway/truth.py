"""What the gateway shows about residency: `GET /residency` (the whole truth table) and the `haru`
field of `GET /v1/models`. Pure: built from compiled routes and a `now` (epoch seconds).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec

from haru.core.residency import (
    Answer,
    Failed,
    Loading,
    Lost,
    NotAdmitted,
    Residency,
    Resident,
    Sleeping,
    Stopped,
    state_name,
)
from haru.core.sizes import format_gib
from haru.core.views import DomainView
from haru.gateway.routing import FleetRoutes, Forward, Refusal


def _for_ms(since: datetime | None, now: float) -> int | None:
    if since is None:
        return None
    return max(0, int((now - since.timestamp()) * 1000))


def _span(ms: int | None) -> str:
    if ms is None:
        return ""
    s = ms / 1000
    if s < 120:
        return f" for {s:.0f}s" if s >= 10 else f" for {s:.1f}s"
    if s < 7200:
        return f" for {s / 60:.0f}m"
    return f" for {s / 3600:.1f}h"


def describe_state(state: Residency, now: float) -> dict[str, Any]:
    """One model's residency as a JSON object: the state's own fields plus state, reason, for_ms, summary."""
    name = state_name(state)
    for_ms = _for_ms(state.since, now)
    reason = ""
    if isinstance(state, Lost):
        reason = state.reason
        summary = f"lost ({state.reason}{': ' + state.detail if state.detail else ''}){_span(for_ms)}"
    elif isinstance(state, Failed):
        reason = state.runtime_said
        summary = f"failed{_span(for_ms)}: runtime said {state.runtime_said!r}"
    elif isinstance(state, NotAdmitted):
        reason = f"short by {format_gib(state.short_by_bytes)}"
        summary = f"not admitted — short by {format_gib(state.short_by_bytes)}"
    elif isinstance(state, Loading):
        reason = f"attempt {state.attempt}" if state.attempt > 1 else ""
        summary = f"loading{_span(for_ms)}" + (f" (attempt {state.attempt})" if state.attempt > 1 else "")
    elif isinstance(state, Resident):
        summary = f"resident{_span(for_ms)}"
    elif isinstance(state, Sleeping):
        reason = f"level {state.level}"
        summary = f"sleeping (level {state.level}){_span(for_ms)}"
    elif isinstance(state, Stopped):
        reason = state.detail
        summary = f"stopped{_span(for_ms)}"
    elif name == "unknown":
        summary = "unknown (never probed)"
    else:
        summary = f"{name}{_span(for_ms)}"
    out: dict[str, Any] = msgspec.to_builtins(state)
    out.update(state=name, reason=reason, for_ms=for_ms, summary=summary)
    return out


def describe_answer(answer: Answer | None, now: float) -> dict[str, Any] | None:
    """A router answer with `for_ms` brought up to `now` when it carries `since`."""
    if answer is None:
        return None
    out: dict[str, Any] = msgspec.to_builtins(answer)
    if answer.since is not None and answer.answer == "warming":
        out["for_ms"] = max(answer.for_ms, _for_ms(answer.since, now) or 0)
    return out


def outcome(result: Forward | Refusal) -> dict[str, Any]:
    if isinstance(result, Forward):
        return {"routable": True, "status": 200, "code": None, "message": "", "domain": result.domain}
    return {
        "routable": False,
        "status": result.status,
        "code": result.code,
        "message": result.message,
        "retry_after": result.retry_after,
        "domain": result.domain,
    }


def model_ids(routes: FleetRoutes) -> list[str]:
    """Every model the fleet knows: declared ones first (the active domain's first), then intent-only ones."""
    ids = list(routes.declared)
    ids += [m for m in routes.entries if m not in routes.declared]
    return ids


def models_list(routes: FleetRoutes, now: float) -> dict[str, Any]:
    """`GET /v1/models`: OpenAI's list shape, plus a `haru` field per model with its router answer."""
    created = 0
    if routes.view is not None and routes.view.route_moved_at is not None:
        created = int(routes.view.route_moved_at.timestamp())
    answers = routes.intent.answers if routes.intent is not None else {}
    data = []
    for model in model_ids(routes):
        result = routes.resolve(model, now)
        haru = {
            "fleet": routes.fleet,
            "active": routes.active,
            "declared_on": routes.declared.get(model, []),
            "answer": describe_answer(answers.get(model), now),
            "route_revision": routes.revision,
        }
        haru.update(outcome(result))
        data.append(
            {"id": model, "object": "model", "created": created, "owned_by": f"haru/{routes.fleet}", "haru": haru}
        )
    return {"object": "list", "data": data}


def _domain(d: DomainView, routes: FleetRoutes, now: float) -> dict[str, Any]:
    is_active = d.name == routes.active
    answers = routes.intent.answers if routes.intent is not None and is_active else {}
    models = {}
    for mname, m in d.models.items():
        entry = {
            "slot": m.slot,
            "gpu_index": m.gpu_index,
            "runtime": m.runtime,
            "vram_bytes": m.vram_bytes,
            "admitted": m.admitted,
            "short_by_bytes": m.short_by_bytes,
            "residency": describe_state(m.residency, now),
        }
        if is_active:
            entry["answer"] = describe_answer(answers.get(mname), now)
            entry.update(outcome(routes.resolve(mname, now)))
        models[mname] = entry
    return {
        "active": is_active,
        "serving_url": d.serving_url,
        "serve": d.serve,
        "provider": d.provider,
        "region": d.region,
        "reachable": d.reachable,
        "reachability_for_ms": _for_ms(d.reachability_since, now),
        "eligible": d.eligible,
        "ineligible_why": d.ineligible_why,
        "agent": msgspec.to_builtins(d.agent),
        "gpus": msgspec.to_builtins(d.gpus),
        "models": models,
        "training": msgspec.to_builtins(d.training),
    }


def fleet_truth(routes: FleetRoutes, now: float) -> dict[str, Any]:
    view = routes.view
    out: dict[str, Any] = {
        "fleet": routes.fleet,
        "active": routes.active,
        "route_revision": routes.revision,
        "operation": routes.intent.operation if routes.intent is not None else "",
        "view_seq": view.seq if view is not None else 0,
        "updated_at": view.updated_at.isoformat() if view is not None and view.updated_at else None,
        "domains": {},
    }
    if view is not None:
        out["domains"] = {name: _domain(d, routes, now) for name, d in view.domains.items()}
    elif routes.intent is not None:  # no view yet: only the intent's answers are known
        out["domains"] = (
            {
                routes.active: {
                    "active": True,
                    "models": {
                        m: {"answer": describe_answer(a, now), **outcome(routes.resolve(m, now))}
                        for m, a in routes.intent.answers.items()
                    },
                }
            }
            if routes.active
            else {}
        )
    return out


def truth_table(all_routes: list[FleetRoutes], now: float) -> dict[str, Any]:
    """`GET /residency`: every fleet, every domain, every model: state, reason, for how long, answer."""
    return {
        "at": datetime.fromtimestamp(now, UTC).isoformat(),
        "fleets": {r.fleet: fleet_truth(r, now) for r in all_routes},
    }
