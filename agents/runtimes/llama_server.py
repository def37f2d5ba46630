"""llama-server (llama.cpp, GGUF): `llama-server -m <gguf> --host 127.0.0.1 --port P --alias NAME -c N -ngl L`.

The command line is the plan's (`haru.core.launch`): `-c` from context_length, `-ngl` from gpu_layers
(every layer unless declared), the GPU by CUDA_VISIBLE_DEVICES.

Its HTTP listener is up before the model: `/health` answers 503 {"error": {"message": "Loading
model"}} while loading and 200 {"status": "ok"} when ready. It has no sleep mode: on a standby
domain a llama-server model stays resident.
"""

from __future__ import annotations

from haru.agents.runtimes.base import ProcessRuntime


class LlamaServerRuntime(ProcessRuntime):
    kind = "llama_server"
    can_sleep = False
    default_binary = ["llama-server"]

    def managed_binary(self) -> list[str]:
        """A layout naming no binary gets the managed build (`haru runtime llama`: $HARU_LLAMA_SERVER or
        the cache) when there is one, else `llama-server` from PATH (the plan's default)."""
        from haru.agents.runtimes.llama_build import BuildError, find_binary

        try:
            found = find_binary()
        except BuildError:
            return []
        return [str(found)] if found is not None else []
