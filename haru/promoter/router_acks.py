"""The old active waits for the routers: before `settle_old_active` puts it to sleep, every router known to
follow the fleet has applied the new route revision, or is gone, or `router_ack_timeout_ms` has passed.

Routers that are not Haru's gateway (HAProxy, nginx, Envoy, an operator's command, driven by
`haru route follow`) report on `haru.router.<fleet>.<router>` what they applied (haru.core.router_acks).
A router still sending to the old active when it sleeps sends requests to a paused engine; so the settle
step's runner (`settle` in haru.core.saga.STEPS) first waits here, then sends the step's agent verbs, and
records which routers it waited for and how long in the step's detail.

A promoter that has just started has not heard every router yet: it waits until it has listened for
`GONE_MIN_S` (a live router reports at least that often) before it calls the routers it knows all of them.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import structlog

from haru.core import router_acks as acks
from haru.core import subjects
from haru.core.events import StepCompleted, StepFailed
from haru.core.views import OperationView
from haru.log.bus import Bus, Msg, Subscription
from haru.promoter.drive import command_for
from haru.promoter.fleets import FleetState, StepRunner

__all__ = ["RouterAcks"]


class RouterAcks:
    """What the routers of every fleet said they applied, as heard by this promoter."""

    def __init__(self, logger: structlog.typing.FilteringBoundLogger) -> None:
        self.books: dict[str, dict[str, acks.Heard]] = {}
        self.logger = logger
        self.listening_since = time.monotonic()
        self._heard = asyncio.Event()

    async def listen(self, bus: Bus) -> Subscription:
        sub = await bus.subscribe(subjects.ALL_ROUTER_REPORTS, self.on_report)
        self.listening_since = time.monotonic()
        return sub

    def on_report(self, msg: Msg) -> None:
        heard = subjects.router_report_of(msg.subject)
        if heard is None:
            return
        fleet, router = heard
        try:
            report = acks.report_decoder.decode(msg.data)
        except msgspec.DecodeError:
            self.logger.warning("router_report_unreadable", fleet=fleet, router=router)
            return
        book, why = acks.heard(self.books.get(fleet, {}), fleet, router, report, time.monotonic())
        if why:
            self.logger.warning("router_report_misplaced", fleet=fleet, router=router, why=why)
            return
        self.books[fleet] = book
        self._heard.set()

    async def wait(self, fleet: str, revision: int, bound_s: float) -> tuple[str, float]:
        """Until every router of `fleet` heard has applied `revision` (or is gone), at most `bound_s`:
        (what the step records, seconds waited)."""
        t0 = time.monotonic()
        while True:
            now = time.monotonic()
            w = acks.waiting(self.books.get(fleet, {}), revision, now)
            listened = now - self.listening_since >= acks.GONE_MIN_S
            waited = now - t0
            if (listened and not w.behind) or waited >= bound_s:
                timeout = bool(w.behind) or not listened
                return acks.describe(w, waited, timeout=timeout and waited >= bound_s), waited
            self._heard.clear()
            try:
                async with asyncio.timeout(min(0.25, max(0.01, bound_s - waited))):
                    await self._heard.wait()
            except TimeoutError:
                pass

    def settle(self, agent: StepRunner) -> StepRunner:
        """The runner of `settle_old_active`: wait for the routers, then the step's agent verbs."""

        async def run(st: FleetState, op: OperationView, step: str, started_seq: int) -> StepCompleted | StepFailed:
            if not command_for(st.view, op, step)[0]:  # no old active (the first route): nobody to spare
                return await agent(st, op, step, started_seq)
            bound_s = st.view.policy.router_ack_timeout_ms / 1000
            said, waited = await self.wait(st.view.fleet, st.view.route_revision, bound_s)
            self.logger.info(
                "settle_waited_for_routers", fleet=st.view.fleet, op_id=op.op_id, waited_s=round(waited, 3), said=said
            )
            outcome = await agent(st, op, step, started_seq)
            if isinstance(outcome, StepCompleted):
                detail = f"{said}; {outcome.detail}" if outcome.detail else said
                return msgspec.structs.replace(outcome, detail=detail)
            return msgspec.structs.replace(outcome, error=f"{outcome.error} ({said})")

        return run
