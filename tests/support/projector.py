"""The projector's test world: a fleet declared on a log, a writer of its events, and the projector's stored
view, read back.
"""

from __future__ import annotations

import asyncio

from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.sizes import GiB
from haru.core.specs import DomainSpec, GpuSpec, ModelSpec, Policy
from haru.core.views import view_decoder
from haru.log.seam import Log
from tests.support.clock import now

F = "default"
MODELS = ("qwen3.6:27b", "llama-8b")


async def declare(log: Log, fleet: str = F) -> None:
    s = sj.decl(fleet)
    seq = await log.last_seq_of(s)
    seq = await log.append(s, ev.FleetDeclared(at=now(), fleet=fleet, policy=Policy()), expect=seq)
    for d in ("a", "b"):
        spec = DomainSpec(
            name=d,
            serving_url=f"http://{d}:9000",
            gpus=[GpuSpec(index=0, memory_bytes=48 * GiB, reserve_bytes=2 * GiB)],
        )
        seq = await log.append(s, ev.DomainDeclared(at=now(), spec=spec), expect=seq)
        for i, m in enumerate(MODELS):
            spec_m = ModelSpec(name=m, slot=f"m{i}", gpu_index=0, vram_bytes=10 * GiB, port=8000 + i)
            seq = await log.append(s, ev.ModelDeclared(at=now(), domain=d, spec=spec_m), expect=seq)
            seq = await log.append(
                s,
                ev.AdmissionDecided(at=now(), domain=d, name=m, gpu_index=0, admitted=True, vram_bytes=10 * GiB),
                expect=seq,
            )


class Writer:
    """Appends residency and route events with the right expected sequences."""

    def __init__(self, log: Log, fleet: str = F) -> None:
        self.log = log
        self.fleet = fleet
        self.tips: dict[str, int] = {}

    async def put(self, subject: str, event: ev.Event) -> int:
        if subject not in self.tips:
            self.tips[subject] = await self.log.last_seq_of(subject)
        seq = await self.log.append(subject, event, expect=self.tips[subject])
        self.tips[subject] = seq
        return seq

    async def move(self, active: str) -> int:
        return await self.put(sj.route(self.fleet), ev.RouteMoved(at=now(), active=active))

    async def churn(self, n: int, domain: str = "b") -> int:
        """n residency events on `domain`: loading/resident alternating (legal: loading->resident->... via lost)."""
        seq = 0
        cycle = ("model_loading", "model_resident", "model_lost")
        for i in range(n):
            m = MODELS[i % len(MODELS)]
            tag = cycle[(i // len(MODELS)) % 3]
            s = sj.model(self.fleet, domain, m)
            if tag == "model_loading":
                e = ev.ModelLoading(at=now(), domain=domain, model=m)
            elif tag == "model_resident":
                e = ev.ModelResident(at=now(), domain=domain, model=m)
            else:
                e = ev.ModelLost(at=now(), domain=domain, model=m, reason="unhealthy")
            seq = await self.put(s, e)
        return seq


async def stored_view(log: Log, fleet: str = F):
    got = await log.get_view(sj.view_key(fleet))
    return None if got is None else view_decoder.decode(got[0])


async def wait_view_seq(log: Log, seq: int, fleet: str = F, timeout: float = 20.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        view = await stored_view(log, fleet)
        if view is not None and view.seq >= seq:
            return view
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"view of {fleet} did not reach seq {seq} (at {None if view is None else view.seq})")
        await asyncio.sleep(0.02)
