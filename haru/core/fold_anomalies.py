"""The fleet fold's account of what is off: anomalies, and a declined failover's end. Pure.

`haru.core.fold` counts in `FleetView.anomalies` every event it cannot fold as written (an
illegal residency transition, an event about something not declared, a misplaced or undecodable
body), naming the last in `last_anomaly`; an anomaly about a model clears when that model's next
event folds legally. A declined failover stays on the view until the declined domain is healthy
again (`decline_over`). Used by the fold's handlers (`fold_declarations`, `fold_observations`,
`fold_operations`) and by `haru.core.fold` itself.
"""

from __future__ import annotations

from typing import Any

import msgspec

from haru.core import events as ev
from haru.core import receipts, residency
from haru.core.views import DomainView, FleetView

_replace = msgspec.structs.replace


def anomaly(view: FleetView, why: str, at: Any = None, about: str = "") -> FleetView:
    """One more anomaly: `why` names it, `at` is when it was observed, `about` what can clear it
    (`<domain>/<model>`; '' = nothing: a misplaced or undecodable body stays in the log)."""
    return _replace(
        view,
        anomalies=view.anomalies + 1,
        last_anomaly=why,
        last_anomaly_at=at if at is not None else view.updated_at,
        anomaly_about=about,
        anomaly_cleared_at=None,
    )


def anomaly_cleared(view: FleetView, about: str, at: Any) -> FleetView:
    """The open anomaly about `about` (a model) is over: its next event folded legally."""
    if view.anomaly_about != about or view.anomaly_cleared_at is not None:
        return view
    return _replace(view, anomaly_cleared_at=at)


def recovered(domain: DomainView) -> bool:
    """The domain would be a healthy active: heard from, its hosting GPUs present, no served model
    lost or failed (the promoter's `active_health` 'ok', without the clock)."""
    if domain.reachable is False:
        return False
    served = [m for m in domain.models.values() if m.admitted is not False]
    hosting = {m.gpu_index for m in served}
    if any(g.present is False and g.index in hosting for g in domain.gpus):
        return False
    return not any(isinstance(m.residency, (residency.Lost, residency.Failed)) for m in served)


def decline_over(view: FleetView, event: Any) -> FleetView:
    """A declined failover stays on screen while its cause lasts: an event about the declined domain
    that leaves it healthy clears it."""
    if not view.declined or getattr(event, "domain", None) != view.declined_domain:
        return view
    domain = view.domains.get(view.declined_domain)
    if domain is not None and not recovered(domain):
        return view
    return _replace(view, declined="", declined_at=None, declined_domain="")


def missing(view: FleetView, seq: int, tag: str, what: str, at: Any = None, about: str = "") -> FleetView:
    return anomaly(view, f"seq {seq}: {tag} for {what}, which is not declared", at, about)


def log_regressed(view: FleetView, event: ev.LogRegressed | ev.DomainLogRegressed, seq: int, subject: str) -> FleetView:
    """A writer found the log behind what it was acknowledged (`log_regressed` by the promoter,
    `domain_log_regressed` by a domain's agent): an anomaly naming the subjects and ranges lost. Only
    the ranges on subjects that writer may write are believed (`haru.core.receipts.in_scope`); the
    anomaly stays (nothing clears it: the events are gone)."""
    mine = [r for r in event.lost if receipts.in_scope(subject, r)]
    who = f"the agent of {event.domain}" if isinstance(event, ev.DomainLogRegressed) else "the promoter"
    if not mine:
        why = f"seq {seq}: {ev.tag_of(event)} by {who} names no subject it writes: not believed"
    else:
        why = f"seq {seq}: the event log lost acknowledged events ({who} noticed): {receipts.describe(mine)}"
    return anomaly(view, why, event.at)
