"""Requests stranded on a domain the majority declared unreachable.

A partition does not close connections: a request forwarded to a domain whose region was cut off just
waits, for its response head (until HARU_CHAT_HEADER_TIMEOUT_MS, then a 504) or for the next chunk of its
stream (for ever). What settles it is the log: when the promoter writes `domain_unreachable` (the domain's
heartbeats went silent past the policy's timeout) and the view says so, the gateway fails every request
in flight to that domain's serving URLs at once. From there the paths a dead domain takes apply: a
request with no response byte sent yet is held and sent once to the new active, a stream is continued
there (gateway/hold.py, gateway/resume.py). A gateway cut off with the domain never hears the verdict and
keeps waiting on it, which is what routing by the last state seen means.

`stranded` is the pure part: which serving URLs became unreachable between two compiled routes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from haru.gateway.routing import base_url

if TYPE_CHECKING:
    from haru.gateway.routing import FleetRoutes

__all__ = ["judged_unreachable", "stranded"]


def judged_unreachable(routes: FleetRoutes | None, domain: str) -> bool:
    """Whether the view calls `domain` unreachable: a stream cut there is not continued there (a connection
    to it would only wait), but on the new active once the route moves."""
    if routes is None or routes.view is None:
        return False
    dv = routes.view.domains.get(domain)
    return dv is not None and dv.reachable is False


def stranded(old: FleetRoutes | None, new: FleetRoutes) -> dict[str, str]:
    """URL -> domain for each serving URL of a domain that `new`'s view calls unreachable and `old`'s
    did not (a reachable or not yet judged domain). Empty when nothing changed or there is no view."""
    if new.view is None:
        return {}
    before = old.view.domains if old is not None and old.view is not None else {}
    out: dict[str, str] = {}
    for name, dv in new.view.domains.items():
        if dv.reachable is not False:
            continue
        was = before.get(name)
        if was is not None and was.reachable is False:
            continue  # already judged unreachable: its requests were failed then
        urls = [dv.serving_url] + [mv.url for mv in dv.models.values()]
        for url in urls:
            if url:
                out[base_url(url)] = name
    return out
