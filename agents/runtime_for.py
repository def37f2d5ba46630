"""Each model's runtime on this host: the kind its spec names, bound where the serving rule says, sized by
the memory of the GPUs its slot declares (agents/runtimes/)."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from haru.agents.current import CurrentSlots
from haru.agents.runtimes import Runtime, make_runtime
from haru.core.specs import ModelSpec, model_gpus

__all__ = ["RuntimeFor"]


class RuntimeFor:
    def __init__(
        self, current: CurrentSlots, *, session: aiohttp.ClientSession, log_dir: Path, bind_host: str, real_gpus: bool
    ) -> None:
        """`bind_host`: where runtimes listen (loopback, unless the domain is `serve: direct`); `real_gpus`:
        the host's GPUs are NVML's (a llama-server must then have a GPU backend to offload)."""
        self.current = current
        self.session = session
        self.log_dir = log_dir
        self.bind_host = bind_host
        self.real_gpus = real_gpus

    def __call__(self, spec: ModelSpec) -> Runtime:
        gpu_memory = self.current.gpu_memory_bytes()
        return make_runtime(
            spec,
            session=self.session,
            log_dir=self.log_dir,
            bind_host=self.bind_host,
            gpu_memory_bytes=max(gpu_memory.get(i, 0) for i in model_gpus(spec)),
            real_gpus=self.real_gpus,
        )
