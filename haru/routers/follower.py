"""`haru route follow`: keep a router's upstreams on the fleet's route, and say what was applied.

    async with Follower(log, "default", "edge-1", HAProxy(...)) as f:
        await f.run()            # until cancelled

The follower reads the fleet's last route intent on start and every new one after it (`RouteWatcher`:
the last intent, then the subject live; a NATS outage is survived by nats-py's reconnect, and the watcher
re-reads the last intent when the subscription went quiet). For each intent it applies the plan
(`haru.core.router_plans.plan`) to its router (`haru.routers.seam.RouterTarget`); a plan the router did not
take is tried again with backoff (`backoff_s`, doubling to `backoff_max_s`), and every `resync_s` the
current plan is applied again (a router restarted since forgets the runtime API's changes), as it is
when the NATS connection comes back.

It reports on `haru.router.<fleet>.<router>` (`haru.core.router_acks.RouterReport`) at once after each
apply or failure, and every `interval_s` besides: the revision it applied, the newest it has read, the
error when they differ, and what the router cannot follow. That report is the acknowledgement the
promoter waits for before it puts the old active to sleep, and its silence is how "gone" is told.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from datetime import UTC, datetime

import msgspec
import structlog

from haru.core import subjects
from haru.core.router_acks import RouterReport
from haru.core.router_plans import Plan, plan
from haru.core.views import RouteIntent
from haru.host.tasks import cancel_and_wait
from haru.log.bus import Msg
from haru.log.route import RouteWatcher
from haru.log.seam import Log
from haru.routers.errors import NotApplied
from haru.routers.seam import RouterTarget

__all__ = ["Follower"]

_log = structlog.get_logger("haru.routers")
_encode = msgspec.json.Encoder().encode


class Follower:
    def __init__(
        self,
        log: Log,
        fleet: str,
        router: str,
        target: RouterTarget,
        *,
        interval_s: float = 1.0,
        resync_s: float = 30.0,
        backoff_s: float = 0.5,
        backoff_max_s: float = 10.0,
    ) -> None:
        self.log = log
        self.fleet = subjects.check_name("fleet", fleet)
        self.router = subjects.check_name("router", router)
        self.subject = subjects.router_report(fleet, router)
        self.target = target
        self.interval_s = interval_s
        self.resync_s = resync_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.applied: Plan | None = None  # the last plan the router took
        self.applied_seq = -1  # the intent sequence it came from (-1: none yet)
        self.applied_at: datetime | None = None
        self.wanted = 0  # route revision of the newest intent read
        self.error = ""
        self.applies = 0  # plans the router took (counting resyncs)
        self.failures = 0
        self._again = asyncio.Event()  # apply the current plan again (NATS came back)
        self.watcher: RouteWatcher | None = None

    def state(self) -> str:
        """One line: what it applied, what it has read, its last error (for logs and failed waits)."""
        held = f"revision {self.applied.revision} (intent {self.applied_seq})" if self.applied else "nothing"
        read = f"intent {self.watcher.seq}" if self.watcher is not None else "no intent"
        return f"applied {held}; read {read} (revision {self.wanted}); {self.applies} applies, error {self.error!r}"

    # ---------------------------------------------------------------------------------- report

    def report(self) -> RouterReport:
        notes = list(self.applied.notes) if self.applied else []
        notes += list(getattr(self.target, "notes", ()))
        return RouterReport(
            fleet=self.fleet,
            router=self.router,
            kind=self.target.kind,
            revision=self.applied.revision if self.applied else 0,
            seq=self.applied.seq if self.applied else 0,
            active=self.applied.active if self.applied else "",
            wanted=self.wanted,
            error=self.error,
            notes=notes,
            interval_ms=int(self.interval_s * 1000),
            applied_at=self.applied_at,
            at=datetime.now(UTC),
        )

    async def publish_report(self) -> None:
        try:
            await self.log.bus.publish(self.subject, _encode(self.report()))
        except Exception as exc:  # NATS away: the next one goes when it is back
            _log.debug("router_report_not_sent", fleet=self.fleet, router=self.router, error=str(exc))

    async def _asked(self, msg: Msg) -> None:
        await self.publish_report()

    async def _reporting(self) -> None:
        while True:
            await self.publish_report()
            await asyncio.sleep(self.interval_s)

    # ----------------------------------------------------------------------------------- apply

    async def _apply(self, ri: RouteIntent, seq: int, body: bytes, *, again: bool) -> bool:
        p = plan(ri, seq)
        self.wanted = ri.revision
        t0 = time.monotonic()
        try:
            await self.target.apply(p, body, again=again)
        except NotApplied as exc:
            self.error = str(exc)
            self.failures += 1
            _log.warning(
                "route_not_applied", fleet=self.fleet, router=self.router, revision=ri.revision, error=str(exc)
            )
            await self.publish_report()
            return False
        first = self.applied_seq != seq
        self.applied, self.applied_seq, self.error = p, seq, ""
        self.applied_at = datetime.now(UTC)
        self.applies += 1
        await self.publish_report()
        if first:
            _log.info(
                "route_applied",
                fleet=self.fleet,
                router=self.router,
                revision=ri.revision,
                active=p.active,
                upstreams=[f"{u.domain}={u.host}:{u.port}x{u.weight}" for u in p.upstreams],
                took_ms=round((time.monotonic() - t0) * 1000, 1),
                cannot=list(p.notes),
            )
        return True

    async def run(self, ready: asyncio.Event | None = None) -> None:
        """Follow until cancelled. `ready` is set once the first intent (if any) was tried."""

        def on_link(up: bool) -> None:
            if up:
                self._again.set()

        forget = self.log.on_link_change(on_link)
        reporting = asyncio.create_task(self._reporting(), name=f"router-report-{self.router}")
        # `haru status` asks every follower of the fleet to report at once (haru.log.router_reports)
        asked = await self.log.bus.subscribe(subjects.routers_ask(self.fleet), self._asked)
        try:
            async with RouteWatcher(self.log, self.fleet, writer=f"router:{self.router}") as w:
                self.watcher = w
                await self._loop(w, ready)
        finally:
            forget()
            with contextlib.suppress(Exception):
                await asked.unsubscribe()
            await cancel_and_wait(reporting)

    async def _loop(self, w: RouteWatcher, ready: asyncio.Event | None) -> None:
        backoff = self.backoff_s
        next_try = 0.0  # monotonic time of the next apply of the current plan (a retry or a resync)
        while True:
            ri, seq = w.current, w.seq
            if ri is not None and (seq != self.applied_seq or self._again.is_set() or time.monotonic() >= next_try):
                self._again.clear()
                body = _encode(ri)
                if await self._apply(ri, seq, body, again=seq == self.applied_seq):
                    backoff = self.backoff_s
                    next_try = time.monotonic() + self.resync_s
                else:
                    next_try = time.monotonic() + backoff
                    backoff = min(self.backoff_max_s, backoff * 2)
            if ready is not None:
                ready.set()
            wait = max(0.0, next_try - time.monotonic()) if ri is not None else self.resync_s
            seen = seq  # what this pass read: an intent that arrived while it applied ends the wait at once
            again_wait = asyncio.create_task(self._again.wait())
            changed = asyncio.create_task(w.wait_for(functools.partial(_moved, w, seen), wait + 1.0))
            try:
                await asyncio.wait({again_wait, changed}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if changed.done() and not changed.cancelled():
                    exc = changed.exception()
                    if exc is not None and not isinstance(exc, TimeoutError):
                        raise exc  # the watcher stopped (the route stream is gone): nothing left to follow
            finally:
                for t in (again_wait, changed):
                    t.cancel()
                    with contextlib.suppress(BaseException):
                        await t


def _moved(w: RouteWatcher, seen: int, _ri: RouteIntent) -> bool:
    return w.seq != seen
