"""A layout's failure domains: the domain's serving rule, its GPUs and host RAM, its slots (inference
slots' models checked in `layout_models`, training slots here), each name, model and port once.
"""

from __future__ import annotations

import re

import msgspec

from haru.core.errors import LayoutError
from haru.core.layout_doc import DomainDoc, SlotDoc, checked_name, size_at
from haru.core.layout_models import check_launch, model_from, model_gpus_from
from haru.core.layout_provision import notice_from, provision_from
from haru.core.specs import Domain, DomainSpec, GpuSpec, ModelSpec, TrainingSpec, model_gpus

__all__ = ["domain_from"]


def domain_from(d: DomainDoc, i: int) -> Domain:
    dp = f"$.domains[{i}]"
    name = checked_name("domain", d.name, f"{dp}.name")
    if d.serving_url and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", d.serving_url):
        raise LayoutError(
            f"serving_url {d.serving_url!r} is not an http(s) URL",
            path=f"{dp}.serving_url",
            fix="write it like 'http://10.0.0.5:8600'",
        )
    if d.serve == "direct" and (d.network != "private" or not d.expose_dev_endpoints):
        raise LayoutError(
            f"domain {name!r} serves direct: its runtimes would listen on the agent's serving host, and vLLM's "
            f"development-mode endpoints (/sleep, /wake_up, /is_sleeping: anyone who reaches them can put a model "
            f"to sleep) with them, with no token in front",
            path=f"{dp}.serve",
            fix='use "serve": "agent" (one authenticated port, sleep and wake never leave the host), or say the '
            'network is private and that this is acceptable there: "network": "private", "expose_dev_endpoints": true',
        )
    gpus = _gpus(d, name, dp)
    gpu_memory = {g.index: g.memory_bytes for g in gpus}
    models: list[ModelSpec] = []
    training: list[TrainingSpec] = []
    seen_slots: dict[str, str] = {}
    seen_models: dict[str, str] = {}
    seen_ports: dict[int, str] = {}
    for j, s in enumerate(d.slots):
        sp = f"{dp}.slots[{j}]"
        slot = checked_name("slot", s.name, f"{sp}.name")
        if slot in seen_slots:
            raise LayoutError(
                f"slot {slot!r} is declared twice on domain {name!r}",
                path=f"{sp}.name",
                fix=f"give each slot its own name (first at {seen_slots[slot]})",
            )
        seen_slots[slot] = sp
        if s.gpu not in gpu_memory:
            raise LayoutError(
                f"slot {slot!r} is on GPU {s.gpu}, which domain {name!r} does not declare",
                path=f"{sp}.gpu",
                fix=f"use one of the domain's GPU indexes ({', '.join(map(str, sorted(gpu_memory)))}) "
                f"or declare GPU {s.gpu}",
            )
        if s.kind == "training":
            training.append(_training(s, slot, sp))
            continue
        if not s.models:
            raise LayoutError(
                f"inference slot {slot!r} has no models",
                path=f"{sp}.models",
                fix='add "models": [{"name": "...", "vram": "..."}] or remove the slot',
            )
        for k, m in enumerate(s.models):
            mp = f"{sp}.models[{k}]"
            if m.name in seen_models:
                raise LayoutError(
                    f"model {m.name!r} is declared twice on domain {name!r}",
                    path=f"{mp}.name",
                    fix=f"declare each model once per domain (first at {seen_models[m.name]})",
                )
            seen_models[m.name] = mp
            model = model_from(m, slot, s.gpu, mp, direct=d.serve == "direct", domain=name)
            model = msgspec.structs.replace(
                model,
                gpu_indexes=model_gpus_from(m, s.gpu, model.runtime, gpu_memory, mp),
                host_ram_bytes=size_at(m.host_ram, f"{mp}.host_ram", "model host RAM"),
            )
            if model.port and model.runtime != "external":
                if model.port in seen_ports:
                    raise LayoutError(
                        f"port {m.port} is used twice on domain {name!r}",
                        path=f"{mp}.port",
                        fix=f"give each runtime its own port (first used by {seen_ports[m.port]})",
                    )
                seen_ports[model.port] = mp
            check_launch(model, m.runtime, mp, max(gpu_memory.get(i, 0) for i in model_gpus(model)))
            models.append(model)
    provision = provision_from(d, name, dp) if d.provision is not None else None
    host_ram, host_ram_reserve = _host_ram(d, name, dp)
    spec = DomainSpec(
        name=name,
        provider=d.provider,
        region=d.region,
        serving_url=d.serving_url,
        serve=d.serve,
        gpus=gpus,
        provision=provision,
        preemption_notice=notice_from(d.preemption_notice, dp),
        host_ram_bytes=host_ram,
        host_ram_reserve_bytes=host_ram_reserve,
    )
    return Domain(spec=spec, models=models, training=training)


def _host_ram(d: DomainDoc, name: str, dp: str) -> tuple[int, int]:
    """The domain's host RAM and its reserve (0, 0: not declared, not planned)."""
    host_ram = size_at(d.host_ram, f"{dp}.host_ram", "host RAM")
    reserve = size_at(d.host_ram_reserve, f"{dp}.host_ram_reserve", "host RAM reserve")
    if reserve and not host_ram:
        raise LayoutError(
            f"domain {name!r} declares a host RAM reserve but no host RAM",
            path=f"{dp}.host_ram",
            fix='declare the host\'s RAM too, e.g. "host_ram": "256GiB", or remove the reserve',
        )
    if reserve > host_ram:
        raise LayoutError(
            f"domain {name!r} host RAM reserve ({reserve} bytes) exceeds its host RAM ({host_ram} bytes)",
            path=f"{dp}.host_ram_reserve",
            fix="lower the reserve below the host's RAM",
        )
    return host_ram, reserve


def _gpus(d: DomainDoc, name: str, dp: str) -> list[GpuSpec]:
    gpus: list[GpuSpec] = []
    seen_gpus: dict[int, int] = {}
    for j, g in enumerate(d.gpus):
        gp = f"{dp}.gpus[{j}]"
        if g.index in seen_gpus:
            raise LayoutError(
                f"GPU index {g.index} is declared twice on domain {name!r}",
                path=f"{gp}.index",
                fix=f"remove the duplicate or change its index (first at {dp}.gpus[{seen_gpus[g.index]}])",
            )
        seen_gpus[g.index] = j
        memory = size_at(g.memory, f"{gp}.memory", "GPU memory")
        reserve = size_at(g.reserve, f"{gp}.reserve", "GPU reserve")
        if memory <= 0:
            raise LayoutError(
                f"GPU {g.index} memory is {memory} bytes",
                path=f"{gp}.memory",
                fix="declare the card's memory, e.g. '24GiB'",
            )
        if reserve > memory:
            raise LayoutError(
                f"GPU {g.index} reserve ({reserve} bytes) exceeds its memory ({memory} bytes)",
                path=f"{gp}.reserve",
                fix="lower the reserve below the card's memory",
            )
        gpus.append(GpuSpec(index=g.index, memory_bytes=memory, reserve_bytes=reserve, name=g.name))
    if not gpus:
        raise LayoutError(
            f"domain {name!r} declares no GPUs",
            path=f"{dp}.gpus",
            fix='add "gpus": [{"index": 0, "memory": "24GiB", "reserve": "2GiB"}]',
        )
    return gpus


def _training(s: SlotDoc, slot: str, sp: str) -> TrainingSpec:
    if not s.command:
        raise LayoutError(
            f"training slot {slot!r} has no command",
            path=f"{sp}.command",
            fix='give the argv to run, e.g. ["python", "train.py"]',
        )
    if not s.checkpoint_dir.strip():
        raise LayoutError(
            f"training slot {slot!r} has no checkpoint_dir",
            path=f"{sp}.checkpoint_dir",
            fix="give the directory it checkpoints to (passed as HARU_CHECKPOINT_DIR)",
        )
    vram = size_at(s.vram, f"{sp}.vram", "training VRAM")
    if vram <= 0:
        raise LayoutError(
            f"training slot {slot!r} declares no VRAM budget",
            path=f"{sp}.vram",
            fix='declare what it may use, e.g. "vram": "8GiB"',
        )
    return TrainingSpec(
        slot=slot,
        gpu_index=s.gpu,
        command=list(s.command),
        checkpoint_dir=s.checkpoint_dir,
        vram_bytes=vram,
        grace_ms=s.grace_ms,
        host_ram_bytes=size_at(s.host_ram, f"{sp}.host_ram", "training host RAM"),
    )
