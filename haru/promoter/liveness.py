"""Liveness verdicts from heartbeat silence. Pure: the service measures silence, this judges it.

Agents publish `haru.hb.<fleet>.<domain>` every second on core NATS (not history). The promoter
turns silence past `policy.heartbeat_timeout_ms` into `domain_unreachable` and a heartbeat after
that into `domain_reachable`, appended on `haru.evt.<fleet>.<domain>.liveness` with the subject's
expected sequence, so replicas that reach the same verdict write it once.

A promoter that has listened for less than one heartbeat timeout gives no verdict of silence: it
cannot tell a silent domain from one it has not had time to hear.

Nor does one count silence it cannot vouch for. A promoter cut off with its region stops hearing the
domains and its peers in the same moment, and may reach a heartbeat timeout before it finds its peers
silent (heartbeats and the peers' beats come in their own phases; a loaded machine's event loop lags):
its verdict, appended once the cut heals, failed over a fleet whose active had served throughout. So the
silence that counts is the part heard while the promoter still heard most of the promoters it knows
(`most_heard_ms`: how long ago it last did; None when it knows fewer than three and cannot tell): a silent
domain is judged once its silence up to that moment reaches the timeout, a beat of the peers later than
before.
"""

from __future__ import annotations

from datetime import datetime

from haru.core import subjects
from haru.core.events import DomainReachable, DomainUnreachable
from haru.core.views import FleetView
from haru.promoter.decisions import Append


def judge_liveness(
    view: FleetView,
    silent_ms: dict[str, int | None],
    listening_ms: int,
    now: datetime,
    *,
    most_heard_ms: int | None = None,
) -> list[Append]:
    """The liveness appends due now."""
    timeout = view.policy.heartbeat_timeout_ms
    out: list[Append] = []
    for name, dv in view.domains.items():
        silent = silent_ms.get(name)
        heard = silent is not None and silent < timeout
        if heard and dv.reachable is not True:
            out.append(
                Append(
                    subject=subjects.liveness(view.fleet, name),
                    event=DomainReachable(at=now, domain=name),
                    why="heartbeats arrive",
                )
            )
        elif not heard and dv.reachable is not False and listening_ms >= timeout:
            waited = silent if silent is not None else listening_ms
            if most_heard_ms is not None and waited - most_heard_ms < timeout:
                continue  # silent for long enough only since the peers were last heard: no evidence yet
            out.append(
                Append(
                    subject=subjects.liveness(view.fleet, name),
                    event=DomainUnreachable(at=now, domain=name, silent_ms=waited),
                    why=f"no heartbeat for {waited} ms (heartbeat_timeout_ms {timeout})",
                )
            )
    return out
