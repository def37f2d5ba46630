"""The fold's test language: a fleet at a fixed clock and the declarations that start one."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.sizes import GiB
from haru.core.specs import DomainSpec, GpuSpec, ModelSpec, Policy, TrainingSpec

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
F = "default"


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def declarations() -> list[tuple[str, ev.Event]]:
    """A two-domain fleet: a,b each with one GPU (48 GiB, 2 reserved), two models, one training slot."""
    out: list[tuple[str, ev.Event]] = [(sj.decl(F), ev.FleetDeclared(at=at(0), fleet=F, policy=Policy()))]
    for d in ("a", "b"):
        spec = DomainSpec(
            name=d,
            serving_url=f"http://{d}.example:9000",
            gpus=[GpuSpec(index=0, memory_bytes=48 * GiB, reserve_bytes=2 * GiB, name="A6000")],
        )
        out.append((sj.decl(F), ev.DomainDeclared(at=at(0), spec=spec)))
        for name, vram in (("qwen3.6:27b", 30 * GiB), ("llama-8b", 20 * GiB)):
            out.append(
                (
                    sj.decl(F),
                    ev.ModelDeclared(
                        at=at(0),
                        domain=d,
                        spec=ModelSpec(
                            name=name,
                            slot=name.replace(":", "-").replace(".", "-"),
                            gpu_index=0,
                            vram_bytes=vram,
                            port=8000,
                        ),
                    ),
                )
            )
        out.append(
            (
                sj.decl(F),
                ev.TrainingDeclared(
                    at=at(0),
                    domain=d,
                    spec=TrainingSpec(
                        slot="lora", gpu_index=0, command=["train"], checkpoint_dir="/ck", vram_bytes=10 * GiB
                    ),
                ),
            )
        )
        out.append(
            (
                sj.decl(F),
                ev.AdmissionDecided(
                    at=at(0),
                    domain=d,
                    name="qwen3.6:27b",
                    gpu_index=0,
                    admitted=True,
                    vram_bytes=30 * GiB,
                    capacity_bytes=46 * GiB,
                ),
            )
        )
        out.append(
            (
                sj.decl(F),
                ev.AdmissionDecided(
                    at=at(0),
                    domain=d,
                    name="llama-8b",
                    gpu_index=0,
                    admitted=False,
                    vram_bytes=20 * GiB,
                    short_by_bytes=4 * GiB,
                    capacity_bytes=46 * GiB,
                ),
            )
        )
        out.append(
            (
                sj.decl(F),
                ev.AdmissionDecided(
                    at=at(0), domain=d, kind="training", name="lora", gpu_index=0, admitted=True, vram_bytes=10 * GiB
                ),
            )
        )
    return out
