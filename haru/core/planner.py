"""The VRAM planner: which declared models and training slots fit on their GPU. Pure.

Per GPU, capacity = memory - reserve; the reserve (CUDA context, KV growth, fragmentation) is never
planned into. Inference models are admitted in declaration order, first fit, never best fit: each
model is admitted if its VRAM fits in what its predecessors left, otherwise it is not admitted with
the exact shortfall (`short_by_bytes = vram - left`). Nothing is evicted to make room.

Training is planned for the standby, where the inference runtimes sleep: a sleeping `vllm` runtime
keeps `policy.sleep_residual_bytes` on its GPU (CUDA context, allocator residue); a `llama_server`
cannot sleep, so it is planned as keeping all its VRAM; an `external` runtime holds nothing of ours. Training slots on a GPU are admitted, again in declaration order and first fit, in
capacity - residuals of the admitted runtimes; those that do not fit carry their shortfall.

`format_gib` and `gpu_summary_line` are the one formatting of these numbers that `haru apply`,
`haru status` and the docs share: `42.0 / 44.2 GiB held  (5 declared, 2 admitted)`, where "held" is
the VRAM of the admitted models and the second number is what can be held: the card's memory minus
its reserve (hearth's A6000 is 48 GiB with a 3.8 GiB reserve).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

from haru.core.specs import Domain, Layout, ModelSpec, Policy, TrainingSpec
from haru.core.sizes import GiB, format_gib

__all__ = [
    "Verdict",
    "GpuPlan",
    "DomainPlan",
    "Plan",
    "plan",
    "plan_domain",
    "first_fit",
    "standby_residual",
    "gpu_summary_line",
    "verdict_line",
]



def standby_residual(model: ModelSpec, policy: Policy) -> int:
    """What an admitted runtime keeps on its GPU while the domain is standby."""
    if model.runtime == "vllm":
        return policy.sleep_residual_bytes  # level-1 sleep: weights in CPU RAM, the context stays
    if model.runtime == "llama_server":
        return model.vram_bytes  # llama-server has no sleep mode: plan for all of it
    return 0  # external: not our process


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """The planner's answer for one model (kind=model) or training slot (kind=training)."""

    domain: str
    kind: Literal["model", "training"]
    name: str  # the model id or the training slot name
    gpu_index: int
    vram_bytes: int
    admitted: bool
    short_by_bytes: int = 0  # 0 when admitted; vram - what was left, exactly, when not
    capacity_bytes: int = 0  # memory - reserve of that GPU (0 if the domain lacks the GPU)
    left_bytes: int = 0  # what was left for it when it was considered


class GpuPlan(msgspec.Struct, frozen=True, kw_only=True):
    domain: str
    index: int
    memory_bytes: int
    reserve_bytes: int
    capacity_bytes: int
    held_bytes: int  # VRAM of the admitted inference models
    residual_bytes: int  # what the admitted runtimes keep while asleep (the standby's floor)
    training_bytes: int  # VRAM of the admitted training slots (on the standby)
    models: list[Verdict] = []
    training: list[Verdict] = []

    @property
    def declared(self) -> int:
        return len(self.models)

    @property
    def admitted(self) -> int:
        return sum(1 for v in self.models if v.admitted)

    def summary(self) -> str:
        return gpu_summary_line(self.held_bytes, self.capacity_bytes, self.declared, self.admitted)


class DomainPlan(msgspec.Struct, frozen=True, kw_only=True):
    domain: str
    gpus: list[GpuPlan] = []

    def verdicts(self) -> list[Verdict]:
        return [v for g in self.gpus for v in (*g.models, *g.training)]


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    domains: list[DomainPlan] = []

    def verdicts(self) -> list[Verdict]:
        """Every verdict, per domain, per GPU, models before training, in declaration order."""
        return [v for d in self.domains for v in d.verdicts()]

    def verdict(self, domain: str, name: str, kind: str = "model") -> Verdict | None:
        for v in self.verdicts():
            if v.domain == domain and v.name == name and v.kind == kind:
                return v
        return None

    def not_admitted(self) -> list[Verdict]:
        return [v for v in self.verdicts() if not v.admitted]


def first_fit(sizes: list[int], capacity: int) -> list[tuple[bool, int, int]]:
    """The admission rule alone: for each size in order, (admitted, short_by, left_before)."""
    left = capacity
    out: list[tuple[bool, int, int]] = []
    for size in sizes:
        if size <= left:
            out.append((True, 0, left))
            left -= size
        else:
            out.append((False, size - left, left))
    return out


def plan(layout_or_domain: Layout | Domain, policy: Policy | None = None) -> Plan:
    """Plan every domain of a layout (or one domain). `policy` defaults to the layout's."""
    if isinstance(layout_or_domain, Layout):
        pol = policy if policy is not None else layout_or_domain.policy
        return Plan(domains=[plan_domain(d, pol) for d in layout_or_domain.domains])
    return Plan(domains=[plan_domain(layout_or_domain, policy if policy is not None else Policy())])


def plan_domain(domain: Domain, policy: Policy) -> DomainPlan:
    name = domain.spec.name
    gpus = {g.index: g for g in domain.spec.gpus}
    indexes = list(gpus)
    # A model or training slot on a GPU the domain lacks (the layout refuses that; a hand-built Domain
    # may not) is planned against a capacity of 0, so it is never admitted.
    items: list[ModelSpec | TrainingSpec] = [*domain.models, *domain.training]
    for item in items:
        if item.gpu_index not in gpus and item.gpu_index not in indexes:
            indexes.append(item.gpu_index)
    out: list[GpuPlan] = []
    for index in indexes:
        g = gpus.get(index)
        memory = g.memory_bytes if g else 0
        reserve = g.reserve_bytes if g else 0
        capacity = max(0, memory - reserve)
        models = [m for m in domain.models if m.gpu_index == index]
        training = [t for t in domain.training if t.gpu_index == index]
        model_verdicts = _verdicts(name, "model", models, capacity, capacity)
        held = sum(v.vram_bytes for v in model_verdicts if v.admitted)
        residual = sum(standby_residual(m, policy) for m, v in zip(models, model_verdicts) if v.admitted)
        training_verdicts = _verdicts(name, "training", training, max(0, capacity - residual), capacity)
        out.append(
            GpuPlan(
                domain=name,
                index=index,
                memory_bytes=memory,
                reserve_bytes=reserve,
                capacity_bytes=capacity,
                held_bytes=held,
                residual_bytes=residual,
                training_bytes=sum(v.vram_bytes for v in training_verdicts if v.admitted),
                models=model_verdicts,
                training=training_verdicts,
            )
        )
    return DomainPlan(domain=name, gpus=out)


def _verdicts(
    domain: str, kind: Literal["model", "training"], items: Sequence[ModelSpec | TrainingSpec], room: int, capacity: int
) -> list[Verdict]:
    names = [i.name if isinstance(i, ModelSpec) else i.slot for i in items]
    fits = first_fit([i.vram_bytes for i in items], room)
    return [
        Verdict(domain=domain, kind=kind, name=n, gpu_index=i.gpu_index, vram_bytes=i.vram_bytes, admitted=ok,
                short_by_bytes=short, capacity_bytes=capacity, left_bytes=left)
        for n, i, (ok, short, left) in zip(names, items, fits)
    ]


# ----------------------------------------------------------------------------------- formatting


def gpu_summary_line(held_bytes: int, capacity_bytes: int, declared: int, admitted: int) -> str:
    """hearth's status line: `42.0 / 44.2 GiB held  (5 declared, 2 admitted)` (held / memory - reserve)."""
    return f"{held_bytes / GiB:.1f} / {format_gib(capacity_bytes)} held  ({declared} declared, {admitted} admitted)"


def verdict_line(v: Verdict, width: int = 28) -> str:
    """One line per verdict: `gemma4:26b                   not admitted — short by 14.8 GiB`."""
    label = v.name if v.kind == "model" else f"training {v.name}"
    if v.admitted:
        return f"{label:<{width}} admitted ({format_gib(v.vram_bytes)})"
    return f"{label:<{width}} not admitted — short by {format_gib(v.short_by_bytes)}"
