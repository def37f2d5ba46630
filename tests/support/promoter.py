"""Helpers for the promoter's integration tests: reading the fleet back, waiting, running promoters."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys

from haru.core import subjects
from haru.core.events import OperationAborted, OperationCompleted, RouteMoved, tag_of
from haru.core.fold import empty, fold
from haru.host.tasks import cancel_and_wait
from haru.log.eventlog import EventLog
from haru.log.seam import EventReader
from tests.support.wait import wait_until


async def view_of(log: EventReader, fleet: str = "default"):
    records = await log.history(subjects.fleet_events(fleet))
    view = fold((r.seq, r.subject, r.event) for r in records).get(fleet, empty(fleet))
    return view


async def wait_view(log: EventReader, predicate, timeout: float = 15.0, what: str = "", fleet: str = "default"):
    async def check():
        v = await view_of(log, fleet)
        return v if predicate(v) else None

    return await wait_until(check, timeout, what=what)


async def op_events(log: EventReader, fleet: str = "default", op_id: str | None = None) -> list:
    recs = await log.history(subjects.op(fleet))
    return [
        r.event for r in recs if r.event is not None and (op_id is None or getattr(r.event, "op_id", None) == op_id)
    ]


async def route_moves(log: EventReader, fleet: str = "default") -> list[RouteMoved]:
    return [r.event for r in await log.history(subjects.route(fleet)) if isinstance(r.event, RouteMoved)]


async def wait_op_end(log: EventReader, op_id: str, timeout: float = 20.0, fleet: str = "default"):
    async def check():
        for e in await op_events(log, fleet, op_id):
            if isinstance(e, (OperationCompleted, OperationAborted)):
                return e
        return None

    return await wait_until(check, timeout, what=f"the end of {op_id}")


def describe(events) -> list[str]:
    return [f"{tag_of(e)}:{getattr(e, 'step', '')}" for e in events]


@contextlib.asynccontextmanager
async def promoters(source, n: int = 1, *, fleets=None, step_delay_ms: int = 0, sky: str = "sky"):
    """n promoter replicas in this process, each its own client of the log with its own identity.
    `source` is a server URL or a `log_world.LogWorld` (either log). Yields the replicas; a replica
    that died is an error at the end. `sky`: the `sky` CLI the provisioning steps run."""
    from haru.promoter.service import Promoter
    from tests.support.log_world import LogWorld

    logs, tasks, replicas = [], [], []
    try:
        for i in range(n):
            writer = f"promoter:test-{i}"
            if isinstance(source, LogWorld):
                log = await source.client(writer)
            else:
                log = await EventLog.open([source], writer=writer)
                logs.append(log)
            p = Promoter(log, fleets=fleets, identity=writer, step_delay_ms=step_delay_ms, sky=sky, tick_s=0.05)
            ready = asyncio.Event()
            replicas.append(p)
            tasks.append(asyncio.create_task(p.run(ready)))
            await asyncio.wait_for(ready.wait(), 10)
        yield replicas
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise AssertionError("a promoter replica died") from t.exception()
    finally:
        await cancel_and_wait(*tasks)
        for log in logs:
            await log.close()


def fake_agent(world, domain: str, models, **kwargs):
    """A `promoter_fake.FakeAgent` for `domain` on the world's log: nats.micro on JetStream, the bus in memory."""
    from tests.support.promoter_fake import FakeAgent

    if world.kind == "memory":
        return FakeAgent(
            None, "default", domain, list(models), log=world.memory.connect(f"agent:default/{domain}@fake"), **kwargs
        )
    return FakeAgent(world.url, "default", domain, list(models), **kwargs)


class PromoterProcess:
    """`haru promoter` as a real child process (for crash tests): start, SIGKILL, restart."""

    def __init__(self, url: str, identity: str, *, env: dict | None = None, log_path=None) -> None:
        self.url = url
        self.identity = identity
        self.env = {**os.environ, "HARU_NO_UVLOOP": "1", "HARU_LOG_FORMAT": "json", **(env or {})}
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "haru.cli", "promoter", "--id", self.identity, "--nats-url", self.url],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=out,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        if out is not subprocess.DEVNULL:
            out.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.kill()


async def assert_one_failover_each_step_once(log, standby) -> list:
    """After replicas raced one failure: the route moved once (a, then b), two promotions (the first
    route and the failover), no step of either started twice, and the standby was woken once. Returns
    the op subject's events."""
    from haru.core.events import PromotionRequested, StepStarted

    assert [m.active for m in await route_moves(log)] == ["a", "b"]
    ops = await op_events(log)
    requests = [e for e in ops if isinstance(e, PromotionRequested)]
    assert len(requests) == 2  # the first route, and the failover
    for op in requests:
        started = [e.step for e in ops if isinstance(e, StepStarted) and e.op_id == op.op_id]
        assert len(started) == len(set(started)), f"a step was started twice: {describe(ops)}"
    # each wake was sent once: exactly one promoter drove each step
    assert [v for v, _ in standby.calls].count("wake") == 1
    return ops


def asleep_and_training(view, domain: str) -> bool:
    from haru.core.residency import Sleeping

    dv = view.domains[domain]
    return all(isinstance(m.residency, Sleeping) for m in dv.models.values()) and all(
        t.running for t in dv.training.values()
    )


def serving(view, domain: str) -> bool:
    from haru.core.residency import Resident

    return view.active == domain and all(
        isinstance(m.residency, Resident) for m in view.domains[domain].models.values()
    )


async def routed_to_a(log):
    """Wait for the first route (a), with b demoted; return the view."""
    return await wait_view(
        log, lambda v: v.active == "a" and v.operation is None and asleep_and_training(v, "b"), what="first route to a"
    )
