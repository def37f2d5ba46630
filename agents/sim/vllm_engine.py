"""The simulated vLLM's engine state (one per process) and the checks every request passes.

Engine       what the engine is doing: sleeping, evicted, and the faults injected (/_sim/*)
error(...)   vLLM's (OpenAI's) error body
read_json    a request's JSON object, or the 400 vLLM answers
check_engine the served name a request asks for, or the error vLLM would answer (404, a lost GPU's
             500, a sleeping engine's 503, an injected failure)
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from aiohttp import web

from haru.agents.sim.errors import SimError
from haru.agents.sim.gpu_state import SimGpuState
from haru.agents.sim.vllm_config import SimConfig
from haru.core.sizes import format_size


@dataclass
class Engine:
    """The simulated engine's state; one per process."""

    config: SimConfig
    gpu: SimGpuState
    sleeping: bool = False
    sleep_level: int = 0
    evicted: bool = False
    fail_probe: bool = False
    oom_on_wake: bool = False
    hung: bool = False
    kv_cache_bytes: int = 0
    mis_sized: bool = False
    corrupt_wake: bool = False  # armed: every wake from now on answers other text
    corrupted: bool = False  # woken wrongly: the answers are not the model's
    drop_adapter: bool = False  # armed: the next wake stops applying the adapters
    frees_nothing: bool = False  # a sleep keeps the memory (paused, not asleep)
    adapters_dropped: bool = False
    # Adapters loaded at run time: name -> what it answers as (its adapter_config.json's `haru_sim_says`,
    # else its name). A level-2 sleep drops them all (vLLM reloads lazily after such a wake; the simulator
    # answers 404 until they are loaded again, so a test sees what was dropped).
    loras: dict[str, str] = field(default_factory=dict)
    failing_loras: set[str] = field(default_factory=set)  # /_sim/fail_lora: its requests answer 500
    released: asyncio.Event = field(default_factory=asyncio.Event)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def gpu_present(self) -> bool:
        try:
            return self.gpu.read()["present"]
        except SimError:
            return False

    def oom_message(self, wanted: int) -> str:
        try:
            state = self.gpu.read()
            free, total = state["memory_free_bytes"], state["memory_total_bytes"]
        except SimError:
            free = total = 0
        return (
            f"CUDA Error: out of memory: tried to allocate {format_size(wanted)}; GPU {self.config.gpu_index} "
            f"has a total capacity of {format_size(total)} of which {format_size(free)} is free"
        )


ENGINE = web.AppKey("engine", Engine)


def error(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    """vLLM's (OpenAI's) error shape."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


async def read_json(request: web.Request) -> dict | web.Response:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return error(400, f"request body is not JSON: {exc}", "BadRequestError")
    if not isinstance(body, dict):
        return error(400, "request body must be a JSON object", "BadRequestError")
    return body


def check_engine(engine: Engine, body: dict) -> web.Response | str:
    """The served name the request asks for, or the error vLLM would answer."""
    model = body.get("model") or engine.config.name
    if not isinstance(model, str):
        return error(400, "`model` must be a string", "BadRequestError", "model")
    if (model not in engine.config.names + engine.config.adapters and model not in engine.loras) or engine.evicted:
        return error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    if not engine.gpu_present():
        return error(
            500,
            f"CUDA error: GPU {engine.config.gpu_index} has fallen off the bus (GPU is lost)",
            "InternalServerError",
        )
    if engine.sleeping:
        return error(
            503,
            f"the engine is sleeping (level {engine.sleep_level}); POST /wake_up before sending requests",
            "ServiceUnavailableError",
        )
    if engine.fail_probe:
        return error(500, "simulated engine failure (fail_probe injected)", "InternalServerError")
    if model in engine.failing_loras:
        return error(500, f"simulated failure of adapter {model} (fail_lora injected)", "InternalServerError")
    return model
