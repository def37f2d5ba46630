"""Runtimes: vLLM, llama-server and external endpoints behind one interface (`Runtime`)."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from haru.agents.runtimes.base import Health, Runtime
from haru.agents.runtimes.external import ExternalRuntime
from haru.agents.runtimes.llama_server import LlamaServerRuntime
from haru.agents.runtimes.vllm import VllmRuntime
from haru.core.specs import ModelSpec

__all__ = ["Health", "Runtime", "VllmRuntime", "LlamaServerRuntime", "ExternalRuntime", "make_runtime"]


def make_runtime(
    spec: ModelSpec,
    *,
    session: aiohttp.ClientSession,
    log_dir: Path,
    bind_host: str = "127.0.0.1",
    gpu_memory_bytes: int = 0,
    real_gpus: bool = False,
) -> Runtime:
    """The runtime for `spec`; `gpu_memory_bytes` is its GPU's declared memory (vLLM's fraction is of it);
    `real_gpus`: the host's GPUs are NVML's (a llama-server then must have a GPU backend to offload)."""
    if spec.runtime == "vllm":
        return VllmRuntime(
            spec, session=session, log_dir=log_dir, bind_host=bind_host, gpu_memory_bytes=gpu_memory_bytes
        )
    if spec.runtime == "llama_server":
        return LlamaServerRuntime(
            spec,
            session=session,
            log_dir=log_dir,
            bind_host=bind_host,
            gpu_memory_bytes=gpu_memory_bytes,
            real_gpus=real_gpus,
        )
    return ExternalRuntime(spec, session=session)
