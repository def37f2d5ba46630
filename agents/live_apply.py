"""Layouts applied live: the host moves from its slots to the declared ones without a restart.

A new model is started, a removed one stopped, a changed one replaced; every other model is untouched.
A change that would interrupt a model this domain serves as the active one waits (`pending`) until the
domain is the standby (after the operation that moved the route has finished). The declarations come
from `haru apply` (followed here) or the `apply_layout` verb of a rolling change (`apply_declared`).

`LiveApply.slots` is the host's slots as they are now (their policy is the agent's policy).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

from haru.agents.config import HostSlots, diff_models, fold_declarations
from haru.agents.current import CurrentSlots
from haru.agents.loops import LoopErrors
from haru.agents.model_slots import ModelSlots
from haru.agents.ports import Applied
from haru.agents.role import Role
from haru.core import subjects
from haru.core.events import Event, tag_of
from haru.core.record import Record
from haru.host.tasks import cancel_and_wait
from haru.log.seam import EventReader

__all__ = ["LiveApply", "LIVE_STATES", "DECL_SETTLE_S"]

LIVE_STATES = frozenset({"loading", "resident", "sleeping", "waking"})
DECL_SETTLE_S = 0.3  # a live apply waits this long after the last declaration before it folds them
_OPERATION_OVER = ("operation_completed", "operation_aborted", "failover_declined", "eligibility_changed")


class LiveApply:
    def __init__(
        self,
        current: CurrentSlots,
        *,
        log: EventReader,
        fleet: str,
        domain: str,
        models: ModelSlots,
        role: Role,
        stopping: Callable[[], bool],
        spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]],
        errors: LoopErrors,
        logger: Any,
    ) -> None:
        self.current = current
        self.log = log
        self.fleet = fleet
        self.domain = domain
        self.models = models
        self.role = role
        self.stopping = stopping
        self.spawn = spawn
        self.errors = errors
        self.logger = logger
        self.pending: dict[str, Any] = {}  # model -> the changed ModelSpec that waits for this domain to be standby
        self._lock = asyncio.Lock()
        role.on_moved.append(self._route_moved)

    @property
    def slots(self) -> HostSlots:
        """The host's slots as they are now."""
        return self.current.slots

    def _route_moved(self) -> None:
        if self.pending and self.role.now == "standby":
            self.spawn(self.apply_pending(), "apply-pending")

    async def follow(self) -> None:
        """Follow `haru apply`'s declarations (the agent's slots came from them) and apply each changed
        layout to this host, once a batch of declarations has been written."""
        events: list[Event] = []
        changed = asyncio.Event()

        def on(rec: Record) -> None:
            if rec.event is not None:
                events.append(rec.event)
                changed.set()

        async def follow() -> None:
            # haru/log/follow.py: catch-up, stall detection, a fresh replay after a reconnect (each
            # declaration handled once); a LogError is retried there, anything else is a bug
            follower = self.log.follower(on, from_seq=1, subject_filter=subjects.decl(self.fleet), name="declarations")
            while not self.stopping():
                try:
                    await follower.run()  # resumes after the last declaration it handled
                except asyncio.CancelledError:
                    raise
                except Exception:  # a bug in `on` (or one the follower raised): logged, counted, followed again
                    n = self.errors.count("declarations")
                    self.logger.warning("declaration follower interrupted", errors=n, exc_info=True)
                    await asyncio.sleep(1.0)

        follower = asyncio.ensure_future(follow())
        try:
            while not self.stopping():
                await changed.wait()
                await asyncio.sleep(DECL_SETTLE_S)  # `haru apply` appends a batch: fold once it is written
                changed.clear()
                new = fold_declarations(self.fleet, self.domain, list(events))
                if new is not None:
                    await self.apply(new)
        finally:
            await cancel_and_wait(follower)

    async def apply(self, new: HostSlots) -> dict[str, list[str]]:
        """Move this host from its slots to `new` without a restart. Returns what was done, by path."""
        async with self._lock:
            # Against what the runtimes run, not the last declarations: a change that waits (`pending`) is
            # still a change, and one changed back before it was applied is none.
            models = self.models.models
            diff = diff_models([m.spec for m in models.values()], new.admitted_models)
            self.current.slots = new
            done: dict[str, list[str]] = {"started": [], "stopped": [], "replaced": [], "pending": []}
            for name in diff.removed:
                self.pending.pop(name, None)
                await self.models.retire(name, new.retire_why(name))
                done["stopped"].append(name)
            for spec in diff.added:
                await self.models.add(spec)
                done["started"].append(spec.name)
            for spec in diff.changed:
                if self.role.now == "active" and models[spec.name].state_tag in LIVE_STATES:
                    self.pending[spec.name] = spec
                    done["pending"].append(spec.name)
                else:
                    self.pending.pop(spec.name, None)  # applied now: it waits no more
                    await self.models.replace(spec)
                    done["replaced"].append(spec.name)
            for name in diff.unchanged:
                self.pending.pop(name, None)  # changed back before it was applied
            if any(done.values()):
                self.logger.info("layout applied live", **{k: v for k, v in done.items() if v})
            if done["pending"]:
                self.logger.warning(
                    "changes wait for this domain to be the standby (they would interrupt models it "
                    "serves as the active domain): promote the other domain to apply them",
                    models=done["pending"],
                )
            return done

    async def apply_layout(self, decl_seq: int) -> Applied:
        """The `apply_layout` verb: `apply_declared` bounded by the policy's apply_timeout_ms."""
        return await self.apply_declared(decl_seq, self.slots.policy.apply_timeout_ms / 1000)

    async def apply_declared(self, decl_seq: int, timeout_s: float) -> Applied:
        """The `apply_layout` verb (a rolling change's apply steps): bring this host to the declarations
        (at least up to `decl_seq`) now rather than when the follower gets to them; on the standby, also
        replace the changes that waited while this domain was the active one; then wait, at most
        `timeout_s`, until every model has come to rest. Idempotent: run twice, it changes nothing the
        second time and waits the same way."""
        if self.slots.source != "declared":
            return Applied(
                ok=False,
                code="layout_not_declared",
                detail=f"the agent of {self.domain} reads its slots from its {self.slots.source} file, not from "
                f"`haru apply`'s declarations: change that file and restart the agent (its runtimes are adopted)",
            )
        records = await self.log.history(subjects.decl(self.fleet))
        last = records[-1].seq if records else 0
        if last < decl_seq:
            return Applied(
                ok=False,
                code="declarations_behind",
                detail=f"the decl subject ends at seq {last}, before seq {decl_seq} the operation rolls out",
            )
        new = fold_declarations(self.fleet, self.domain, [r.event for r in records if r.event is not None])
        if new is None:
            return Applied(
                ok=False,
                code="domain_retired",
                detail=f"domain {self.domain} is no longer declared in fleet {self.fleet}",
            )
        # The diff is against what the runtimes run, so on the standby it replaces what waited too.
        done = await self.apply(new)
        if self.pending:
            return Applied(
                ok=False,
                code="domain_active",
                detail=f"{self.domain} is the active domain: its changes to {', '.join(sorted(self.pending))} wait "
                f"until it is the standby",
                data={"pending_layout": sorted(self.pending)},
            )
        models = self.models.models
        try:
            async with asyncio.timeout(timeout_s):
                await self.models.settled()
        except TimeoutError:
            loading = sorted(m.name for m in models.values() if not m.settled.is_set())
            return Applied(
                ok=False,
                code="timeout",
                data={"decl_seq": last},
                detail=f"still loading after {timeout_s:.0f} s (policy apply_timeout_ms): {', '.join(loading)}",
            )
        unready = {
            name: f"{m.state_tag}"
            + (
                f" ({getattr(m.state, 'detail', '') or getattr(m.state, 'reason', '')})"
                if m.state_tag in ("failed", "lost")
                else ""
            )
            for name, m in models.items()
            if m.state_tag not in ("resident", "sleeping", "waking")
        }
        data = {
            "decl_seq": last,
            **{k: v for k, v in done.items() if v},
            "models": {name: m.state_tag for name, m in models.items()},
        }
        if unready:
            return Applied(
                ok=False,
                code="model_not_ready",
                detail="; ".join(f"{n} {s}" for n, s in sorted(unready.items())),
                data=data,
            )
        changed = [f"{k} {', '.join(v)}" for k, v in done.items() if v and k != "pending"]
        return Applied(
            ok=True,
            detail=(("; ".join(changed) + "; ") if changed else "") + f"declarations up to seq {last} applied",
            data=data,
        )

    async def apply_pending(self) -> None:
        """The domain is the standby now: replace the models whose change waited, once the operation that
        moved the route has finished (its last step settles this domain: the change comes after it)."""
        deadline = time.monotonic() + self.slots.policy.command_timeout_ms / 1000 * 6
        while time.monotonic() < deadline and not self.stopping():
            rec = await self.log.last(subjects.op(self.fleet))
            if rec is None or rec.event is None or tag_of(rec.event) in _OPERATION_OVER:
                break
            await asyncio.sleep(0.2)
        async with self._lock:
            for name, spec in list(self.pending.items()):
                if self.role.now != "standby":
                    return
                del self.pending[name]
                await self.models.replace(spec)
