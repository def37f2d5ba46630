"""The planner: which declared models and training slots fit on their GPUs and in host RAM. Pure.

Per GPU, capacity = memory - reserve; the reserve (CUDA context, KV growth, fragmentation) is never
planned into. Inference models are admitted in declaration order, first fit, never best fit: each
model is admitted if its VRAM fits in what its predecessors left, otherwise it is not admitted with
the exact shortfall (`short_by_bytes = vram - left`). Nothing is evicted to make room.

Training is planned for the standby, where the inference runtimes sleep: a sleeping `vllm` runtime
keeps `policy.sleep_residual_bytes` on its GPU (CUDA context, allocator residue); a `llama_server`
cannot sleep, so it is planned as keeping all its VRAM; an `external` runtime holds nothing of ours. Training slots on a
GPU are admitted, again in declaration order and first fit, in capacity - residuals of the admitted runtimes; those
that do not fit carry their shortfall.

Models across GPUs (tensor parallel, `gpu_indexes`): the model's `vram_bytes` is booked on EACH GPU it
spans; it is admitted only if it fits on all of them (the shortfall is the first GPU's that is short),
and its standby residual is kept on each. Its verdict is listed under its first GPU; the others name it
in `spanned`, and their `held_bytes` include it, so training and later models see those GPUs taken.

Host RAM (a domain that declares `host_ram_bytes`): level-1 sleep keeps every standby model's weights
in host RAM, and trainers use it too. Capacity = host RAM - host RAM reserve; every model books
`sleeping_host_ram(model)` (its declared `host_ram_bytes`, else its VRAM on each GPU it spans: an upper
bound on its weights; 0 for a runtime without a sleep mode) and every training slot its declared
`host_ram_bytes`, in the same order and by the same first fit, so an item admitted on VRAM can still be
`not admitted` with `resource = "host_ram"` and the exact shortfall (`short by 3.0 GiB of host RAM`).

`format_gib` and `gpu_summary_line` are the one formatting of these numbers that `haru apply`,
`haru status` and the docs share: `42.0 / 44.2 GiB held  (5 declared, 2 admitted)`, where "held" is
the VRAM of the admitted models and the second number is what can be held: the card's memory minus
its reserve (hearth's A6000 is 48 GiB with a 3.8 GiB reserve).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from haru.core.sizes import GiB, format_gib
from haru.core.specs import Domain, Layout, ModelSpec, Policy, TrainingSpec, can_sleep, model_gpus

__all__ = [
    "Verdict",
    "GpuPlan",
    "DomainPlan",
    "Plan",
    "plan",
    "plan_domain",
    "first_fit",
    "standby_residual",
    "sleeping_host_ram",
    "shortfall_text",
    "gpu_summary_line",
    "verdict_line",
    "with_measured_host_ram",
]

# A domain planned on the host RAM its agent measured keeps this much of it out of the plan unless it
# declares its own reserve: the OS, the agent, the runtimes' processes and the page cache live there too.
MEASURED_RESERVE_PERCENT = 10
MEASURED_RESERVE_MIN = 2 * GiB


def with_measured_host_ram(layout: Layout, measured: dict[str, int]) -> Layout:
    """The layout to plan with (pure): a domain that declares no host RAM is planned against what its
    agent measured at its last start (`measured`: domain -> /proc/meminfo's MemTotal, from the agent's
    `agent_started`), less the declared reserve or else MEASURED_RESERVE_PERCENT of it (at least
    MEASURED_RESERVE_MIN). A declared host RAM wins; a domain whose agent never started stays unplanned.
    Only the plan reads this: the declaration stays what the layout says."""
    domains = []
    for d in layout.domains:
        total = measured.get(d.spec.name, 0)
        if d.spec.host_ram_bytes or total <= 0:
            domains.append(d)
            continue
        reserve = d.spec.host_ram_reserve_bytes or max(MEASURED_RESERVE_MIN, total * MEASURED_RESERVE_PERCENT // 100)
        spec = msgspec.structs.replace(d.spec, host_ram_bytes=total, host_ram_reserve_bytes=reserve)
        domains.append(msgspec.structs.replace(d, spec=spec))
    return msgspec.structs.replace(layout, domains=domains)


def standby_residual(model: ModelSpec, policy: Policy) -> int:
    """What an admitted runtime keeps on each of its GPUs while the domain is standby."""
    if model.runtime == "vllm":
        return policy.sleep_residual_bytes  # level-1 sleep: weights in CPU RAM, the context stays
    if model.runtime == "llama_server":
        return model.vram_bytes  # llama-server has no sleep mode: plan for all of it
    return 0  # external: not our process


def sleeping_host_ram(model: ModelSpec) -> int:
    """What a model keeps in host RAM while its domain is standby: a runtime with a sleep mode offloads
    its weights there (level 1), on every GPU it spans. The declared `host_ram_bytes`, else its VRAM on
    each GPU (an upper bound: the weights are never more than the VRAM that holds them). A runtime
    without a sleep mode stays resident (its weights stay in VRAM), and an external one is not ours: 0."""
    if not can_sleep(model.runtime):
        return 0
    return model.host_ram_bytes or model.vram_bytes * len(model_gpus(model))


Resource = Literal["vram", "host_ram"]


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """The planner's answer for one model (kind=model) or training slot (kind=training)."""

    domain: str
    kind: Literal["model", "training"]
    name: str  # the model id or the training slot name
    gpu_index: int
    vram_bytes: int
    admitted: bool
    short_by_bytes: int = 0  # 0 when admitted; need - what was left, exactly, when not
    capacity_bytes: int = (
        0  # memory - reserve of that GPU (0 if the domain lacks the GPU); of host RAM when resource is
    )
    left_bytes: int = 0  # what was left for it when it was considered
    # What it was short of: VRAM (on its GPU, or the first of its GPUs that was short), or host RAM.
    resource: Resource = "vram"
    gpu_indexes: list[int] = []  # tensor parallel: every GPU it spans ([] = gpu_index alone)
    host_ram_bytes: int = 0  # what it books in host RAM while the domain is standby (0: host RAM not planned)


class GpuPlan(msgspec.Struct, frozen=True, kw_only=True):
    domain: str
    index: int
    memory_bytes: int
    reserve_bytes: int
    capacity_bytes: int
    held_bytes: int  # VRAM of the admitted inference models (a tensor-parallel one's share on this GPU too)
    residual_bytes: int  # what the admitted runtimes keep while asleep (the standby's floor)
    training_bytes: int  # VRAM of the admitted training slots (on the standby)
    models: list[Verdict] = []
    training: list[Verdict] = []
    spanned: list[str] = []  # admitted tensor-parallel models whose first GPU is another: booked here too

    @property
    def declared(self) -> int:
        return len(self.models)

    @property
    def admitted(self) -> int:
        return sum(1 for v in self.models if v.admitted)

    def summary(self) -> str:
        line = gpu_summary_line(self.held_bytes, self.capacity_bytes, self.declared, self.admitted)
        if self.spanned:
            line += f"  (with {', '.join(self.spanned)} across GPUs)"
        return line


class DomainPlan(msgspec.Struct, frozen=True, kw_only=True):
    domain: str
    gpus: list[GpuPlan] = []
    # Host RAM (all 0 when the domain declares none: not planned).
    host_ram_bytes: int = 0
    host_ram_reserve_bytes: int = 0
    host_ram_capacity_bytes: int = 0  # host RAM - reserve
    host_ram_held_bytes: int = 0  # sleeping models' weights + admitted training slots' host RAM

    def verdicts(self) -> list[Verdict]:
        return [v for g in self.gpus for v in (*g.models, *g.training)]

    def host_ram_summary(self) -> str:
        """`host RAM 40.0 / 60.0 GiB held  (3 sleeping models, 1 training slot)`; '' when not planned."""
        if not self.host_ram_bytes:
            return ""
        booked = [v for v in self.verdicts() if v.admitted and v.host_ram_bytes]
        models = sum(1 for v in booked if v.kind == "model")
        training = len(booked) - models
        return (
            f"host RAM {self.host_ram_held_bytes / GiB:.1f} / {format_gib(self.host_ram_capacity_bytes)} held  "
            f"({models} sleeping model{'s' if models != 1 else ''}, "
            f"{training} training slot{'s' if training != 1 else ''})"
        )


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


class _Fit(msgspec.Struct, frozen=True):
    admitted: bool
    short_by: int
    left: int
    capacity: int
    resource: Resource


def _fit(
    need: dict[int, int],
    ram: int,
    vram_left: dict[int, int],
    capacity: dict[int, int],
    ram_left: int | None,
    ram_capacity: int,
) -> _Fit:
    """Whether an item needing `need[gpu]` VRAM on each of its GPUs and `ram` host RAM fits in what is
    left; the first shortfall (the GPUs in order, then host RAM) when not. Books it when it fits."""
    for index, size in need.items():
        left = vram_left.get(index, 0)
        if size > left:
            return _Fit(False, size - left, left, capacity.get(index, 0), "vram")
    first = next(iter(need), None)
    if ram_left is not None and ram > ram_left:
        return _Fit(False, ram - ram_left, ram_left, ram_capacity, "host_ram")
    for index, size in need.items():
        vram_left[index] = vram_left.get(index, 0) - size
    left_first = (vram_left.get(first, 0) + need[first]) if first is not None else 0
    return _Fit(True, 0, left_first, capacity.get(first, 0) if first is not None else 0, "vram")


def plan_domain(domain: Domain, policy: Policy) -> DomainPlan:
    """Admission on one domain: models in declaration order, then training slots, first fit on every
    GPU each spans and in the domain's host RAM (when declared). See the module docstring."""
    name = domain.spec.name
    gpus = {g.index: g for g in domain.spec.gpus}
    indexes = list(gpus)
    # A model or training slot on a GPU the domain lacks (the layout refuses that; a hand-built Domain
    # may not) is planned against a capacity of 0, so it is never admitted.
    for m in domain.models:
        for i in model_gpus(m):
            if i not in indexes:
                indexes.append(i)
    for t in domain.training:
        if t.gpu_index not in indexes:
            indexes.append(t.gpu_index)
    capacity = {i: max(0, (gpus[i].memory_bytes - gpus[i].reserve_bytes) if i in gpus else 0) for i in indexes}
    vram_left = dict(capacity)
    planned_ram = domain.spec.host_ram_bytes > 0
    ram_capacity = max(0, domain.spec.host_ram_bytes - domain.spec.host_ram_reserve_bytes) if planned_ram else 0
    ram_left: int | None = ram_capacity if planned_ram else None

    model_verdicts: list[tuple[ModelSpec, Verdict]] = []
    for m in domain.models:
        spans = model_gpus(m)
        ram = sleeping_host_ram(m)
        fit = _fit({i: m.vram_bytes for i in spans}, ram, vram_left, capacity, ram_left, ram_capacity)
        if fit.admitted and ram_left is not None:
            ram_left -= ram
        model_verdicts.append(
            (
                m,
                Verdict(
                    domain=name,
                    kind="model",
                    name=m.name,
                    gpu_index=m.gpu_index,
                    vram_bytes=m.vram_bytes,
                    admitted=fit.admitted,
                    short_by_bytes=fit.short_by,
                    capacity_bytes=fit.capacity,
                    left_bytes=fit.left,
                    resource=fit.resource,
                    gpu_indexes=list(m.gpu_indexes),
                    host_ram_bytes=ram if planned_ram else 0,
                ),
            )
        )
    # The standby's floor on each GPU: what the admitted runtimes keep there asleep.
    residual = {i: 0 for i in indexes}
    for m, v in model_verdicts:
        if v.admitted:
            for i in model_gpus(m):
                residual[i] += standby_residual(m, policy)
    training_left = {i: max(0, capacity[i] - residual[i]) for i in indexes}
    training_verdicts: list[tuple[TrainingSpec, Verdict]] = []
    for t in domain.training:
        fit = _fit({t.gpu_index: t.vram_bytes}, t.host_ram_bytes, training_left, capacity, ram_left, ram_capacity)
        if fit.admitted and ram_left is not None:
            ram_left -= t.host_ram_bytes
        training_verdicts.append(
            (
                t,
                Verdict(
                    domain=name,
                    kind="training",
                    name=t.slot,
                    gpu_index=t.gpu_index,
                    vram_bytes=t.vram_bytes,
                    admitted=fit.admitted,
                    short_by_bytes=fit.short_by,
                    capacity_bytes=fit.capacity,
                    left_bytes=fit.left,
                    resource=fit.resource,
                    host_ram_bytes=t.host_ram_bytes if planned_ram else 0,
                ),
            )
        )
    out: list[GpuPlan] = []
    for index in indexes:
        g = gpus.get(index)
        here = [(m, v) for m, v in model_verdicts if m.gpu_index == index]
        spanned = [v.name for m, v in model_verdicts if v.admitted and m.gpu_index != index and index in model_gpus(m)]
        held = sum(v.vram_bytes for m, v in model_verdicts if v.admitted and index in model_gpus(m))
        train = [v for t, v in training_verdicts if t.gpu_index == index]
        out.append(
            GpuPlan(
                domain=name,
                index=index,
                memory_bytes=g.memory_bytes if g else 0,
                reserve_bytes=g.reserve_bytes if g else 0,
                capacity_bytes=capacity[index],
                held_bytes=held,
                residual_bytes=residual[index],
                training_bytes=sum(v.vram_bytes for v in train if v.admitted),
                models=[v for _m, v in here],
                training=train,
                spanned=spanned,
            )
        )
    held_ram = (
        sum(v.host_ram_bytes for _i, v in (*model_verdicts, *training_verdicts) if v.admitted) if planned_ram else 0
    )
    return DomainPlan(
        domain=name,
        gpus=out,
        host_ram_bytes=domain.spec.host_ram_bytes,
        host_ram_reserve_bytes=domain.spec.host_ram_reserve_bytes,
        host_ram_capacity_bytes=ram_capacity,
        host_ram_held_bytes=held_ram,
    )


# ----------------------------------------------------------------------------------- formatting


def gpu_summary_line(held_bytes: int, capacity_bytes: int, declared: int, admitted: int) -> str:
    """hearth's status line: `42.0 / 44.2 GiB held  (5 declared, 2 admitted)` (held / memory - reserve)."""
    return f"{held_bytes / GiB:.1f} / {format_gib(capacity_bytes)} held  ({declared} declared, {admitted} admitted)"


def shortfall_text(short_by_bytes: int, resource: str = "vram") -> str:
    """`short by 14.8 GiB` (VRAM), `short by 3.0 GiB of host RAM`: the one wording of a refusal."""
    return f"short by {format_gib(short_by_bytes)}" + (" of host RAM" if resource == "host_ram" else "")


def verdict_line(v: Verdict, width: int = 28) -> str:
    """One line per verdict: `gemma4:26b                   not admitted — short by 14.8 GiB`
    (`... short by 3.0 GiB of host RAM` when the VRAM fits and the host RAM does not)."""
    label = v.name if v.kind == "model" else f"training {v.name}"
    if v.admitted:
        on = f" on each of GPUs {', '.join(map(str, v.gpu_indexes))}" if len(v.gpu_indexes) > 1 else ""
        ram = (
            f", {format_gib(v.host_ram_bytes)} host RAM asleep"
            if v.host_ram_bytes and v.kind == "model"
            else f", {format_gib(v.host_ram_bytes)} host RAM"
            if v.host_ram_bytes
            else ""
        )
        return f"{label:<{width}} admitted ({format_gib(v.vram_bytes)}{on}{ram})"
    return f"{label:<{width}} not admitted — {shortfall_text(v.short_by_bytes, v.resource)}"
