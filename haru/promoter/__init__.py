"""The promoter: a service that drives operations (promotions, demotions, rolling changes, weightings,
provisioning), auto-failover and liveness.

    from haru.promoter import Promoter, run_promoter
    await run_promoter(log, fleets=None, identity="promoter:host-a")

Its pure deciders: `decider` (`decide(view, facts)`: who decides what, in order), `drive` (the operation
in flight), `health` (the active's health, the faster path), `failover` (auto-failover, its retries,
the first route), `housekeeping` (teardown retries, auto-replace, demotions), `liveness` (heartbeat
silence), `canary` (a canary's rollback), `chain` (what it would decide right after an append, chained into the
same atomic batch). Its shell: `service` (follows the log, decides, appends),
`runners` (what executes each step), `fleets` (what it knows of each fleet), `provisioning` (the `sky`
runners), `metrics`.

What others read of the sagas is in the core (haru.core.saga: the tables; haru.core.standby: how soon
each side of a failover serves), and an operator's request is judged in the core (haru.core.requests,
haru.core.weighing) and appended by the log (haru.log.requests): the control API and `haru promote`
never import the promoter. See docs/promoter.md.
"""

from __future__ import annotations

from haru.promoter.decider import decide
from haru.promoter.decisions import Append, Facts
from haru.promoter.errors import OperationNotFound, PromoterError
from haru.promoter.service import Promoter, default_identity, run_promoter

__all__ = [
    "Append",
    "Facts",
    "OperationNotFound",
    "Promoter",
    "PromoterError",
    "decide",
    "default_identity",
    "run_promoter",
]
