"""llama-server (llama.cpp, GGUF): `llama-server -m <gguf> --host 127.0.0.1 --port P --alias NAME`.

Its HTTP listener is up before the model: `/health` answers 503 {"error": {"message": "Loading
model"}} while loading and 200 {"status": "ok"} when ready. It has no sleep mode: on a standby
domain a llama-server model stays resident.
"""

from __future__ import annotations

from agents.runtimes.base import ProcessRuntime


class LlamaServerRuntime(ProcessRuntime):
    kind = "llama_server"
    can_sleep = False
    default_binary = ["llama-server"]

    def argv(self) -> list[str]:
        binary = list(self.spec.binary) or managed_binary() or self.default_binary
        return [
            *binary,
            "-m",
            self.spec.source,
            "--host",
            self.bind_host,
            "--port",
            str(self._port),
            "--alias",
            self.spec.name,
            *self.spec.args,
        ]


def managed_binary() -> list[str]:
    """A layout naming no binary gets the managed build (`haru runtime llama`: $HARU_LLAMA_SERVER or the
    cache) when there is one, else `llama-server` from PATH."""
    from agents.runtimes.llama_build import BuildError, find_binary

    try:
        found = find_binary()
    except BuildError:
        return []
    return [str(found)] if found is not None else []
