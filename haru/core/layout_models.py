"""A layout's models: each model's spec, the GPUs a tensor-parallel model spans, and whether its runtime
can serve it as declared (format, args, adapters, the GPUs it is pinned to).
"""

from __future__ import annotations

from haru.core.errors import InvalidName, LayoutError
from haru.core.launch import ArgConflict, BadBinary, check_args, format_refusal, runtime_for
from haru.core.layout_doc import ModelDoc, size_at
from haru.core.specs import ModelSpec, model_gpus
from haru.core.subjects import check_model_id

__all__ = ["check_launch", "model_from", "model_gpus_from"]


def model_gpus_from(m: ModelDoc, slot_gpu: int, runtime: str, declared: dict[int, int], mp: str) -> list[int]:
    """A tensor-parallel model's GPUs, the slot's first ([] for one GPU). Each declared on the domain, once."""
    if not m.gpus:
        return []
    gp = f"{mp}.gpus"
    if runtime == "external":
        raise LayoutError(
            f"external model {m.name!r} declares gpus; Haru does not place an external endpoint",
            path=gp,
            fix="remove gpus",
        )
    seen: list[int] = []
    for k, index in enumerate(m.gpus):
        if index not in declared:
            raise LayoutError(
                f"model {m.name!r} spans GPU {index}, which the domain does not declare",
                path=f"{gp}[{k}]",
                fix=f"use the domain's GPU indexes ({', '.join(map(str, sorted(declared)))}) or declare GPU {index}",
            )
        if index in seen:
            raise LayoutError(
                f"GPU {index} is listed twice in model {m.name!r}'s gpus", path=f"{gp}[{k}]", fix="list each GPU once"
            )
        seen.append(index)
    if slot_gpu not in seen:
        raise LayoutError(
            f"model {m.name!r} spans GPUs {seen} but its slot is on GPU {slot_gpu}",
            path=gp,
            fix=f"include the slot's GPU {slot_gpu} in gpus, or move the slot to one of them",
        )
    if len(seen) == 1:
        return []
    return [slot_gpu, *(i for i in seen if i != slot_gpu)]


def model_from(m: ModelDoc, slot: str, gpu: int, mp: str, *, direct: bool, domain: str) -> ModelSpec:
    try:
        check_model_id(m.name)
    except InvalidName as exc:
        raise LayoutError(
            str(exc), path=f"{mp}.name", fix="use the exact OpenAI model id clients send, with no whitespace"
        ) from None
    runtime = m.runtime or runtime_for(m.source, m.url)
    vram = size_at(m.vram, f"{mp}.vram", "model VRAM")
    if runtime != "external" and vram <= 0:
        raise LayoutError(
            f"model {m.name!r} declares no VRAM",
            path=f"{mp}.vram",
            fix='declare what its runtime holds on the GPU, e.g. "vram": "20GiB"',
        )
    if runtime == "external" and not m.url:
        raise LayoutError(
            f"external model {m.name!r} has no url",
            path=f"{mp}.url",
            fix='give the base URL of the running endpoint, e.g. "http://10.0.0.5:8000"',
        )
    if direct and runtime != "external" and not m.port:
        raise LayoutError(
            f"model {m.name!r} has no port, and domain {domain!r} serves direct",
            path=f"{mp}.port",
            fix="give each runtime the port routers reach it on, or use serve: agent",
        )
    binary = [m.binary] if isinstance(m.binary, str) else list(m.binary)
    return ModelSpec(
        name=m.name,
        slot=slot,
        gpu_index=gpu,
        runtime=runtime,
        vram_bytes=vram,
        context_length=m.context_length,
        port=m.port,
        source=m.source,
        url=m.url,
        binary=binary,
        args=list(m.args),
        env=dict(m.env),
        adapters=dict(m.adapters),
        gpu_layers=m.gpu_layers,
        max_loras=m.max_loras,
        max_lora_rank=m.max_lora_rank,
        adapter_probes={k: list(v) for k, v in m.adapter_probes.items()},
    )


def check_launch(spec: ModelSpec, named: str, mp: str, gpu_memory_bytes: int) -> None:
    """The runtime can serve the model's format, and the model's args do not contradict its plan."""
    why = format_refusal(spec.runtime, spec.source, spec.name)
    if why:
        other = runtime_for(spec.source, spec.url) if spec.source else ""
        if spec.runtime == "vllm" and not spec.source:
            fix = "set source to the model directory or Hugging Face repository id vLLM loads"
        elif other and other != spec.runtime:
            fix = f'use "runtime": "{other}", or a source that {spec.runtime} serves'
        else:
            fix = (
                "set source to the .gguf file llama-server loads"
                if spec.runtime == "llama_server"
                else "set source to a model directory or a Hugging Face repository id"
            )
        path = f"{mp}.runtime" if named and spec.source else f"{mp}.source"
        raise LayoutError(f"model {spec.name!r} cannot run on {spec.runtime}: {why}", path=path, fix=fix)
    if spec.gpu_layers < -1:
        raise LayoutError(
            f"gpu_layers {spec.gpu_layers} is negative",
            path=f"{mp}.gpu_layers",
            fix="use -1 (every layer, the default), 0 (CPU only) or a layer count",
        )
    if spec.gpu_layers >= 0 and spec.runtime != "llama_server":
        raise LayoutError(
            f"gpu_layers is a llama-server setting; model {spec.name!r} runs on {spec.runtime}",
            path=f"{mp}.gpu_layers",
            fix="remove it",
        )
    for adapter, path in spec.adapters.items():
        if spec.runtime not in ("vllm", "llama_server"):
            raise LayoutError(
                f"model {spec.name!r} runs on {spec.runtime}, which Haru does not launch, so it cannot load adapters",
                path=f"{mp}.adapters",
                fix="remove them",
            )
        if not adapter.strip() or not path.strip() or "=" in adapter or " " in adapter:
            raise LayoutError(
                f"adapter {adapter!r} -> {path!r} needs a name without spaces or '=' and a path",
                path=f"{mp}.adapters",
                fix='write "adapters": {"sql-lora": "/srv/loras/sql"}',
            )
    if spec.max_loras and spec.runtime != "vllm":
        raise LayoutError(
            f"max_loras loads adapters at run time, which only vLLM can; model {spec.name!r} runs on "
            f"{spec.runtime}"
            + (
                " (llama-server scales the adapters it loaded at start, --lora, and cannot load one later)"
                if spec.runtime == "llama_server"
                else ""
            ),
            path=f"{mp}.max_loras",
            fix='remove it, or declare the adapters at start: "adapters": {"sql": "/srv/loras/sql.gguf"}',
        )
    for name in spec.adapter_probes:
        if not spec.max_loras:
            raise LayoutError(
                f"adapter_probes names {name!r}, but model {spec.name!r} loads no adapter at run time",
                path=f"{mp}.adapter_probes",
                fix="set max_loras (how many adapter versions its runtime may hold at once)",
            )
    visible = spec.env.get("CUDA_VISIBLE_DEVICES")
    listed = [v.strip() for v in visible.split(",")] if visible is not None else []
    missing = [i for i in model_gpus(spec) if str(i) not in listed]
    if visible is not None and spec.runtime != "external" and missing:
        # The plan's GPUs (the slot's, or a tensor-parallel model's every one) must all be visible.
        raise LayoutError(
            f"env CUDA_VISIBLE_DEVICES={visible!r} does not include the plan's GPU "
            f"{', '.join(map(str, missing))} (the slot's gpu, or the model's gpus)",
            path=f"{mp}.env.CUDA_VISIBLE_DEVICES",
            fix="remove it (the agent pins the runtime to its GPUs), or move the slot to the GPU it names",
        )
    try:
        check_args(spec, gpu_memory_bytes)
    except ArgConflict as exc:
        raise LayoutError(f"model {spec.name!r}: {exc}", path=f"{mp}.args[{exc.index}]", fix=exc.fix) from None
    except BadBinary as exc:
        raise LayoutError(
            f"model {spec.name!r}: {exc}",
            path=f"{mp}.binary",
            fix='name vllm itself ("binary": ["/opt/vllm/bin/vllm"]), or its interpreter with '
            '"-m", "vllm.entrypoints.openai.api_server"; or remove binary (the managed vLLM, '
            "else vllm from PATH)",
        ) from None
