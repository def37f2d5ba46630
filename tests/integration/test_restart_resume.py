"""Readers restart from what KV already holds, and end where a fold of the whole log ends: a projector
restarted after events were appended while it was down writes the views a fold from scratch gives, and
a promoter started on those views holds what one that folded the whole log holds."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.fold import add_one
from haru.core.sizes import GiB
from haru.core.specs import DomainSpec, GpuSpec, ModelSpec, Policy
from haru.core.views import view_decoder
from haru.host.tasks import cancel_and_wait
from haru.projections.projector import Projector
from haru.promoter.service import Promoter

pytestmark = pytest.mark.timeout(90)
T0 = datetime(2026, 11, 29, tzinfo=UTC)
FLEETS = ("default", "edge")
MODELS = ("m1", "m2")


class History:
    """Events of two fleets, appended with their subjects' expected sequences."""

    def __init__(self, log) -> None:
        self.log = log
        self.n = 0

    async def add(self, subject: str, event: ev.Event) -> int:
        self.n += 1
        return await self.log.append(subject, event, expect=await self.log.last_seq_of(subject))

    def at(self) -> datetime:
        return T0 + timedelta(seconds=self.n)

    async def declare(self, fleet: str, domain: str) -> None:
        if not await self.log.last_seq_of(sj.decl(fleet)):
            await self.add(sj.decl(fleet), ev.FleetDeclared(at=self.at(), fleet=fleet, policy=Policy()))
        gpu = GpuSpec(index=0, memory_bytes=80 * GiB, reserve_bytes=2 * GiB)
        spec = DomainSpec(name=domain, serving_url=f"http://{domain}:9000", gpus=[gpu])
        await self.add(sj.decl(fleet), ev.DomainDeclared(at=self.at(), spec=spec))
        for i, m in enumerate(MODELS):
            ms = ModelSpec(name=m, slot=f"s{i}", gpu_index=0, vram_bytes=8 * GiB, port=8000 + i)
            await self.add(sj.decl(fleet), ev.ModelDeclared(at=self.at(), domain=domain, spec=ms))
            await self.add(
                sj.decl(fleet),
                ev.AdmissionDecided(
                    at=self.at(), domain=domain, name=m, gpu_index=0, admitted=True, vram_bytes=8 * GiB
                ),
            )

    async def churn(self, fleet: str, domain: str, rounds: int) -> None:
        for _ in range(rounds):
            for m in MODELS:
                subject = sj.model(fleet, domain, m)
                await self.add(subject, ev.ModelLoading(at=self.at(), domain=domain, model=m))
                await self.add(subject, ev.ModelResident(at=self.at(), domain=domain, model=m, warmup_ms=100))

    async def move(self, fleet: str, active: str) -> None:
        await self.add(sj.route(fleet), ev.RouteMoved(at=self.at(), active=active))

    async def operation(self, fleet: str, op_id: str, target: str, by: str) -> None:
        await self.add(sj.op(fleet), ev.PromotionRequested(at=self.at(), op_id=op_id, target=target, by=by))
        await self.add(sj.op(fleet), ev.StepStarted(at=datetime.now(UTC), op_id=op_id, step="launch", by=by))


def fold_all(records) -> dict:
    folders: dict = {}
    for rec in records:
        add_one(folders, rec.event, seq=rec.seq, subject=rec.subject, error=rec.error)
    return {fleet: folder.view() for fleet, folder in folders.items()}


async def project_until_idle(log) -> Projector:
    projector = Projector(log)
    task = asyncio.create_task(projector.run())
    try:
        last = await log.last_seq()
        async with asyncio.timeout(30):
            while projector.stats.last_seq < last:
                await asyncio.sleep(0.02)
        await projector.wait_idle(30)
    finally:
        await cancel_and_wait(task)
    return projector


async def before_and_while_down(log) -> int:
    """A history; a projector folds it and stops; more is appended while it is down. Returns where it stopped."""
    h = History(log)
    for fleet in FLEETS:
        await h.declare(fleet, "a")
        await h.declare(fleet, "b")
        await h.move(fleet, "a")
        await h.churn(fleet, "a", 3)
    await h.operation("default", "op-1", "b", by="promoter:one")
    await project_until_idle(log)
    stopped = await log.last_seq()
    await h.churn("edge", "b", 2)  # while the projector is down
    await h.declare("edge", "c")
    await h.operation("edge", "op-2", "b", by="promoter:two")
    await h.move("default", "b")
    return stopped


async def test_a_restarted_projector_writes_the_views_a_fold_from_scratch_gives(event_log):
    stopped = await before_and_while_down(event_log)
    again = await project_until_idle(event_log)
    assert 1 < again.stats.resumed_from <= stopped + 1  # resumed after the stored views, not replayed
    expected = fold_all(await event_log.history())
    for fleet in FLEETS:
        stored, _ = await event_log.get_view(sj.view_key(fleet))
        assert view_decoder.decode(stored) == expected[fleet], fleet


async def test_a_promoter_started_on_the_stored_views_holds_what_a_whole_fold_holds(event_log):
    stopped = await before_and_while_down(event_log)
    await project_until_idle(event_log)  # the projector caught up; the promoter starts on its views
    h = History(event_log)
    h.n = 10_000
    await h.churn("default", "a", 1)  # and more, which no view holds yet
    records = await event_log.history()

    resumed = Promoter(event_log, identity="promoter:test")
    at = await resumed.resume()
    assert at > stopped  # started from the stored views, not from the first event
    for rec in records:
        if rec.seq > at:
            resumed.on_record(rec)

    whole = Promoter(event_log, identity="promoter:test")
    for rec in records:
        whole.on_record(rec)

    assert sorted(resumed.fleets) == sorted(whole.fleets) == sorted(FLEETS)
    for fleet in FLEETS:
        got, want = resumed.fleets[fleet], whole.fleets[fleet]
        assert got.view == want.view, fleet
        assert got.last == want.last, fleet
        assert got.step_by == want.step_by and got.step_by, fleet
        assert got.launches == want.launches and got.launches, fleet
        assert got.specs == want.specs, fleet
    assert resumed.folded == whole.folded == records[-1].seq
