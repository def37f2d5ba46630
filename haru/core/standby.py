"""How soon each side of a failover would serve again: the numbers the failover rules compare. Pure.

    reload_ms(policy, model)                  the active's own cold reload of a lost model (measured warm-up
                                              plus the restart backoff; 0 = not a cold reload, or never measured)
    standby_serves_in(view, standby, models)  the standby's wake and probe (measured, else estimated from
                                              the policy), and whether it was measured

The promoter's auto-failover (haru.promoter.health, "the faster path") fails the active at once when
the standby's figure beats the active's; the gateway's hold (haru.gateway.hold) reads the same
figures to decide how long a request waits, and for which domain. Both read them here, so the two can
never count differently.
"""

from __future__ import annotations

from haru.core.residency import Loading, Lost, Resident
from haru.core.specs import Policy
from haru.core.views import DomainView, FleetView, ModelView


def served(dv: DomainView) -> list[str]:
    """The models a domain serves: declared and not refused by the planner."""
    return [name for name, mv in dv.models.items() if mv.admitted is not False]


# A model lost for one of these comes back only by a cold reload (the agent restarts its runtime).

COLD_RELOAD: frozenset[str] = frozenset({"process_exited", "evicted", "unhealthy"})


def cold_reload(state: object) -> bool:
    """Lost for a cold-reload reason, or loading again after such a loss (a restart, attempt > 1)."""
    if isinstance(state, Lost):
        return state.reason in COLD_RELOAD
    return isinstance(state, Loading) and state.attempt > 1


def reload_ms(policy: Policy, mv: ModelView) -> int:
    """How long a model lost on the active takes to serve again there by itself, in ms (0: not a cold
    reload, or its warm-up was never measured): its measured warm-up (`ModelView.load_ms`), after the
    agent's restart backoff while it is still lost (the agent waits at least `restart_backoff_ms` before
    it starts the runtime again; a restart already loading has waited it out)."""
    state = mv.residency
    if not cold_reload(state) or not mv.load_ms:
        return 0
    return mv.load_ms + (policy.restart_backoff_ms if isinstance(state, Lost) else 0)


def reloading(view: FleetView) -> bool:
    dv = view.domains.get(view.active)
    return dv is not None and any(cold_reload(dv.models[m].residency) for m in served(dv))


def standby_serves_in(view: FleetView, standby: DomainView, models: list[str]) -> tuple[int, bool]:
    """How soon `standby` would serve `models` once promoted, in ms, and whether that was measured.
    Measured: each model's last wake and probe (`ModelView.wake_ms`, folded from the log). A model never
    woken yet is estimated from the policy: a resident one needs its probe alone (`probe_estimate_ms`),
    a sleeping one its declared VRAM at `wake_estimate_bytes_per_s` plus the probe. The figure is the
    slowest model's; it is measured only when every model's is."""
    policy = view.policy
    slowest, measured = 0, True
    for name in models:
        mv = standby.models.get(name)
        if mv is None:
            continue
        if mv.wake_ms:
            ms = mv.wake_ms
        else:
            measured = False
            ms = policy.probe_estimate_ms
            if not isinstance(mv.residency, Resident) and policy.wake_estimate_bytes_per_s:
                ms += mv.vram_bytes * 1000 // policy.wake_estimate_bytes_per_s
        slowest = max(slowest, ms)
    return slowest, measured
