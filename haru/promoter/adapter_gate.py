"""The probe gate of LoRA adapters served at run time: which version of each adapter takes its traffic. Pure.

    appends = decide(view, tallies, now)   # at most one `adapter_routed` per adapter, on the weights subject

Read from the view (haru.core.adapters), for each adapter of a model the active domain serves:

- a version waiting for its probe (`pending`) is judged once the active domain's runtime holds it: its load
  failed or was refused (`failed`, `not_admitted`: the runtime's words) or its evaluation probe failed (the
  layout's `adapter_probes`, asked by the agent as it loaded it) -> `rolled_back`; it passed (or the adapter
  declares no probe) -> the adapter's first version serves at once (`probe_passed`), a later one goes out as a
  canary taking `policy.adapter_canary_percent` of the requests (`canary_started`);
- a canary is rolled back at once when its runtime drops or fails it, or when the gateways reported, within
  `canary_window_ms`, at least `canary_min_requests` requests to it with an error rate over
  `canary_max_error_rate`; after `adapter_canary_ms` holding it takes all the traffic (`promoted`), the version
  it replaced kept loaded as `previous`;
- a current version whose runtime failed it, or whose error rate fails the same test, is rolled back to
  `previous` (still loaded: no restart, no reload) when there is one.

A rollback only changes which runtime name the gateways send; the agents unload the version that no version
wants any more. Every decision carries its evidence in `detail`, for `haru why <base>:<adapter>`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from haru.core import subjects
from haru.core.adapters import AdapterView, pending, runtime_name
from haru.core.events import AdapterRouted
from haru.core.views import FleetView
from haru.core.weights import Tally
from haru.promoter.decisions import Append

__all__ = ["decide"]


def decide(view: FleetView, tallies: dict[str, dict[str, Tally]], now: datetime) -> list[Append]:
    active = view.active
    dv = view.domains.get(active) if active else None
    if dv is None:
        return []
    out: list[Append] = []
    for av in view.adapters.values():
        if av.model not in dv.models:
            continue
        routed = _judge(view, active, av, tallies, now)
        if routed is not None:
            out.append(Append(subject=subjects.weights(view.fleet), event=routed, why=routed.reason))
    return out


def _routed(
    av: AdapterView, now: datetime, reason: str, version: str, detail: str, cause: int = 0, **fields: Any
) -> AdapterRouted:
    state: dict[str, Any] = {"current": av.current, "canary": av.canary, "percent": av.percent, "previous": av.previous}
    state.update(fields)
    return AdapterRouted(
        at=now,
        model=av.model,
        adapter=av.adapter,
        reason=reason,
        version=version,
        detail=detail[:1000],
        cause=cause,
        **state,
    )


def _cause(av: AdapterView, domain: str, version: str) -> int:
    """The event a decision about `version` rests on: what `domain`'s runtime said of it, else its publication."""
    copy = av.copy(domain, version)
    if copy is not None and copy.seq:
        return copy.seq
    published = av.versions.get(version)
    return published.seq if published is not None else 0


def _runtime_says(av: AdapterView, domain: str, version: str) -> tuple[str, str]:
    """('ready' | 'wait' | 'failed', evidence) for `version` in `domain`'s runtime."""
    copy = av.copy(domain, version)
    if copy is None or copy.state == "loading":
        return "wait", ""
    if copy.state in ("failed", "not_admitted", "unloaded"):
        return "failed", f"the runtime on {domain} {copy.state.replace('_', ' ')} it: {copy.detail or copy.state}"
    if copy.probe == "failed":
        return "failed", f"its evaluation probe failed on {domain}: {copy.probe_detail}"
    how = f"its evaluation probe passed on {domain}: {copy.probe_detail}" if copy.probe == "passed" else ""
    return "ready", how or f"loaded and answering on {domain} (no evaluation probe declared)"


def _errors(view: FleetView, tallies: dict[str, dict[str, Tally]], domain: str, av: AdapterView, version: str) -> str:
    p = view.policy
    seen = tallies.get(domain, {}).get(runtime_name(av.model, av.adapter, version))
    if seen is None or seen.requests < max(1, p.canary_min_requests) or seen.error_rate <= p.canary_max_error_rate:
        return ""
    return (
        f"error rate {seen.error_rate:.1%} ({seen.errors} of {seen.requests} requests within canary_window_ms "
        f"{p.canary_window_ms} ms, reported by {', '.join(seen.gateways)}) is over canary_max_error_rate "
        f"{p.canary_max_error_rate:.1%}" + (f"; last error: {seen.last_error}" if seen.last_error else "")
    )


def _judge(
    view: FleetView, active: str, av: AdapterView, tallies: dict[str, dict[str, Tally]], now: datetime
) -> AdapterRouted | None:
    p = view.policy
    if av.canary:
        says, evidence = _runtime_says(av, active, av.canary)
        bad = evidence if says == "failed" else _errors(view, tallies, active, av, av.canary)
        if bad:
            return _routed(
                av,
                now,
                "rolled_back",
                av.canary,
                f"canary {av.canary}: {bad}",
                _cause(av, active, av.canary),
                canary="",
                percent=0,
            )
        since = av.change.at if av.change is not None else None
        if says == "ready" and since is not None and (now - since).total_seconds() * 1000 >= p.adapter_canary_ms:
            return _routed(
                av,
                now,
                "promoted",
                av.canary,
                f"canary {av.canary} held {p.adapter_canary_ms} ms at {av.percent}% with no failed probe and an "
                f"error rate within canary_max_error_rate; {evidence}",
                _cause(av, active, av.canary),
                current=av.canary,
                canary="",
                percent=0,
                previous=av.current,
            )
        return None
    v = pending(av)
    if v:
        says, evidence = _runtime_says(av, active, v)
        if says == "wait":
            return None
        if says == "failed":
            return _routed(av, now, "rolled_back", v, f"version {v} never served: {evidence}", _cause(av, active, v))
        if not av.current:
            return _routed(av, now, "probe_passed", v, evidence, _cause(av, active, v), current=v)
        return _routed(
            av, now, "canary_started", v, evidence, _cause(av, active, v), canary=v, percent=p.adapter_canary_percent
        )
    if av.current and av.previous:
        says, evidence = _runtime_says(av, active, av.current)
        bad = evidence if says == "failed" else _errors(view, tallies, active, av, av.current)
        if bad and _runtime_says(av, active, av.previous)[0] == "ready":
            return _routed(
                av,
                now,
                "rolled_back",
                av.current,
                f"version {av.current}: {bad}; back to {av.previous}",
                _cause(av, active, av.current),
                current=av.previous,
                previous="",
            )
    return None
