"""The promotion decider: given a fleet's view and a few outside facts, what to append next. Pure.

No asyncio, nats or logging; time, ids and facts (heartbeat silence, which steps this process is
executing) arrive as arguments. The service (`haru.promoter.service`) folds the log into a
`FleetView`, calls `decide`, appends what it returns with expected sequences, and runs the step a
successful `step_started` append gave it. The sagas are data (haru.core.saga: `KINDS`, `STEPS`,
`TRANSITIONS`); this module only says who decides, in which order, each job in a module of its own:

1. liveness: heartbeat silence past `heartbeat_timeout_ms` -> `domain_unreachable`, heard again ->
   `domain_reachable` (`haru.promoter.liveness`);
1b. a canary whose probe failed or whose error rate the gateways reported over policy: its share goes
   back to the active (`weights_set`, with the evidence: haru.promoter.canary);
2. the operation in flight, if any: start its next step, re-start a step whose runner died (its lease
   ran out, or the runner was this promoter before a restart), or finish it;
3. with no operation in flight: the first route (no `route_moved` yet), auto-failover of a failed
   active (or `failover_declined`, once per distinct reason), and housekeeping: a recovered
   ineligible domain and an awake standby are demoted (asleep, training), unless it carries a share of
   traffic (a canary: haru.core.weights). A model whose runtime has
   no sleep mode (llama-server) is a standby resident, not an awake one; and a demotion that
   completed is never requested again while none of its inputs changed (`already_done`).

    haru.promoter.liveness      heartbeat silence -> domain_unreachable / domain_reachable
    haru.promoter.canary        a canary's rollback, the `weigh` step's check
    haru.promoter.drive         the operation in flight: its next step, a re-start, a cascade, its end
    haru.promoter.health        the active's health: ok, degraded, failed (and the faster path)
    haru.promoter.failover      auto-failover, its retries, the first route
    haru.promoter.housekeeping  teardown retries, auto-replace, demotions that keep a standby a standby
"""

from __future__ import annotations

from haru.core.events import DomainReachable
from haru.core.views import FleetView
from haru.promoter import adapter_gate, canary
from haru.promoter.decisions import Append, Facts
from haru.promoter.drive import drive
from haru.promoter.failover import failover, first_route
from haru.promoter.health import active_health
from haru.promoter.housekeeping import auto_replace, demotion, teardown_retry
from haru.promoter.liveness import judge_liveness

__all__ = ["decide", "next_operation"]


def decide(view: FleetView, facts: Facts) -> list[Append]:
    """Everything to append now: liveness verdicts, then at most one append on the op or route subject.

    The service appends them in order and decides again after its view has folded its own appends.
    """
    out: list[Append] = list(
        judge_liveness(view, facts.silent_ms, facts.listening_ms, facts.now, most_heard_ms=facts.most_heard_ms)
    )
    if not view.domains:
        return out
    if any(isinstance(a.event, DomainReachable) and a.event.domain == view.active for a in out):
        # We hear the active whose silence the view records (another promoter's verdict, perhaps one
        # held up by a partition): decide the rest on the view that has our verdict folded, next round.
        return out
    taken_back = canary.rollback(view, facts.canary, facts.now)  # its own subject: it races no operation
    if taken_back is not None:
        out.append(taken_back)
    out += adapter_gate.decide(view, facts.canary, facts.now)  # LoRA adapters' versions: the weights subject too
    if view.operation is not None and view.operation.state == "running":
        nxt = drive(view, view.operation, facts)
    else:
        nxt = next_operation(view, facts)
    if nxt is not None:
        out.append(nxt)
    return out


def next_operation(view: FleetView, facts: Facts) -> Append | None:
    """With no operation in flight: a failed teardown again, the first route, auto-failover, auto-replace,
    then demotions that keep the standby a standby."""
    retry = teardown_retry(view, facts)  # a host that may still be billed comes first, route or not
    if retry is not None:
        return retry
    if not view.active:
        return first_route(view, facts)
    health = active_health(view, facts.now)
    if health.health == "failed":
        return failover(view, health, facts)
    return auto_replace(view, facts) or demotion(view, facts)
