"""Keeps the gateway's routing table current: a KV watch on the fleet views, a subscription to
the route intents, and a follower of the route subjects themselves (`haru.evt.<fleet>.route`).
This is the only NATS traffic the chat path depends on, and it happens here, ahead of requests: a
request never waits for NATS.

The route intents come from the projector. A failover must not wait for it: the promoter's
`route_moved` on the route subject is the routing pointer itself, so the gateway follows that
subject too (only `route_moved` events, only on `haru.evt.<fleet>.route`, which is where the
subject table of haru/core/subjects.py allows them). When the log holds a newer route revision than the
last intent, the gateway routes by `intent_after_move`: the intent recomputed from the last view
with the pointer moved, and, when the move was made by an operation (which probed every model on
the target before the flip), the target's models answered `ready`. The projector's next intent
at that revision or later replaces it. So a failover reaches clients with the projector dead.

The route subjects are followed by `log.follow` (haru/log/follow.py: it resumes after the last route
record handled, and replays afresh when the connection comes back or it stalls). The gateway also
hears the control plane's heartbeats (`haru.alive.>` on the bus, haru/host/alive.py): /healthz reads
them to say whether a projector and a promoter are alive.

Each follower survives the log going away: it logs, waits (0.2 s doubling to 5 s) and watches
again, and the gateway keeps routing by the last state it saw meanwhile.

A watch can also go quiet without failing: nats-py's ordered consumers notice a restarted server
only after missing two idle heartbeats (~10-20 s), and give up for good if the server is still away
when they try to recover. So a resync loop checks every `resync_s`: when the connection came back
after being down, both watches are restarted at once (they deliver the current values first); and
for every known fleet the last intent and view are read, anything newer than what the watches
delivered is applied, and if a watch is still behind on the next check it is restarted.

The same check notices a log that went backwards (a store that lost power before it fsynced, or was
restored from an old backup): a route subject, intent or view now at a lower sequence than the one
the gateway holds, or at the same sequence with other content (`haru.core.receipts.reading`), is a
reset, never "older, ignore": what the log holds now is applied over what the gateway held (the
pointer it held is one the log forgot), the watches are restarted from the log's current state, and
`gateway.log_rewound` is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import msgspec
import structlog

from haru.core import subjects
from haru.core.authority import misplaced
from haru.core.errors import HaruError
from haru.core.events import RouteMoved
from haru.core.intents import intent as intent_of_view
from haru.core.intents import pointer_held
from haru.core.receipts import reading
from haru.core.record import Record
from haru.core.residency import Answer
from haru.core.restarts import Backoff
from haru.core.views import FleetView, RouteIntent, intent_decoder, view_decoder
from haru.gateway.metrics import GatewayMetrics
from haru.gateway.routing import RoutingTable
from haru.host import alive
from haru.host.tasks import cancel_and_wait
from haru.log.seam import Log

log = structlog.get_logger("haru.gateway")

_BACKOFF = Backoff(first_s=0.2, max_s=5.0)
_READY = Answer(answer="ready")
_ROUTES = f"{subjects.EVT}.*.route"  # every fleet's route subject


def route_fleet(subject: str) -> str:
    """The fleet of a route subject `haru.evt.<fleet>.route` ('' for any other subject)."""
    place = subjects.where(subject)
    return place.fleet if place is not None and place.kind == "route" else ""


def intent_after_move(
    view: FleetView | None, intent: RouteIntent | None, moved: RouteMoved, revision: int
) -> RouteIntent | None:
    """The intent a router should follow once the route subject says `moved` at `revision`, when the
    intent it holds is older: the view's intent with the pointer moved. None when it cannot be
    routed (no view, or the view does not know the target domain).

    A move made by an operation was preceded by that operation's probe of every model on the target,
    so those models answer `ready` (a stale view may still say they are asleep); models that can
    never fit stay `not_admitted`."""
    if view is None or moved.active not in view.domains:
        return None
    if intent is not None and intent.revision >= revision:
        return intent
    moved_view = msgspec.structs.replace(view, active=moved.active, route_revision=revision)
    out = intent_of_view(moved_view)
    if moved.op_id:
        answers = {m: (a if a.answer == "not_admitted" else _READY) for m, a in out.answers.items()}
        out = msgspec.structs.replace(out, answers=answers, operation="")
    return out


def names_forgotten_move(intent: RouteIntent, route_subject: str, last: Record | None) -> bool:
    """Whether `intent` points by a `route_moved` the log no longer holds, judged by `last`, the route
    subject's last record as the log has it now: the intent is ahead of it, or at its sequence with
    another move. An older intent is not: the newer move in the log patches it (`intent_after_move`)."""
    if intent.revision == 0 or intent.active is None:
        return False
    if last is None or intent.revision > last.seq:
        return True
    return intent.revision == last.seq and not pointer_held(intent, route_subject, last.subject, last.event)


class RouteFollower:
    """Two tasks (views, intents) applying what they see to `table`. An async context manager."""

    def __init__(
        self,
        events: Log,
        table: RoutingTable,
        metrics: GatewayMetrics,
        on_change: Callable[[str], None] | None = None,
        *,
        resync_s: float = 2.0,
    ) -> None:
        self.events = events
        self.table = table
        self.metrics = metrics
        self.on_change = on_change
        self.resync_s = resync_s
        self.views_seen = 0
        self.intents_seen = 0
        self.errors = 0
        self.restarts = 0
        self._view_revs: dict[str, int] = {}
        self._view_delivered: dict[str, int] = {}  # by the watch, not by a resync
        self._intent_delivered: dict[str, int] = {}
        self._moves: dict[str, tuple[int, RouteMoved]] = {}  # fleet -> the newest route_moved in the log
        # What the gateway holds, as (sequence or revision, body), to tell a log that went backwards.
        self._held: dict[tuple[str, str], tuple[int, bytes]] = {}  # (fleet, "route" | "intent" | "view")
        self._forgotten: dict[str, tuple[int, bytes]] = {}  # fleet -> the surviving intent that names a lost move
        self.rewinds = 0
        self._route_seq = 0  # the last route-subject sequence handled
        self.moves_seen = 0
        self.alive = alive.Heard()
        self._tasks: list[asyncio.Task[None]] = []
        self._resync_task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> RouteFollower:
        with contextlib.suppress(Exception):  # NATS away at start: /healthz says so, routing goes on
            await self.alive.listen(self.events.bus)
        self._start_watches()
        self._resync_task = asyncio.create_task(self._resync(), name="gateway-resync")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await cancel_and_wait(self._resync_task)
        self._resync_task = None
        await self._stop_watches()
        await self.alive.stop()

    def _start_watches(self) -> None:
        self._tasks = [
            asyncio.create_task(self._follow("views", self._views), name="gateway-views"),
            asyncio.create_task(self._follow("intents", self._intents), name="gateway-intents"),
            asyncio.create_task(self._follow("route moves", self._routes), name="gateway-routes"),
        ]

    async def _stop_watches(self) -> None:
        await cancel_and_wait(*self._tasks)
        self._tasks = []

    async def restart(self, why: str) -> None:
        self.restarts += 1
        log.warning("gateway.watch_restarted", why=why)
        await self._stop_watches()
        self._start_watches()

    async def _resync(self) -> None:
        was_connected = True
        behind: dict[tuple[str, str], int] = {}
        while True:
            await asyncio.sleep(self.resync_s)
            connected = self.events.connected
            if not connected:
                was_connected = False
                continue
            if not was_connected:
                was_connected = True
                behind.clear()
                if not self.alive.listening():
                    with contextlib.suppress(Exception):
                        await self.alive.listen(self.events.bus)
                await self.restart("the NATS connection came back")
                continue
            try:
                stuck = await self._catch_up(behind)
            except HaruError as exc:
                log.warning("gateway.resync_failed", error=str(exc))
                continue
            except Exception as exc:  # a surprise must not end the resync loop
                log.error("gateway.resync_crashed", error=repr(exc))
                continue
            if stuck:
                behind.clear()
                await self.restart(f"a watch did not deliver what the log holds: {', '.join(stuck)}")

    async def _catch_up(self, behind: dict[tuple[str, str], int]) -> list[str]:
        """Apply intents and views newer than the watches delivered; return what a watch left behind.

        `behind` holds, per (fleet, kind), the sequence found newer than the watch at the last
        check. A watch that has still not delivered it one check later is stuck.
        """
        stuck: list[str] = []
        for fleet in self.table.fleets():
            # Read once: what the log holds now, for the rewind check and the catch-up alike. What the gateway
            # held when the reads began is what they are checked against: a watch that delivers something
            # newer while they wait has not been rewound (a view rewritten every second was "rewound" so).
            held_before = {kind: self._held.get((fleet, kind)) for kind in ("route", "intent", "view")}
            last_move = await self.events.last(subjects.route(fleet))
            intent = await self.events.last_intent(fleet)
            view = await self.events.get_view(subjects.view_key(fleet))
            rewound = await self._rewound(fleet, last_move, intent, view, held_before)
            if rewound:
                self.rewinds += 1
                behind.clear()
                log.warning(
                    "gateway.log_rewound",
                    fleet=fleet,
                    what=rewound,
                    detail="the log went back behind what the gateway held: what it holds now is applied",
                )
                stuck += [f"{fleet} {what} (rewound)" for what in rewound]
                continue
            self._check(
                behind,
                stuck,
                fleet,
                "intent",
                intent,
                self._intent_delivered,
                lambda body, seq, fleet=fleet: self._apply_intent(
                    fleet, intent_decoder.decode(body), seq, body=(body, seq)
                ),
            )
            self._check(
                behind,
                stuck,
                fleet,
                "view",
                view,
                self._view_delivered,
                lambda body, rev, fleet=fleet: self._apply_view(fleet, view_decoder.decode(body), rev, body=body),
            )
            if last_move is not None and last_move.seq > self._route_seq:
                self.on_route_record(last_move)  # the follower will deliver it too: applying twice is a no-op
        return stuck

    async def _rewound(
        self,
        fleet: str,
        last: Record | None,
        got: tuple[bytes, int] | None,
        view: tuple[bytes, int] | None,
        held_before: dict[str, tuple[int, bytes] | None],
    ) -> list[str]:
        """What of `fleet` the log went back behind (route, intent, view), each already reset to what the
        log holds now (`last` route record, last intent, stored view). The route subject first: an intent
        is never patched by a move the log forgot. A kind whose held value changed since the reads began
        (`held_before`) is not judged: a watch delivered it after the read, and the next pass checks it."""

        def held_now(kind: str) -> tuple[int, bytes] | None:
            held = self._held.get((fleet, kind))
            return held if held == held_before.get(kind) else None

        found = []
        held = held_now("route")
        if held is not None:
            now = (last.seq, last.data) if last is not None else None
            if now is not None and now[0] > held[0]:
                at = await self.events.read_seq(held[0])  # moved on: but is what we hold still there?
                gone = at is None or at.data != held[1]
            else:
                gone = now is None or reading(held[0], held[1], now[0], now[1]) == "reset"
            if gone:
                found.append("route")
                self._moves.pop(fleet, None)
                self._held.pop((fleet, "route"), None)
                self._route_seq = await self.events.last_seq_matching(_ROUTES)  # the follower starts after it
                if last is not None:
                    self.on_route_record(last)
        held = held_now("intent")
        if held is not None:
            if got is None or reading(held[0], held[1], got[1], got[0]) == "reset":
                found.append("intent")
                self._intent_delivered[fleet] = got[1] if got is not None else 0
                self._held.pop((fleet, "intent"), None)
                with contextlib.suppress(msgspec.DecodeError):
                    intent = intent_decoder.decode(got[0]) if got is not None else None
                    if intent is not None and names_forgotten_move(intent, subjects.route(fleet), last):
                        # the intent that survived names a move the log lost: route by the log's last move
                        # (none: no route) until the projector publishes the intent of the route it holds now
                        log.warning("gateway.intent_forgotten", fleet=fleet, revision=intent.revision)
                        if got is not None:
                            self._forgotten[fleet] = (got[1], got[0])
                        routes = self.table.get(fleet)
                        moved = last.event if last is not None and isinstance(last.event, RouteMoved) else None
                        intent = (
                            None
                            if moved is None or last is None
                            else intent_after_move(routes.view if routes else None, None, moved, last.seq)
                        )
                    self._apply_intent(fleet, intent, got[1] if got is not None else 0, rewound=True, body=got)
        held = held_now("view")
        if held is not None and view is not None and reading(held[0], held[1], view[1], view[0]) == "reset":
            found.append("view")
            self._view_delivered[fleet] = view[1]
            with contextlib.suppress(msgspec.DecodeError):
                self._apply_view(fleet, view_decoder.decode(view[0]), view[1], rewound=True, body=view[0])
        return found

    @staticmethod
    def _check(
        behind: dict[tuple[str, str], int],
        stuck: list[str],
        fleet: str,
        kind: str,
        got: tuple[bytes, int] | None,
        delivered_by_watch: dict[str, int],
        apply,
    ) -> None:
        """One (fleet, kind): apply what the log holds beyond what the watch delivered, and call the
        watch stuck if it still has not delivered what the previous check found."""
        delivered = delivered_by_watch.get(fleet, 0)
        key = (fleet, kind)
        if key in behind and delivered < behind[key]:
            stuck.append(f"{fleet} {kind}")
        if got is not None and got[1] > delivered:
            behind[key] = got[1]
            with contextlib.suppress(msgspec.DecodeError):
                apply(got[0], got[1])
        else:
            behind.pop(key, None)

    async def _follow(self, what: str, watch: Callable[[], object]) -> None:
        failures = 0  # in a row
        while True:
            try:
                await watch()  # type: ignore[misc]
                failures = 0
            except asyncio.CancelledError:
                raise
            except HaruError as exc:
                self.errors += 1
                failures += 1
                log.warning("gateway.watch_failed", watching=what, error=str(exc), retry_in_s=_BACKOFF.delay(failures))
            except Exception as exc:  # a bug or a nats-py surprise: keep routing by what we have
                self.errors += 1
                failures += 1
                log.error("gateway.watch_crashed", watching=what, error=repr(exc), retry_in_s=_BACKOFF.delay(failures))
            await asyncio.sleep(_BACKOFF.delay(max(1, failures)))

    async def _views(self) -> None:
        async for key, data, rev in self.events.watch_views():
            fleet = key.removeprefix("fleet.")
            self._view_delivered[fleet] = max(rev, self._view_delivered.get(fleet, 0))
            if data is None:
                self.table.set_view(fleet, None)
                self._view_revs.pop(fleet, None)
                log.info("gateway.view_deleted", fleet=fleet)
                self.views_seen += 1
                self._changed(fleet, "view")
                continue
            try:
                view = view_decoder.decode(data)
            except msgspec.DecodeError as exc:
                self.errors += 1
                log.error("gateway.bad_view", fleet=fleet, error=str(exc))
                continue
            self._apply_view(fleet, view, rev, body=data)

    def _apply_view(self, fleet: str, view, rev: int, *, rewound: bool = False, body: bytes | None = None) -> None:
        if not rewound and rev < self._view_revs.get(fleet, 0):
            return
        if not self.table.set_view(fleet, view, rewound=rewound):
            return
        self._view_revs[fleet] = rev
        if body is not None:
            self._held[(fleet, "view")] = (rev, body)
        self.views_seen += 1
        self._changed(fleet, "view")
        self._apply_move(fleet)  # a view arriving after a move the intents have not caught up with

    @property
    def route_position(self) -> int:
        """The last route-subject sequence handled (or known to hold nothing newer for any fleet)."""
        return self._route_seq

    async def _routes(self) -> None:
        if not self._route_seq:
            self._route_seq = await self._last_moves()
        await self.events.follow(
            self.on_route_record,
            from_seq=self._route_seq + 1,
            subject_filter=_ROUTES,
            name="gateway-routes",
            on_rewind=self._routes_rewound,
        )

    def _routes_rewound(self, head: int) -> int:
        """The route subjects went back behind what was followed (haru/log/follow.py): read them again from
        the start (a few records a fleet), so each fleet's newest move is the one the log holds now."""
        self._moves.clear()
        for key in [k for k in self._held if k[1] == "route"]:
            del self._held[key]
        self._route_seq = 0
        return 0

    async def _last_moves(self) -> int:
        """At the first start: each fleet's last route record, instead of the route subjects' whole history
        (only the newest move of a fleet matters). Returns the route subjects' last sequence as it was
        before they were read: the follower goes on after it, so a move stored meanwhile is not missed
        (one read here too is a no-op the second time)."""
        head = await self.events.last_seq_matching(_ROUTES)
        for subject in sorted(await self.events.subject_counts(_ROUTES)):
            rec = await self.events.last(subject)
            if rec is not None:
                self.on_route_record(rec)
        return head

    def on_route_record(self, rec: Record) -> None:
        """A record of a route subject: keep the newest `route_moved` per fleet and route by it if the
        intents are behind. Anything else on a route subject is not a move (and not ours to judge)."""
        self._route_seq = max(self._route_seq, rec.seq)
        fleet = route_fleet(rec.subject)
        if not fleet or not isinstance(rec.event, RouteMoved) or misplaced(rec.subject, rec.event):
            return  # a move only as the authority table allows it (haru.core.authority), like every fold
        known = self._moves.get(fleet)
        if known is not None and known[0] >= rec.seq:
            return
        self._moves[fleet] = (rec.seq, rec.event)
        self._held[(fleet, "route")] = (rec.seq, rec.data)
        self.moves_seen += 1
        self._apply_move(fleet)

    def _apply_move(self, fleet: str) -> None:
        move = self._moves.get(fleet)
        routes = self.table.get(fleet)
        if move is None or routes is None:
            return
        seq, moved = move
        held = routes.intent
        if held is not None and held.revision >= seq:
            return
        moved_intent = intent_after_move(routes.view, held, moved, seq)
        if moved_intent is None or moved_intent is held:
            return
        before = routes.active
        if not self.table.set_intent(fleet, moved_intent, routes.intent_seq):
            return
        after = self.table.get(fleet)
        log.info(
            "gateway.route_moved",
            fleet=fleet,
            active=after.active if after else "",
            previous=before,
            revision=seq,
            source="route subject (the intents are behind)",
        )
        if moved.previous_silent:
            self._silence(fleet, moved.previous)
        self._changed(fleet, "route")

    def _silence(self, fleet: str, domain: str) -> None:
        """The move says the promoter had judged `domain` (the previous active) unreachable. The view that
        says so may come seconds later (the views have their own stream and leader, and a lost region may
        have led it), so the routes call it unreachable now: what is in flight there fails at the move
        (gateway/stranded.py) and is sent to the new active, instead of waiting on a cut link meanwhile."""
        routes = self.table.get(fleet)
        view = routes.view if routes is not None else None
        dv = view.domains.get(domain) if view is not None and domain else None
        if view is None or dv is None or dv.reachable is False:
            return
        silent = msgspec.structs.replace(dv, reachable=False)
        self.table.set_view(fleet, msgspec.structs.replace(view, domains={**view.domains, domain: silent}))
        log.info("gateway.silenced", fleet=fleet, domain=domain, by="the route move (ahead of the view)")

    async def _intents(self) -> None:
        async for fleet, data, seq in self.events.watch_intents("*"):
            if self._forgotten.get(fleet) == (seq, data):
                continue  # judged on the rewind: it names a move the log lost
            self._intent_delivered[fleet] = max(seq, self._intent_delivered.get(fleet, 0))
            try:
                intent = intent_decoder.decode(data)
            except msgspec.DecodeError as exc:
                self.errors += 1
                log.error("gateway.bad_intent", fleet=fleet, seq=seq, error=str(exc))
                continue
            self._apply_intent(fleet, intent, seq, body=(data, seq))

    def _apply_intent(
        self, fleet: str, intent, seq: int, *, rewound: bool = False, body: tuple[bytes, int] | None = None
    ) -> None:
        routes = self.table.get(fleet)
        before = routes.active if routes is not None else None
        move = self._moves.get(fleet)
        if move is not None and intent is not None and intent.revision < move[0]:
            # an intent from before the newest move (a projector catching up): keep the move
            patched = intent_after_move(routes.view if routes is not None else None, intent, move[1], move[0])
            intent = patched if patched is not None else intent
        if not self.table.set_intent(fleet, intent, seq, rewound=rewound):
            return
        if body is not None:
            self._held[(fleet, "intent")] = (body[1], body[0])
        self.intents_seen += 1
        after = self.table.get(fleet)
        if after is not None and after.active != before:
            log.info("gateway.route_moved", fleet=fleet, active=after.active, previous=before, revision=after.revision)
        self._changed(fleet, "intent")

    def _changed(self, fleet: str, kind: str) -> None:
        routes = self.table.get(fleet)
        if routes is None:
            self.metrics.forget(fleet)
        else:
            self.metrics.route(fleet, routes.revision, kind)
        if self.on_change is not None:
            self.on_change(fleet)
