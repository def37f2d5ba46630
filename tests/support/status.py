"""The status fold's test fleet (the hearth example) at a fixed clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.sizes import GiB
from haru.core.specs import DomainSpec, GpuSpec, ModelSpec, Policy, TrainingSpec

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
F = "default"
NOW = T0 + timedelta(seconds=20000)
HEARTH = [
    ("muse-local:latest", 20 * GiB, True, 0),
    ("deepseek-r1:32b", 22 * GiB, True, 0),
    ("gemma4:26b", 17 * GiB, False, int(14.8 * GiB)),
    ("qwen3.6:27b", 18 * GiB, False, int(15.8 * GiB)),
    ("gemma4-extract:31b", 20 * GiB, False, int(17.8 * GiB)),
]


def t(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def hearth_fleet() -> list[tuple[str, ev.Event]]:
    d = sj.decl(F)
    items: list[tuple[str, ev.Event]] = [(d, ev.FleetDeclared(at=t(0), fleet=F, policy=Policy()))]
    for dom in ("a", "b"):
        gpu = GpuSpec(index=0, memory_bytes=48 * GiB, reserve_bytes=int(3.8 * GiB), name="RTX A6000")
        items.append(
            (d, ev.DomainDeclared(at=t(0), spec=DomainSpec(name=dom, serving_url=f"http://{dom}:9000", gpus=[gpu])))
        )
        for name, vram, ok, short in HEARTH:
            items.append(
                (
                    d,
                    ev.ModelDeclared(
                        at=t(0), domain=dom, spec=ModelSpec(name=name, slot="s", gpu_index=0, vram_bytes=vram)
                    ),
                )
            )
            items.append(
                (
                    d,
                    ev.AdmissionDecided(
                        at=t(0), domain=dom, name=name, gpu_index=0, admitted=ok, vram_bytes=vram, short_by_bytes=short
                    ),
                )
            )
        items.append(
            (
                d,
                ev.TrainingDeclared(
                    at=t(0), domain=dom, spec=TrainingSpec(slot="lora", gpu_index=0, command=["t"], checkpoint_dir="/c")
                ),
            )
        )
    items += [
        (sj.route(F), ev.RouteMoved(at=t(1), active="a")),
        (sj.agent(F, "a"), ev.AgentStarted(at=t(1), domain="a", host="gpu-a")),
        (sj.liveness(F, "a"), ev.DomainReachable(at=t(1), domain="a")),
        (
            sj.model(F, "a", "muse-local:latest"),
            ev.ModelResident(at=NOW - timedelta(seconds=14203), domain="a", model="muse-local:latest"),
        ),
        (
            sj.model(F, "a", "deepseek-r1:32b"),
            ev.ModelLoading(at=NOW - timedelta(seconds=47), domain="a", model="deepseek-r1:32b"),
        ),
        (sj.model(F, "b", "muse-local:latest"), ev.ModelSleeping(at=t(5), domain="b", model="muse-local:latest")),
        (
            sj.model(F, "b", "deepseek-r1:32b"),
            ev.ModelLost(at=t(6), domain="b", model="deepseek-r1:32b", reason="gpu_detached"),
        ),
        (sj.gpu(F, "b", 0), ev.GpuObserved(at=t(6), domain="b", index=0, present=False)),
        (
            sj.training(F, "b", "lora"),
            ev.TrainingStarted(at=NOW - timedelta(seconds=300), domain="b", slot="lora", pid=4242, gpu_index=0),
        ),
    ]
    return items
