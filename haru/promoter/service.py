"""`haru promoter`: the imperative shell around the decider.

    await run_promoter(log, fleets=None, identity="promoter:host-a")

It starts from the fleets' views the projector stored in KV (`Promoter.resume`: no replay of history),
then follows the log (`log.follower(...)`, haru/log/follow.py: catch-up, stall detection, reconnect and
resume) and folds each fleet's events into its own `FleetView` with the one fold
(`haru.core.fold.Folder`, whose specification is `evolve`), so every decision is made on exactly the
events seen, with their sequences; it keeps the last sequence of every subject it folded, which is the
`expect` of every append it makes. An event that may not stand on its subject (`haru.core.authority`)
is not applied (the fold counts it as an anomaly) and is logged. It listens to heartbeats
(`haru.hb.*.*`, on the bus: haru/log/bus.py) and measures silence.

Each round, per fleet: `decide(view, facts)` -> appends, made in order with the expected sequence;
the next decision reads the view with the promoter's own acknowledged appends on it
(`FleetState.acked`), so it never decides on a view that lacks its own append, and never waits for
its follower to deliver what the acknowledgement already said (a round trip per decision at WAN
latency: docs/deploy.md). What it would decide right after an append is decided at once, on the view
with that append applied, and appended with it as one atomic batch (haru.promoter.chain): a step's
outcome with the next step's start, a promotion with its first step, a flip's start with its
route move.
A `step_started` it appended is a step it runs (in a task): the step's agent commands over
request/reply (or, for the flip, `route_moved` on the route subject with the route subject's real
last sequence as the expected one, provided the route has not moved since the operation's route
revision), then `step_completed`/`step_failed` appended with
expect = the `step_started`'s own sequence. A `Conflict` anywhere means another promoter wrote
first: nothing is retried blindly; the follower catches up and the decider decides again.

The steps themselves run in haru.promoter.runners; what the service knows of each fleet is a
`FleetState` (haru.promoter.fleets). Provisioning steps (`launch`, `down`: haru.promoter.provisioning)
run the `sky` CLI the command names (`haru promoter` reads `HARU_SKY`, default `sky`), with the
promoter's environment, where the secrets a domain's provision block names must be set.

`step_delay_ms` (tests and demos only; `haru promoter` reads `HARU_PROMOTER_STEP_DELAY_MS`) sleeps that
long after each `step_started` before the step runs, so a test can kill a promoter in the middle of any step.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable, Coroutine, Iterable
from datetime import timedelta
from functools import partial
from typing import Any, Literal

import msgspec
import structlog

from haru.core import causes, subjects
from haru.core.authority import misplaced
from haru.core.commands import Reply
from haru.core.errors import BatchUnsupported, Conflict, LogError
from haru.core.events import (
    Event,
    RouteMoved,
    StepCompleted,
    StepFailed,
    StepStarted,
    tag_of,
)
from haru.core.fold import Folder, empty, fleet_of
from haru.core.receipts import route_to_restore
from haru.core.saga import STEPS
from haru.core.views import OperationView, view_decoder
from haru.core.weights import report_decoder
from haru.host import alive
from haru.host.tasks import cancel_and_wait
from haru.log.bus import Msg
from haru.log.follow import Follower
from haru.log.receipts import RegressionCollector
from haru.log.record import Record, with_absolute_cause
from haru.log.requests import new_op_id
from haru.log.seam import Log
from haru.log.waiting import until_available
from haru.promoter.chain import Chain, extend
from haru.promoter.decider import decide
from haru.promoter.decisions import Append, Facts
from haru.promoter.drive import not_applicable
from haru.promoter.fleets import FleetState, StepRunner, first_standbys, utcnow
from haru.promoter.metrics import PromoterMetrics
from haru.promoter.provisioning import Provisioning
from haru.promoter.quorum import RECHECK_S, Isolation, Quorum, most_heard_ago, reaches_most
from haru.promoter.router_acks import RouterAcks
from haru.promoter.runners import StepRunners

log_ = structlog.get_logger("haru.promoter")

STALL_CHECK_S = 2.0
KNOWN_PEERS_S = 60.0  # the promoters heard within this long are the ones a replica knows (reaches_most)
# Promoters beat twice as often as the other roles: a verdict of silence waits for a beat of most of them
# after the silence began (promoter/liveness.py), so their interval is added to a failover's detection.
PEER_BEAT_S = 0.5


async def wait_event(event: asyncio.Event, timeout: float) -> None:
    """Wait for `event`, at most `timeout` seconds.

    Not `asyncio.wait_for(event.wait(), t)`: on Python 3.11 that can swallow a cancellation that
    arrives as the event fires (cpython#86296), and a promoter that ignores its cancellation never
    stops. `asyncio.timeout` does not.
    """
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()


def default_identity() -> str:
    return f"promoter:{socket.gethostname()}:{os.getpid()}"


class Promoter:
    """One promoter replica. Use `run()` (until cancelled) or `run_promoter(...)`."""

    def __init__(
        self,
        log: Log,
        *,
        fleets: Iterable[str] | None = None,
        identity: str | None = None,
        tick_s: float = 0.1,
        step_delay_ms: int = 0,
        sky: str = "sky",
        provisioning: Provisioning | None = None,
    ) -> None:
        self.log = log
        self.only = set(fleets) if fleets else None
        # The `by` of every event this replica appends: a restarted replica with the same identity
        # recognises its own unfinished step and re-runs it at once.
        self.identity = identity or log.writer or default_identity()
        self.tick_s = tick_s
        self.step_delay_ms = step_delay_ms
        self.fleets: dict[str, FleetState] = {}
        self.folded = 0
        self._changed = asyncio.Event()
        self._dirty: set[str] = set()  # fleets changed since their last round (`_due`)
        self._swept = 0.0  # when every fleet was last decided for
        self._advanced = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._making: set[str] = (
            set()
        )  # fleets whose decided appends are being made (a task each): not decided again until done
        self._listening_since = 0.0
        self._was_connected = True
        self.isolation = Isolation()
        # Whether to chain appends into atomic batches (haru.promoter.chain); off for good once the log
        # says it takes none (a stream without allow_atomic, a server older than 2.12).
        self.batches = True
        self.follower: Follower | None = None
        self._known_routes: dict[str, str] = {}  # fleet -> active domain, as folded before the log rewound
        self._refold_until = 0  # the stream's head when it was found rewound: no decisions until folded again
        # fleet -> the heartbeats heard (domain -> monotonic time), kept while a rewound log is folded again:
        # the fleets' states are made anew, what was heard on core NATS is still true
        self._heard_kept: dict[str, dict[str, float]] = {}
        self.peers = alive.Heard()  # promoters heard on haru.alive.promoter.*, this one included
        self.log_ = log_.bind(promoter=self.identity)
        self.metrics = PromoterMetrics(self)  # counted from the records folded below (metrics.py)
        guard = getattr(log, "receipt_guard", None)  # the JetStream log's (an in-memory log never forgets)
        if guard is not None:
            guard.record_as()  # a log that forgot what the promoter was acknowledged: log_regressed per fleet
            self.metrics.registry.register(RegressionCollector(guard))  # haru_log_regressions_total
        self.quorum = Quorum(self.log_)  # majority | minority: whether our appends reach a quorum (quorum.py)
        self.provisioning = provisioning or Provisioning(sky=sky)
        # STEPS[step].run -> the coroutine that executes such a step and returns its outcome event
        # (haru.promoter.runners; a new kind of step work registers its runner there).
        self.steps = StepRunners(
            log, identity=self.identity, provisioning=self.provisioning, wait_folded=self.wait_folded, logger=self.log_
        )
        self.runners: dict[str, StepRunner] = self.steps.table()
        # settle_old_active waits for the routers that follow the fleet first (haru.promoter.router_acks)
        self.router_acks = RouterAcks(self.log_)
        self.runners["settle"] = self.router_acks.settle(self.steps.agent)

    # ------------------------------------------------------------------------------- following

    def _state(self, fleet: str) -> FleetState:
        st = self.fleets.get(fleet)
        if st is None:
            st = self.fleets[fleet] = FleetState(folder=Folder(empty(fleet)), heard=self._heard_kept.pop(fleet, {}))
        return st

    def on_record(self, rec: Record) -> None:
        if rec.seq <= self.folded:
            return  # a redelivery after the follower was restarted
        if self.quorum.committed(rec.time_ns) and self.quorum.cut_off:  # committed after we lost the majority
            self._listen_afresh()
        fleet = fleet_of(rec.subject)
        if fleet and (self.only is None or fleet in self.only):
            st = self._state(fleet)
            if rec.seq > st.resumed_at:  # else already in the view this fleet was resumed from
                st.folded(rec.subject, rec.seq)
                if rec.event is not None:
                    st.folder.add(rec.event, seq=rec.seq, subject=rec.subject)
                    if st.folder.misplaced_seq == rec.seq:  # not applied (the subject is the authority): say so, once
                        self.log_.warning("misplaced_event", fleet=fleet, anomaly=st.view.last_anomaly)
                    else:
                        st.note(rec.event)
                        self.metrics.record(fleet, rec, st.view)  # a misplaced event counts for nothing
                self._touch(fleet)
        self.folded = rec.seq
        self._advanced.set()

    async def resume(self) -> int:
        """Start from what KV already holds instead of folding the whole log: each declared fleet's view as
        the projector stored it (`haru_views`, complete up to max(seq, checkpoint), the one fold both run),
        the last sequence of each of its subjects up to there (the `expect` of its appends), and what the
        promoter keeps beside the view, read from the fleet's declaration and operation subjects alone.
        Returns the last sequence folded: the follower goes on after it, and each fleet skips what its
        view already holds. A fleet without a readable stored view, or with one ahead of the stream (a cut
        store: `haru verify`), is folded from the start."""
        head = await self.log.last_seq()
        fleets = {fleet_of(subject) for subject in await self.log.subject_counts(f"{subjects.EVT}.*.decl")}
        fleets.discard("")
        resumed: dict[str, int] = {}
        for fleet in sorted(fleets):
            if self.only is not None and fleet not in self.only:
                continue
            got = await self.log.get_view(subjects.view_key(fleet))
            if got is None:
                resumed[fleet] = 0
                continue
            try:
                view = view_decoder.decode(got[0])
            except msgspec.DecodeError as exc:
                self.log_.warning(
                    "stored_view_unreadable", fleet=fleet, error=str(exc), detail="folding it from the start"
                )
                resumed[fleet] = 0
                continue
            upto = max(view.seq, view.checkpoint)
            if view.fleet != fleet or upto > head:
                self.log_.warning("stored_view_not_used", fleet=fleet, upto=upto, stream_last_seq=head)
                resumed[fleet] = 0
                continue
            st = self.fleets[fleet] = FleetState(folder=Folder(view), resumed_at=upto)
            for subject in await self.log.subject_counts(subjects.fleet_events(fleet)):
                seq = await self.log.last_seq_of(subject)
                if seq <= upto:  # a later one is in the tail the follower folds before any decision
                    st.last[subject] = seq
            for subject in (subjects.decl(fleet), subjects.op(fleet)):
                for rec in await self.log.history(subject):
                    if rec.seq <= upto and rec.event is not None and not misplaced(rec.subject, rec.event):
                        st.note(rec.event)
            resumed[fleet] = upto
        self.folded = min(resumed.values(), default=0)
        self.log_.info("promoter_resumed", from_seq=self.folded + 1, views=resumed, stream_last_seq=head)
        return self.folded

    async def wait_folded(self, seq: int, timeout: float = 10.0) -> None:
        """Until the follower has folded `seq` (our own append) or the bound passes."""
        deadline = time.monotonic() + timeout
        while self.folded < seq:
            self._advanced.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            await wait_event(self._advanced, left)

    def on_heartbeat(self, subject: str) -> None:
        heard = subjects.heartbeat_of(subject)
        if heard is None:
            return
        fleet, domain = heard
        st = self.fleets.get(fleet)
        if st is None:
            if fleet in self._heard_kept:  # folding again after a rewind: heard all the same
                self._heard_kept[fleet][domain] = time.monotonic()
            return
        first = domain not in st.heard or time.monotonic() - st.heard[domain] > 0.5
        st.heard[domain] = time.monotonic()
        if first or st.view.domains.get(domain) is not None and st.view.domains[domain].reachable is not True:
            self._touch(fleet)

    def on_canary_report(self, subject: str, data: bytes) -> None:
        """A gateway's counts of a fleet's weighted domains (haru.canary.<fleet>.<gateway>): kept for the
        fleet's canary window; the gateway is the one its subject names."""
        heard = subjects.canary_report_of(subject)
        if heard is None:
            return
        fleet, gateway = heard
        st = self.fleets.get(fleet)
        if st is None:
            return
        try:
            report = report_decoder.decode(data)
        except msgspec.DecodeError:
            self.log_.warning("canary_report_unreadable", fleet=fleet, gateway=gateway)
            return
        if report.fleet != fleet:  # the subject is the authority: a body about another fleet is not counted
            self.log_.warning("canary_report_misplaced", fleet=fleet, gateway=gateway, body_fleet=report.fleet)
            return
        st.reports.append((time.monotonic(), gateway, report))
        if any(c.errors for c in report.counts):
            self._touch(fleet)

    def _touch(self, fleet: str) -> None:
        """Something about `fleet` changed (a record folded, a heartbeat, a step ended): decide for it now."""
        self._dirty.add(fleet)
        self._changed.set()

    def _due(self) -> list[FleetState]:
        """The fleets to decide for in this pass: the changed ones, and every fleet once per `tick_s` (what
        depends on the clock: heartbeat silence, a step's lease, a degraded grace, a backoff). Deciding for
        every fleet on every change made a heartbeat cost a pass over all fleets: O(fleets) per heartbeat."""
        now = time.monotonic()
        if now - self._swept >= self.tick_s:
            self._swept = now
            due = [st for f, st in self.fleets.items() if f not in self._making]
        else:
            due = [self.fleets[f] for f in sorted(self._dirty) if f in self.fleets and f not in self._making]
        self._dirty.clear()  # a fleet being made is touched again when its appends are done
        return due

    # ------------------------------------------------------------------------------------ run

    async def run(self, ready: asyncio.Event | None = None) -> None:
        def hb(msg: Msg) -> None:
            self.on_heartbeat(msg.subject)

        sub = await self.log.bus.subscribe(subjects.heartbeats("*"), hb)

        def reported(msg: Msg) -> None:
            self.on_canary_report(msg.subject, msg.data)

        reports = await self.log.bus.subscribe(subjects.ALL_CANARY_REPORTS, reported)
        routers = await self.router_acks.listen(self.log.bus)
        await self.peers.listen(self.log.bus, subjects.alive("promoter"))
        self._listening_since = time.monotonic()
        follower: asyncio.Task | None = None
        # this replica's own heartbeat: a peer that hears it stop takes over its step (haru/host/alive.py)
        beating = asyncio.create_task(
            alive.beat(self.log.bus, "promoter", self.identity, interval=PEER_BEAT_S), name="promoter-alive"
        )
        try:

            async def resumed() -> int:  # `resume`, then the head the catch-up folds up to; anew on each try
                self.fleets.clear()
                await self.resume()
                return await self.log.last_seq()

            target = await until_available(
                resumed,
                on_retry=lambda exc: self.log_.warning("resume_retried", error=str(exc), detail="asking again"),
            )
            follower = asyncio.create_task(self._follow(), name="promoter-follow")
            while self.folded < target:
                self._advanced.clear()
                if follower.done():
                    follower.result()
                await wait_event(self._advanced, 1.0)
            self.log_.info("promoter_caught_up", seq=self.folded, fleets=sorted(self.fleets))
            if ready is not None:
                ready.set()
            while True:
                if follower.done():
                    follower.result()  # raises what stopped the follower (a bug: it restarts on log errors)
                    raise LogError("the promoter's log follower stopped")
                self._changed.clear()
                # Decide for every fleet due (pure, no await), then make the appends of each fleet that has
                # any in a task of its own: fleets are independent (their own subjects and expected
                # sequences), and one fleet's appends, each awaited until folded, must hold up neither
                # another fleet's decisions nor its failover (a pass that awaited every fleet's appends
                # kept a takeover waiting for the slowest fleet of the pass). A fleet whose appends are
                # being made is not decided for again until they are done (`_due`).
                for st in self._due() if self._connected() else ():
                    appends = self._decide(st)
                    if appends:
                        self._start_making(st, appends)
                await wait_event(self._changed, max(0.0, self._swept + self.tick_s - time.monotonic()))
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await reports.unsubscribe()
            with contextlib.suppress(Exception):
                await routers.unsubscribe()
            await self.peers.stop()
            await cancel_and_wait(beating, follower, *self._tasks)

    def _start_making(self, st: FleetState, appends: list[Append]) -> None:
        """Make a fleet's decided appends in a task; the fleet is decided for again once they are done.
        The expected sequences are the ones the decision saw, taken now: the task starts a loop turn
        later, and a record folded meanwhile (another replica's append) must make ours conflict, not
        pass on top of it (a decision made on a view that lacks it would, e.g., request a promotion
        twice)."""
        fleet = st.view.fleet
        expects = {a.subject: st.last.get(a.subject, 0) for a in appends}
        chain = self._chained(st, appends)
        self._making.add(fleet)
        task = asyncio.create_task(self._make_guarded(st, appends, expects, chain), name=f"make-{fleet}")
        self._tasks.add(task)

        def done(t: asyncio.Task, fleet: str = fleet) -> None:
            self._tasks.discard(t)
            self._making.discard(fleet)
            self._touch(fleet)

        task.add_done_callback(done)

    async def _make_guarded(
        self, st: FleetState, appends: list[Append], expects: dict[str, int] | None = None, chain: Chain | None = None
    ) -> None:
        try:
            if chain is not None and len(chain) > len(appends) and await self._make_chain(st, chain) != "refused":
                return
            await self._make(st, appends, expects)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must not stop every fleet: say it loudly, go on
            self.log_.exception("round_failed", fleet=st.view.fleet)

    async def _follow(self) -> None:
        """Follow the log from where the views are (haru.log.follow: catch-up, stall detection, reconnect
        and resume). A follower that stops delivering (after a store episode: appends timing out, a
        server restarted) would otherwise leave every later append conflicting with what it has not
        folded, and the operation in flight `running` for ever."""
        self.follower = self.log.follower(
            self.on_record,
            from_seq=self.folded + 1,
            name="promoter",
            stall_interval=STALL_CHECK_S,
            stall_checks=2,
            on_rewind=self._rewound,
        )
        await self.follower.run()

    def _connected(self) -> bool:
        """Whether NATS is connected; after a reconnect, silence is measured afresh (we heard nothing)."""
        connected = self.log.connected
        if connected and not self._was_connected:
            self._listen_afresh()
            self.log_.info("reconnected", detail="heartbeat silence is measured afresh (the follower replays afresh)")
        self._was_connected = connected
        return connected

    def _heard_most(self) -> bool:
        """Whether this replica hears most of the promoters it heard within `KNOWN_PEERS_S` (quorum.py)."""
        return reaches_most(
            len(self.peers.alive("promoter")), len(self.peers.alive("promoter", within_s=KNOWN_PEERS_S))
        )

    def _cut_off(self) -> bool:
        """Whether this replica is alone on its side of a cut (quorum.Isolation). It may have attempted no append
        (so never entered `minority`), yet the silence it measures is its own isolation all the same: it judges
        none until it hears most of the promoters it knew at the cut again, then measures silence afresh."""
        heard = len(self.peers.alive("promoter"))
        known = len(self.peers.alive("promoter", within_s=KNOWN_PEERS_S))
        verdict = self.isolation.judge(heard, known, time.monotonic())
        if verdict == "cut":
            self.quorum.unheard()
            self.log_.warning(
                "promoters_unheard",
                heard=heard,
                known=known,
                detail="this promoter hears too few of the promoters it knows: it may be the one cut off, so "
                "it judges no heartbeat silence until it hears most of them again",
            )
        elif verdict in ("back", "lapsed"):
            if verdict == "back":
                self.quorum.answered()  # most promoters heard again: a majority is within reach
            self._listen_afresh()
            self.log_.info(
                "promoters_heard_again" if verdict == "back" else "promoters_unheard_lapsed",
                detail="heartbeat silence is measured afresh"
                + (
                    ""
                    if verdict == "back"
                    else f" after {RECHECK_S:.0f} s without most promoters heard: they may be gone"
                ),
            )
        return verdict in ("cut", "still")

    def _listen_afresh(self) -> None:
        """Forget what was heard: silence is measured from now (after a reconnect, in and out of minority)."""
        self._listening_since = time.monotonic()
        for st in self.fleets.values():
            st.heard.clear()
        self._heard_kept.clear()
        self.peers.last.clear()  # nor did we hear our peers while away

    def facts(self, st: FleetState) -> Facts:
        # first: coming back from a cut measures silence afresh, and this decision must already see that
        cut_off = self._cut_off()
        now_m = time.monotonic()
        silent: dict[str, int | None] = {}
        for name in st.view.domains:
            seen = st.heard.get(name)
            silent[name] = None if seen is None else int((now_m - seen) * 1000)
        if self.quorum.state == "minority" and not self._heard_most():
            self.quorum.alone()
        if self.quorum.lapsed() and self.quorum.cut_off:
            self._listen_afresh()
        listening_ms = int((now_m - self._listening_since) * 1000)
        if self.quorum.state == "minority" or cut_off:  # silence we measure is our own isolation (quorum.py)
            silent, listening_ms = dict.fromkeys(silent), 0
        # silence measured since most promoters were last heard may be our own isolation (promoter/liveness.py)
        most_heard = most_heard_ago(self.peers.ages("promoter", within_s=KNOWN_PEERS_S))
        op = st.view.operation
        runner = st.step_by.get(op.op_id, "") if op is not None else ""
        runner_silent = self.peers.silent_s("promoter", runner) if runner else None
        now = utcnow()
        hour_ago = now - timedelta(hours=1)
        st.launches = [t for t in st.launches if t >= hour_ago]
        return Facts(
            now=now,
            launches_last_hour=len(st.launches),
            canary=st.canary_window(),
            me=self.identity,
            new_op_id=new_op_id(),
            silent_ms=silent,
            listening_ms=listening_ms,
            most_heard_ms=None if most_heard is None else int(most_heard * 1000),
            running=frozenset(st.running),
            step_by=runner,
            runner_silent_ms=None if runner_silent is None else int(runner_silent * 1000),
            runner_timeout_ms=int(alive.SILENT_AFTER_S * 1000),
        )

    def _rewound(self, head: int) -> int:
        """The log went back behind what was folded (haru/log/follow.py): fold every fleet again from
        sequence 1, decide nothing until that is done, and remember where each route pointer was, to
        put it back if the shorter log rewound it (`haru.core.receipts.route_to_restore`)."""
        self._known_routes.update({f: st.view.active for f, st in self.fleets.items() if st.view.active})
        self.log_.warning("log_rewound", folded=self.folded, stream_last_seq=head, routes=self._known_routes)
        # Heartbeats are not in the log: what was heard stays heard. Forgotten, every domain would count as
        # silent since this promoter started listening, and the first decision after the fold would fail
        # over a fleet whose domains are beating (a second flip after a partition healed).
        self._heard_kept = {f: st.heard for f, st in self.fleets.items()}
        self.fleets.clear()
        self.folded = 0
        self._refold_until = head
        return 0

    def _decide(self, st: FleetState) -> list[Append]:
        if self.folded < self._refold_until:
            return []  # folding again after a rewind: no decision from half a log
        known = self._known_routes.pop(st.view.fleet, "")
        restore = route_to_restore(st.view, known, at=utcnow()) if known else None
        if restore is not None:
            why = f"the event log forgot the route_moved to {known}: the promoter re-decides it"
            return [Append(subject=subjects.route(st.view.fleet), event=restore, why=why)]
        try:
            return decide(st.view, self.facts(st))
        except Exception:  # a bug in the core must not stop every fleet: say it loudly and go on
            self.log_.exception("decide_failed", fleet=st.view.fleet)
            return []

    # ----------------------------------------------------------------------------- chained appends

    def _chained(
        self, st: FleetState, appends: list[Append], *, expect: int | None = None, verdict: Reply | None = None
    ) -> Chain:
        """`appends`, and what the decider would append right after them, decided now on the view with them
        applied (haru.promoter.chain): one batch instead of one round trip each. `expect`: the first
        append's expected sequence when it is not its subject's folded tip (a step's own `step_started`).
        `verdict`: the verify_gpu reply the agent gave with the stop_training whose outcome is `appends`."""
        chain = Chain(st.view, st.last, me=self.identity)
        for i, a in enumerate(appends):
            chain.add(a.subject, a.event, a.why, expect=expect if i == 0 else None)
        if self.batches and self.folded >= self._refold_until:
            try:
                extend(chain, self.facts(st), own_probes=self.steps.own_probes, verdict=verdict, new_op_id=new_op_id)
            except Exception:  # a bug in the core: the chain stops where it is, its appends are still made
                self.log_.exception("decide_failed", fleet=st.view.fleet, detail="while chaining")
        return chain

    async def _make_chain(self, st: FleetState, chain: Chain) -> Literal["stored", "refused", "failed"]:
        """Append the chain as one atomic batch and run the steps it starts. `refused` when the log takes no
        batches or a subject moved (the caller makes its own appends one at a time, as before chaining);
        `failed` when the log did not answer (nothing was stored; the quorum's state is updated)."""
        fleet = st.view.fleet
        # The steps the batch starts count as running from now: the follower may deliver the batch before
        # its ack, and a started step of ours that is not running would be started again (drive._resume).
        st.running |= chain.started
        try:
            seqs = await self.log.append_batch(chain.appends(), expect=chain.expect)
        except (BatchUnsupported, Conflict, LogError, asyncio.CancelledError) as exc:
            st.running -= chain.started
            if isinstance(exc, asyncio.CancelledError):
                raise
            if isinstance(exc, BatchUnsupported):
                self.batches = False
                self.log_.warning("batches_unsupported", error=str(exc), detail="appending one event at a time")
                return "refused"
            if isinstance(exc, Conflict):
                self.log_.debug(
                    "batch_lost_race", fleet=fleet, subject=exc.subject, expected=exc.expected, current=exc.current
                )
                return "refused"
            if self.quorum.failed(exc, heard_most=self._heard_most()) and self.quorum.cut_off:
                self._listen_afresh()
            elif self.quorum.state == "majority":
                self.log_.warning("append_failed", fleet=fleet, error=str(exc), batch=len(chain))
            return "failed"
        if self.quorum.answered() and self.quorum.cut_off:
            self._listen_afresh()
        stored = []
        for seq, link in zip(seqs, chain.links, strict=True):
            event = with_absolute_cause(link.event, seq)
            self.log_.bind(fleet=fleet, event=tag_of(event), subject=link.subject).info(
                "appended", seq=seq, why=link.why, batch=len(chain), **_context(event)
            )
            st.acked(seq, link.subject, event)
            if isinstance(event, StepCompleted) and event.step == "probe":
                self.steps.own_probes.add(seq)
            elif isinstance(event, RouteMoved):
                self.steps.own_moves[event.op_id] = (seq, event.previous)
            stored.append(event)
        op = st.view.operation
        st.running -= chain.started  # each step to run is running again from its spawn, the others not at all
        for i in chain.to_run():
            started = stored[i]
            assert isinstance(started, StepStarted)
            if op is not None and op.op_id == started.op_id:
                self._spawn_step(st, op, started, seqs[i])
        return "stored"

    async def _make(self, st: FleetState, appends: list[Append], expects: dict[str, int] | None = None) -> None:
        """Make a round's appends, in order (each acknowledged before the next); stop at the first that loses a race.
        `expects`: each subject's last sequence when the appends were decided (default: now); our own
        append moves it."""
        if expects is None:
            expects = {a.subject: st.last.get(a.subject, 0) for a in appends}
        for a in appends:
            expect = expects[a.subject]
            event: Event = a.event if a.event.by else msgspec.structs.replace(a.event, by=self.identity)
            event = causes.with_cause(event, causes.decided_cause(st.view, event, st.last))
            log = self.log_.bind(fleet=st.view.fleet, event=tag_of(event), subject=a.subject)
            try:
                seq = await self.log.append(a.subject, event, expect=expect)
            except Conflict as exc:
                log.debug("append_lost_race", expected=expect, current=exc.current)
                if self.quorum.answered() and self.quorum.cut_off:
                    self._listen_afresh()
                return
            except LogError as exc:
                if self.quorum.failed(exc, heard_most=self._heard_most()) and self.quorum.cut_off:
                    self._listen_afresh()
                elif self.quorum.state == "majority":
                    log.warning("append_failed", error=str(exc))
                return
            if self.quorum.answered() and self.quorum.cut_off:
                self._listen_afresh()
            log.info("appended", seq=seq, why=a.why, **_context(event))
            expects[a.subject] = seq
            st.acked(seq, a.subject, event)  # decided on at once, not after the follower delivers it
            if isinstance(event, StepStarted):
                op = st.view.operation
                if op is not None and op.op_id == event.op_id:
                    self._spawn_step(st, op, event, seq)

    # ----------------------------------------------------------------------------- the steps

    def _spawn_step(self, st: FleetState, op: OperationView, started: StepStarted, seq: int) -> None:
        key = (op.op_id, started.step, started.attempt)
        st.running.add(key)
        task = asyncio.create_task(
            self._run_step(st, op, started.step, started.attempt, seq), name=f"step-{started.step}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_step(self, st: FleetState, op: OperationView, step: str, attempt: int, started_seq: int) -> None:
        fleet = st.view.fleet
        key = (op.op_id, step, attempt)
        log = self.log_.bind(fleet=fleet, op_id=op.op_id, step=step, attempt=attempt)
        try:
            if self.step_delay_ms:
                await asyncio.sleep(self.step_delay_ms / 1000)
            t0 = time.monotonic()
            runner = self.runners.get(STEPS[step].run) if step in STEPS else None
            event: StepCompleted | StepFailed
            skip = not_applicable(st.view, op, step)
            if skip:  # best effort, and known not to apply: not tried, not a failure
                event = StepCompleted(at=utcnow(), op_id=op.op_id, step=step, skipped=skip)  # type: ignore[arg-type]
            elif runner is None:
                event = StepFailed(
                    at=utcnow(),
                    op_id=op.op_id,
                    step=step,  # type: ignore[arg-type]
                    error_code="no_runner",
                    error=f"this promoter has no runner {STEPS[step].run if step in STEPS else step!r}",
                )
            else:
                event = await runner(st, op, step, started_seq)
                if isinstance(event, StepFailed):
                    skip = not_applicable(st.view, op, step)
                    if skip:  # it failed for a reason learned meanwhile (the GPU went while it ran)
                        event = StepCompleted(
                            at=event.at,
                            op_id=op.op_id,
                            step=step,  # type: ignore[arg-type]
                            took_ms=event.took_ms,
                            skipped=f"{skip} ({event.error or event.error_code})",
                        )
            if isinstance(event, (StepCompleted, StepFailed)) and not event.took_ms:
                event = msgspec.structs.replace(event, took_ms=int((time.monotonic() - t0) * 1000))
            event = msgspec.structs.replace(event, by=self.identity, cause=started_seq)
            outcome = Append(subject=subjects.op(fleet), event=event, why="the step's outcome")
            made: Literal["stored", "refused", "failed"] = "refused"
            verdict = self.steps.verdicts.pop(op.op_id, None)
            if fleet not in self._making:  # else a round's appends are being made: they and a chain would race
                chain = self._chained(st, [outcome], expect=started_seq, verdict=verdict)
                if len(chain) > 1:
                    self._making.add(fleet)
                    try:
                        made = await self._make_chain(st, chain)
                    finally:
                        self._making.discard(fleet)
            if made == "stored":
                log.info("step_" + ("completed" if isinstance(event, StepCompleted) else "failed"), batched=True)
                return
            if made == "failed":  # nothing stored: the step is ours and not running, so it is started again
                log.warning("step_outcome_unrecorded", outcome=tag_of(event), detail="the log did not answer")
                return
            try:
                seq = await self.log.append(subjects.op(fleet), event, expect=started_seq)
            except Conflict:
                log.warning(
                    "step_taken_over",
                    detail="the op subject moved past this step (another promoter re-started "
                    "it, or the operation was aborted): what was recorded stands",
                )
                return
            if step == "probe" and isinstance(event, StepCompleted):
                self.steps.own_probes.add(seq)
            log.info(
                "step_" + ("completed" if isinstance(event, StepCompleted) else "failed"), seq=seq, **_context(event)
            )
            st.acked(seq, subjects.op(fleet), event)  # the next step is decided at once (FleetState.view)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("step_crashed")
        finally:
            st.running.discard(key)
            self._touch(fleet)


def _context(event) -> dict:
    out = {}
    for name in ("op_id", "step", "target", "domain", "active", "error", "why", "attempt", "eligible"):
        value = getattr(event, name, None)
        if value not in (None, ""):
            out["reason" if name == "why" else name] = value
    return out


async def run_promoter(
    log: Log,
    *,
    fleets: Iterable[str] | None = None,
    identity: str | None = None,
    ready: asyncio.Event | None = None,
    tick_s: float = 0.1,
    metrics: tuple[str, int] | None = None,
    step_delay_ms: int = 0,
    sky: str = "sky",
    beside_standbys: Callable[[Callable[[], list[str]]], Coroutine[Any, Any, None]] | None = None,
) -> None:
    """Run one promoter replica on a connected, ensured log (`haru.log.seam.Log`) until cancelled.

    `fleets`: only these fleets (default: every fleet in the log). `identity`: this replica's writer
    id; give each replica a stable, unique one (e.g. `promoter:<host>`) so that after a restart it
    resumes its own unfinished step at once instead of waiting for the step's lease to run out.
    `ready` is set once the promoter has folded everything stored when it started. `metrics`:
    (host, port) to serve Prometheus metrics on (haru/promoter/metrics.py), None for none.
    `step_delay_ms`: a pause after each step starts (tests and demos: kill a promoter mid-step).
    `sky`: the `sky` CLI the provisioning steps run. `beside_standbys`: run beside the promoter with its
    `first_standbys` (`haru promoter --stream-leaders` keeps the streams' leaders there: haru/log/leaders.py).
    """
    from haru.host.metrics import maybe_serve

    promoter = Promoter(log, fleets=fleets, identity=identity, tick_s=tick_s, step_delay_ms=step_delay_ms, sky=sky)
    beside: asyncio.Task[None] | None = None
    if beside_standbys is not None:
        standbys = partial(first_standbys, promoter.fleets)
        beside = asyncio.create_task(beside_standbys(standbys), name="beside-standbys")
    try:
        async with maybe_serve([promoter.metrics.registry], metrics):
            await promoter.run(ready)
    finally:
        await cancel_and_wait(beside)
