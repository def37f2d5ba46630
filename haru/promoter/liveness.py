"""Liveness verdicts from heartbeat silence. Pure: the service measures silence, this judges it.

Agents publish `haru.hb.<fleet>.<domain>` every second on core NATS (not history). The promoter
turns silence past `policy.heartbeat_timeout_ms` into `domain_unreachable` and a heartbeat after
that into `domain_reachable`, appended on `haru.evt.<fleet>.<domain>.liveness` with the subject's
expected sequence, so replicas that reach the same verdict write it once.

A promoter that has listened for less than one heartbeat timeout gives no verdict of silence: it
cannot tell a silent domain from one it has not had time to hear.
"""

from __future__ import annotations

from datetime import datetime

from haru.core import subjects
from haru.core.events import DomainReachable, DomainUnreachable
from haru.core.views import FleetView
from haru.promoter.decisions import Append


def judge_liveness(view: FleetView, silent_ms: dict[str, int | None], listening_ms: int, now: datetime) -> list[Append]:
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
            out.append(
                Append(
                    subject=subjects.liveness(view.fleet, name),
                    event=DomainUnreachable(at=now, domain=name, silent_ms=waited),
                    why=f"no heartbeat for {waited} ms (heartbeat_timeout_ms {timeout})",
                )
            )
    return out
