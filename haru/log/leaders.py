"""Keep the streams' leaders on named NATS servers (`haru promoter --stream-leaders`).

Every append goes to its stream's leader. When the region that leads HARU_EVENTS is lost, nothing can
be appended until the regions left elect a new leader: nats-server's Raft followers wait 4-9 s
(randomized, not configurable) before they campaign, and a failover's first append, the verdict
`domain_unreachable`, waits with them. With the leaders on a server of a region that hosts no active
domain (the tie-breaker region of docs/deploy.md), losing an active's region never costs an election;
losing the leaders' own region costs one, but then nothing has to fail over.

Beside the standby is better still at WAN latency: the promoter there acts on a local leader, one round
trip an append instead of two. So the servers may be named per domain (`b=haru-nats-2`): the leaders then
go beside each fleet's first-ranked standby, which changes with every failover, and to the plainly named
servers when that one cannot take them (its region lost, or no standby has a server named).

JetStream puts a leader wherever an election lands it, so this puts it back: every `interval_s` it reads
each stream's leader and, when that is not the first wanted server that can lead, asks the leader to
step down in favour of it ($JS.API.STREAM.LEADER.STEPDOWN.<stream> with a `placement.preferred`,
nats-server 2.11+). A planned step-down hands over within a second, with
no election timeout to wait out. Several promoters may run it: a second request for a move already made
is refused by the server ("already leader") and changes nothing. The meta group's leader is not moved:
its step-down is an API of the system account, and losing it stops creating streams and consumers,
not appends.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from haru.core import subjects
from haru.core.errors import ConfigError

__all__ = ["STREAMS", "LeaderKeeper", "Placement", "leader_move", "parse_servers"]

_log = structlog.get_logger("haru.log.leaders")

# The streams on a failover's path: the events (every verdict, step and flip), the route intents and the views.
STREAMS = (subjects.EVENTS_STREAM, subjects.ROUTE_STREAM, f"KV_{subjects.VIEWS_BUCKET}")
INTERVAL_S = 5.0


@dataclass(frozen=True)
class Placement:
    """`--stream-leaders`: servers beside domains (`domain=server`), then servers named plainly."""

    beside: dict[str, str]
    fixed: list[str]

    def wanted(self, standbys: Sequence[str]) -> list[str]:
        """The servers to keep the leaders on, most preferred first: beside each of `standbys` (each
        fleet's first-ranked standby) that has one named, then the plain ones. Pure."""
        out = [self.beside[d] for d in standbys if d in self.beside] + self.fixed
        return list(dict.fromkeys(out))


def parse_servers(raw: str) -> Placement:
    """`--stream-leaders`: NATS server names (nats.conf's `server_name`), comma-separated, most preferred
    first; `domain=server` names the server beside a domain (used while that domain is its fleet's
    first-ranked standby)."""
    beside: dict[str, str] = {}
    fixed: list[str] = []
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        domain, eq, server = item.partition("=")
        if not eq:
            fixed.append(item)
        elif domain.strip() and server.strip():
            beside[domain.strip()] = server.strip()
        else:
            raise ConfigError(
                f"--stream-leaders: {item!r} is neither a server name nor domain=server "
                "(e.g. b=haru-nats-2,haru-nats-3)"
            )
    return Placement(beside, fixed)


def leader_move(leader: str, replicas: Sequence[tuple[str, bool, bool]], wanted: Sequence[str]) -> str:
    """The server to hand `leader`'s stream to ('' = leave it): the first of `wanted` that can lead now
    (`leader` itself, or one of `replicas` (name, current, offline) that is caught up and online), unless
    that is `leader` already or none can. Pure."""
    if not leader:
        return ""
    fit = {name for name, current, offline in replicas if current and not offline} | {leader}
    best = next((name for name in wanted if name in fit), "")
    return "" if best in ("", leader) else best


class LeaderKeeper:
    """The loop that keeps each of `streams`' leaders on one of `wanted` (see the module's docstring)."""

    def __init__(
        self,
        nc: Any,
        wanted: Sequence[str] | Callable[[], list[str]],
        *,
        streams: Sequence[str] = STREAMS,
        interval_s: float = INTERVAL_S,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self._wanted = wanted if callable(wanted) else (lambda fixed=list(wanted): fixed)
        self.streams = list(streams)
        self.interval_s = interval_s
        self.wanted: list[str] = []
        self.moves = 0  # step-downs the server accepted
        self._unknown: set[tuple[str, str]] = set()  # (stream, why) already said, so each is logged once

    async def run(self) -> None:
        while True:
            # first a pause: a step-down while the promoter beside it reads the log to start would only
            # make it wait (haru/log/waiting.py)
            await asyncio.sleep(self.interval_s)
            try:
                await self.check()
            except Exception as exc:  # noqa: BLE001 - a surprise must not end the keeping (logged, next pass)
                _log.error("leaders.check_crashed", error=repr(exc))

    async def check(self) -> list[tuple[str, str, str]]:
        """One pass: (stream, from, to) for each step-down the server accepted."""
        moved = []
        self.wanted = self._wanted()  # where the leaders belong now (beside the standbys of this moment)
        for stream in self.streams:
            try:
                info = await self.js.stream_info(stream)
            except Exception as exc:  # noqa: BLE001 - no leader, no stream yet, NATS away: next pass
                _log.debug("leaders.unread", stream=stream, error=repr(exc))
                continue
            cluster = info.cluster
            if cluster is None or not cluster.leader:
                continue  # a single server, or an election under way
            replicas = [(p.name, bool(p.current), bool(p.offline)) for p in cluster.replicas or []]
            to = leader_move(cluster.leader, replicas, self.wanted)
            if not to:
                self._say_unplaced(stream, cluster.leader, replicas)
                continue
            if await self._step_down(stream, cluster.leader, to):
                moved.append((stream, cluster.leader, to))
        return moved

    async def _step_down(self, stream: str, leader: str, to: str) -> bool:
        body = json.dumps({"placement": {"preferred": to}}).encode()
        try:
            reply = await self.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", body, timeout=5)
            answer = json.loads(reply.data or b"{}")
        except Exception as exc:  # noqa: BLE001 - a timeout or a refusal: said, and tried again next pass
            _log.warning("leaders.step_down_failed", stream=stream, leader=leader, to=to, error=repr(exc))
            return False
        error = answer.get("error")
        if error or not answer.get("success"):
            # "already leader": another promoter moved it a moment ago; anything else is the server's reason
            _log.info("leaders.step_down_refused", stream=stream, leader=leader, to=to, error=error)
            return False
        self.moves += 1
        _log.info("leaders.moved", stream=stream, leader=leader, to=to)
        return True

    def _say_unplaced(self, stream: str, leader: str, replicas: list[tuple[str, bool, bool]]) -> None:
        """Once per stream and reason: the leader is elsewhere and none of the named servers can take it."""
        if not self.wanted or leader in self.wanted:
            return
        names = {name for name, _, _ in replicas}
        if not any(name in names for name in self.wanted):
            why = (
                f"none of {', '.join(self.wanted)} is a replica of {stream} (replicas: {', '.join(sorted(names))}): "
                "name the servers by nats.conf's server_name"
            )
        else:
            why = f"none of {', '.join(self.wanted)} is a caught-up, online replica of {stream} now"
        if (stream, why) not in self._unknown:
            self._unknown.add((stream, why))
            _log.warning("leaders.unplaced", stream=stream, leader=leader, why=why)
