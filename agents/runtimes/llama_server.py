"""llama-server (llama.cpp, GGUF): `llama-server -m <gguf> --host 127.0.0.1 --port P --alias NAME -c N -ngl L`.

The command line is the plan's (`haru.core.launch`): `-c` from context_length, `-ngl` from gpu_layers
(every layer unless declared), the GPU by CUDA_VISIBLE_DEVICES.

Its HTTP listener is up before the model: `/health` answers 503 {"error": {"message": "Loading
model"}} while loading and 200 {"status": "ok"} when ready. It has no sleep mode: on a standby
domain a llama-server model stays resident.

On a host with real GPUs (the agent's `gpus: nvml`), a model that offloads layers (`-ngl` other than 0)
is refused at start when the binary lists no GPU device (`--list-devices`): a CPU-only llama-server
accepts `-ngl` and runs on the CPU, while the plan books VRAM for it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import haru.agents.runtimes.llama_backend as llama_backend
from haru.agents.errors import RuntimeRefused
from haru.agents.runtimes.base import ProcessRuntime


class LlamaServerRuntime(ProcessRuntime):
    kind = "llama_server"
    can_sleep = False
    default_binary = ["llama-server"]

    def __init__(self, *args: Any, real_gpus: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.real_gpus = real_gpus  # the domain's GPUs are NVML's, not simulated ones

    async def start(self) -> None:
        if self.real_gpus and not self.alive():
            argv = self.launch().argv
            offloads = "-ngl" in argv and argv[argv.index("-ngl") + 1] != "0"
            if offloads and not await asyncio.to_thread(llama_backend.devices, argv[0]):
                raise RuntimeRefused(
                    f"{self.spec.name}: {argv[0]} has no GPU backend (its --list-devices lists no device), so it "
                    f"would run the model on the CPU while the plan books its VRAM on the GPU; fix: build the "
                    f"CUDA backend with `haru runtime llama` on this host (it does when nvcc and an NVIDIA GPU "
                    f"are there), or set HARU_LLAMA_SERVER to a GPU build, or declare `gpu_layers: 0` to run it "
                    f"on the CPU on purpose"
                )
        await super().start()

    def managed_binary(self) -> list[str]:
        """A layout naming no binary gets the managed build (`haru runtime llama`: $HARU_LLAMA_SERVER or
        the cache) when there is one, else `llama-server` from PATH (the plan's default)."""
        from haru.agents.runtimes.llama_build import BuildError, find_binary

        try:
            found = find_binary()
        except BuildError:
            return []
        return [str(found)] if found is not None else []
