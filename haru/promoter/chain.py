"""Appends chained into one atomic batch: what the promoter would append right after an append, decided at
once on the view with that append applied, so that a step's outcome, the next step's start and (before a
flip) the route move cost one round trip to a quorum instead of one each. Pure.

    chain = Chain(view, last, me="promoter:r3")
    chain.add(op_subject, step_completed, "every verb answered", expect=started_seq)
    extend(chain, facts, own_probes=..., verdict=reply, new_op_id=...)  # the next decisions, on `chain.view`
    await log.append_batch(chain.appends(), expect=chain.expect)

Why it is the same as appending one at a time: the decider is a function of the view and the facts, and
the service decides again as soon as its own append is acknowledged (haru.promoter.fleets: the view with
its acknowledged appends on it). Deciding on the view with the append applied before it is acknowledged
reads the same view, sooner. The batch is stored whole or not at all (JetStream's atomic batch, ADR-50),
with every subject's expected last sequence checked for all of it, so no event of the chain stands
without the ones it was decided on. A batch refused for a conflict is made again one append at a time,
which is what the service did before chaining. The one exception to "the same view, sooner" is what
arrives between an append and the next decision on core NATS, not in the log: a heartbeat. So a
liveness verdict ends a chain (`Chain.judged`): a heartbeat heard in the round after it stops a failover
that the silence alone would have started (a flapping link, a promoter that was itself the one cut off).

What a chained event cannot know is the sequence of an earlier event of its batch: its view carries
tentative sequences (`TENTATIVE` and up, above any real one), and a cause that names one is written
relative (-1: the record before this one: haru.core.record.with_absolute_cause). A decision that would
write a tentative sequence into a body ends the chain: the flip's `step_completed` names the route
revision, so the chain stops after the route move, and the flip runner completes the step once the
batch is stored (haru.promoter.runners: `own_moves`).
"""

from __future__ import annotations

from collections.abc import Callable, Set
from datetime import datetime

import msgspec

from haru.core import causes, subjects
from haru.core.commands import Reply
from haru.core.events import (
    DomainReachable,
    DomainUnreachable,
    Event,
    RouteMoved,
    StepCompleted,
    StepFailed,
    StepStarted,
)
from haru.core.fold import evolve
from haru.core.saga import STEPS, step_record
from haru.core.views import FleetView, OperationView
from haru.promoter.decider import decide
from haru.promoter.decisions import Facts
from haru.promoter.drive import flip_event, flip_refusal, step_outcome

__all__ = ["CHAIN_MAX", "TENTATIVE", "Chain", "Link", "extend"]

TENTATIVE = 1 << 52  # the sequences a chain's events take on its view until the batch is stored; never written
CHAIN_MAX = 8  # events in one batch at most (a failover's longest chain: outcome, liveness, start, route move)


class Link(msgspec.Struct, frozen=True):
    """One event of the chain, as it will be written: `by` set, a cause within the chain relative."""

    subject: str
    event: Event
    why: str


class Chain:
    """Events to append as one batch, each decided on the view with the ones before it applied."""

    def __init__(self, view: FleetView, last: dict[str, int], *, me: str) -> None:
        self.view = view  # with every event of the chain applied, at tentative sequences
        self.last = dict(last)  # subject -> its last sequence, tentative where the chain wrote it
        self.expect: dict[str, int] = {}  # subject -> its real last sequence before the chain: the batch's checks
        self.links: list[Link] = []
        self.me = me
        self.started: set[tuple[str, str, int]] = set()  # steps the chain starts, run once it is stored
        self.closed = False  # a route move was chained: what follows would name a tentative revision

    def __len__(self) -> int:
        return len(self.links)

    @property
    def full(self) -> bool:
        return self.closed or len(self.links) >= CHAIN_MAX

    def add(self, subject: str, event: Event, why: str, *, expect: int | None = None) -> None:
        """Chain `event` on `subject`: `by` and (where the decider's rule gives one) `cause` filled as the
        service fills them, applied to the view. `expect`: the subject's last sequence, when the caller
        knows it better than the folded tip (a step's outcome expects its own `step_started`)."""
        pos = len(self.links)
        if not event.by:
            event = msgspec.structs.replace(event, by=self.me)
        event = causes.with_cause(event, causes.decided_cause(self.view, event, self.last))
        self.expect.setdefault(subject, self.last.get(subject, 0) if expect is None else expect)
        seq = TENTATIVE + pos
        self.view = evolve(self.view, event, seq=seq, subject=subject)
        self.last[subject] = seq
        if event.cause >= TENTATIVE:  # an earlier event of this batch: its position, relative to this one
            event = msgspec.structs.replace(event, cause=event.cause - seq)
        if isinstance(event, StepStarted):
            self.started.add((event.op_id, event.step, event.attempt))
        elif isinstance(event, RouteMoved):
            self.closed = True
        self.links.append(Link(subject, event, why))

    def move_route(self, op: OperationView, now: datetime, own_probes: Set[int]) -> bool:
        """Chain the flip's route move right after its `step_started`, when the flip may be made now
        (`flip_refusal`), the route has not moved since the operation was decided, and the probe it
        relies on is this promoter's (in this chain, or one it appended: runners.StepRunners.own_probes).
        Returns whether it did; if not, the flip runs on its own once the batch is stored."""
        if flip_refusal(self.view, op) or self.view.route_revision != op.route_revision:
            return False
        probe = step_record(op, "probe")
        if probe is None or (probe.seq < TENTATIVE and probe.seq not in own_probes):
            return False
        route = subjects.route(self.view.fleet)
        moved = flip_event(self.view, op, self.me, now)
        self.add(
            route, moved, "the flip: probed in this operation", expect=max(self.last.get(route, 0), op.route_revision)
        )
        return True

    def judged(self) -> bool:
        """Whether the chain holds a liveness verdict. Nothing is chained after one: a verdict is stored and
        seen before anything is decided on it, as the decider itself waits a round after hearing an active
        it had judged silent. A domain's heartbeat arriving in that round (a link that flaps, a promoter
        that was the one cut off) then stops a failover that the silence alone would have started."""
        return any(isinstance(link.event, (DomainUnreachable, DomainReachable)) for link in self.links)

    def last_started(self) -> tuple[OperationView, str] | None:
        """(operation, step) when the chain's last event starts a step of the operation in flight, else None."""
        if not self.links:
            return None
        event = self.links[-1].event
        op = self.view.operation
        if isinstance(event, StepStarted) and event.step in STEPS and op is not None and op.op_id == event.op_id:
            return op, event.step
        return None

    def verified(self, op: OperationView, reply: Reply, now: datetime) -> None:
        """Chain the outcome of the verify_gpu step just started from the agent's reading of the GPUs made as
        its training stopped (`Command.then_verify`): that reply, in the same trip as stop_training's."""
        started = TENTATIVE + len(self.links) - 1
        outcome = step_outcome(op, "verify_gpu", [("verify_gpu", reply)], now=now, took_ms=reply.took_ms)
        if isinstance(outcome, StepCompleted):
            outcome = msgspec.structs.replace(outcome, detail=f"{outcome.detail} (read as training stopped)")
        self.add(
            subjects.op(self.view.fleet),
            msgspec.structs.replace(outcome, cause=started),
            "the GPUs read as training stopped",
        )

    def to_run(self) -> list[int]:
        """The positions of the `step_started`s whose step has no outcome in the chain: to be run once stored."""
        ended = {
            (link.event.op_id, link.event.step)
            for link in self.links
            if isinstance(link.event, (StepCompleted, StepFailed))
        }
        return [
            i
            for i, link in enumerate(self.links)
            if isinstance(link.event, StepStarted) and (link.event.op_id, link.event.step) not in ended
        ]

    def appends(self) -> list[tuple[str, Event]]:
        return [(link.subject, link.event) for link in self.links]


def extend(
    chain: Chain, facts: Facts, *, own_probes: Set[int], verdict: Reply | None, new_op_id: Callable[[], str]
) -> Chain:
    """Chain what the decider decides next, on the chain's view, until it decides nothing, a route move
    closes the chain, or it is full. A flip just started takes its route move (`move_route`); a verify_gpu
    just started takes the `verdict` stop_training's reply carried (`verified`). The facts are the ones of
    the decision the chain started from, with the chain's started steps running (this promoter runs them
    once the batch is stored) and a fresh op id for each decision (`new_op_id`)."""
    while not chain.full and not chain.judged():
        started = chain.last_started()
        if started is not None and started[1] == "flip":
            chain.move_route(started[0], facts.now, own_probes)
            break
        if started is not None and started[1] == "verify_gpu" and verdict is not None:
            chain.verified(started[0], verdict, facts.now)
            verdict = None
        facts = msgspec.structs.replace(
            facts,
            running=facts.running | chain.started,
            step_by=chain.me if chain.started else facts.step_by,
            new_op_id=new_op_id(),
        )
        more = decide(chain.view, facts)
        if not more:
            break
        for a in more[: CHAIN_MAX - len(chain)]:
            chain.add(a.subject, a.event, a.why)
    return chain
