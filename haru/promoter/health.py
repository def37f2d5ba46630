"""The active's health, and whether a standby may replace it. Pure.

    health = active_health(view, now)   # ok | degraded (since when) | failed (why)
    why = standby_unfit(view, candidate, serving)   # '' when the candidate may be promoted

The active is failed when its domain is unreachable, a GPU hosting a served model is gone or a model
is lost `gpu_detached`, its agent signalled it is about to go (`signalled`), or a model is lost for a
reason whose recovery is a cold reload and the standby would serve sooner (`faster_path`, both figures
from haru.core.standby); other losses degrade it, and escalate to failed after `degraded_grace_ms`.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Literal

import msgspec

from haru.core import ranking
from haru.core.residency import Failed, Lost
from haru.core.standby import reload_ms, reloading, served, standby_serves_in
from haru.core.views import DomainView, FleetView, ModelView

Health = Literal["ok", "degraded", "failed"]


class ActiveHealth(msgspec.Struct, frozen=True, kw_only=True):
    health: Health
    reason: str = ""  # domain_unreachable | gpu_detached | degraded
    why: str = ""
    since: datetime | None = None


def active_health(view: FleetView, now: datetime) -> ActiveHealth:
    """Whether the active domain is ok, degraded (and since when), or failed (and why)."""
    dv = view.domains.get(view.active)
    if dv is None:
        return ActiveHealth(health="failed", reason="retired", why=f"active domain {view.active} is not declared")
    if dv.reachable is False:
        return ActiveHealth(
            health="failed",
            reason="domain_unreachable",
            why=f"{dv.name} unreachable (heartbeats silent)",
            since=dv.reachability_since,
        )
    signal = signalled(dv)  # about to go: move before it does
    if signal is not None:
        return signal
    hosting = {dv.models[m].gpu_index for m in served(dv)}
    for gpu in dv.gpus:
        if gpu.present is False and gpu.index in hosting:
            return ActiveHealth(
                health="failed",
                reason="gpu_detached",
                why=f"GPU {gpu.index} of {dv.name} detached",
                since=gpu.observed_at,
            )
    degraded_since: datetime | None = None
    why = ""
    for name in served(dv):
        state = dv.models[name].residency
        if isinstance(state, Lost) and state.reason == "gpu_detached":
            return ActiveHealth(
                health="failed", reason="gpu_detached", why=f"{name} on {dv.name} lost: gpu_detached", since=state.since
            )
        if isinstance(state, (Lost, Failed)):
            label = f"lost: {state.reason}" if isinstance(state, Lost) else "failed"
            since = state.since or now
            if degraded_since is None or since < degraded_since:
                degraded_since, why = since, f"{name} on {dv.name} {label}"
    if degraded_since is None and not reloading(view):
        return ActiveHealth(health="ok")
    faster = faster_path(view)  # a cold reload the standby beats: failed now, not after the grace
    if faster is not None:
        return faster
    if degraded_since is None:
        return ActiveHealth(health="ok")
    grace = timedelta(milliseconds=view.policy.degraded_grace_ms)
    if now - degraded_since >= grace:
        return ActiveHealth(
            health="failed",
            reason="degraded",
            why=f"{why} for over degraded_grace_ms ({view.policy.degraded_grace_ms} ms)",
            since=degraded_since,
        )
    return ActiveHealth(health="degraded", reason="degraded", why=why, since=degraded_since)


# --------------------------------------------------------------------------------- seeing it coming


def signalled(dv: DomainView) -> ActiveHealth | None:
    """A domain whose agent recorded a sign that it is about to go (`failure_signalled`: a provider's
    preemption notice, an NVML critical XID, ECC double-bit errors or pages pending retirement) is
    failed now, while it still serves: the promotion off it is planned, not a recovery. The request's
    reason is the signal's source, its cause the `failure_signalled` event."""
    if not dv.signalled:
        return None
    source = dv.signalled.split(":", 1)[0]
    return ActiveHealth(
        health="failed", reason=source, why=f"{dv.name} is about to go: {dv.signalled}", since=dv.signalled_at
    )


def faster_path(view: FleetView) -> ActiveHealth | None:
    """The active failed at once, with both figures in `why`, when models on it are lost for a reason
    whose recovery is a cold reload and the standby would serve sooner: its wake (and probe) against
    the active's measured warm-up (`ModelView.load_ms`, folded from the log). The standby's figure is
    its measured wake (`ModelView.wake_ms`), or, before it ever woke, an estimate from its declared
    sizes and the policy (`standby_serves_in`), said so in `why`. None when no such loss, the warm-up
    was never measured, or the standby is not faster (or not fit): the loss is then a degradation,
    failed after `degraded_grace_ms` as before."""
    dv = view.domains.get(view.active)
    candidate = view.standby()
    standby = view.domains.get(candidate)
    if dv is None or standby is None or standby_unfit(view, candidate, dv):
        return None
    slowest: tuple[int, str, ModelView] | None = None
    for name in served(dv):
        mv = dv.models[name]
        ms = reload_ms(view.policy, mv)
        if ms and (slowest is None or ms > slowest[0]):
            slowest = (ms, name, mv)
    if slowest is None:
        return None
    back_ms, name, mv = slowest
    state = mv.residency
    wanted = [m for m in served(dv) if m in standby.models]
    if not wanted:
        return None
    wake_ms, measured = standby_serves_in(view, standby, wanted)
    if wake_ms >= back_ms:
        return None
    how = (
        "measured wake and probe"
        if measured
        else f"ESTIMATED, no wake measured yet: declared VRAM at {view.policy.wake_estimate_bytes_per_s} B/s "
        f"plus a {view.policy.probe_estimate_ms} ms probe"
    )
    label = f"lost: {state.reason}" if isinstance(state, Lost) else "reloading"
    backoff = f" after the {back_ms - mv.load_ms} ms restart backoff" if back_ms > mv.load_ms else ""
    return ActiveHealth(
        health="failed",
        reason="faster_path",
        why=f"{name} on {dv.name} {label}; its cold reload takes {mv.load_ms} ms (measured warm-up){backoff} and "
        f"standby {candidate} serves after {wake_ms} ms ({how}): the faster path wins",
        since=state.since,
    )


def standby_unfit(view: FleetView, candidate: str, serving: DomainView | None) -> str:
    """Why `candidate` must not be promoted ('' = it may). `serving` is the domain it would replace.
    The fitness test is the ranking's (`haru.core.ranking.unfit`)."""
    dv = view.domains.get(candidate)
    if dv is None:
        if len(view.domains) == 1:
            return "a single-domain fleet: there is nothing to fail over to"
        return "no standby domain declared"
    return ranking.unfit(view, dv, serving)
