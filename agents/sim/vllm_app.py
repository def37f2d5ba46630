"""The simulated vLLM's HTTP API: vLLM's routes, its dev-mode sleep and wake, and fault injection.

build_app(engine)   the aiohttp application: /health, /ping, /version, /v1/models, /v1/chat/completions,
                    /v1/completions, /v1/embeddings, /tokenize, /sleep, /wake_up, /is_sleeping (dev mode only, as
                    vLLM's), /v1/load_lora_adapter and /v1/unload_lora_adapter (with
                    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, as vLLM's), and /_sim/state, /_sim/<fault> (loopback only)
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

from aiohttp import web

from haru.agents.sim.vllm_completions import embeddings, generate, tokenize
from haru.agents.sim.vllm_engine import ENGINE, Engine, error, read_json

VERSION = "0.0.0+haru.sim"


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    created = int(time.time())
    data: list[dict[str, object]] = (
        []
        if engine.evicted
        else [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": engine.config.source,
                "parent": None,
                "max_model_len": 4096,
                "permission": [],
            }
            for name in engine.config.names
        ]
    )
    if not engine.evicted:
        data += [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": f"lora/{name}",
                "parent": engine.config.name,
                "max_model_len": 4096,
                "permission": [],
            }
            for name in (*engine.config.adapters, *engine.loras)
        ]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if not engine.gpu_present():
        return web.Response(status=503)  # vLLM: EngineDeadError -> 503
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": VERSION})


# ----------------------------------------------------------------------------- sleep / wake (dev)


def _dev_only(engine: Engine) -> web.Response | None:
    if not engine.config.dev_mode:
        return web.json_response({"detail": "Not Found"}, status=404)
    return None


async def sleep(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if (refused := _dev_only(engine)) is not None:
        return refused
    if not engine.config.sleep_mode:
        return error(500, "Sleep mode is not enabled; start vllm with --enable-sleep-mode", "InternalServerError")
    try:
        level = int(request.query.get("level", "1"))
    except ValueError:
        return error(400, "level must be 1 or 2", "BadRequestError", "level")
    if level not in (1, 2):
        return error(400, "level must be 1 or 2", "BadRequestError", "level")
    async with engine.lock:
        if not engine.sleeping:
            await asyncio.sleep(engine.config.sleep_ms / 1000)
            if not engine.evicted and not engine.frees_nothing:
                engine.gpu.allocate(os.getpid(), min(engine.config.residual, engine.config.vram))
            engine.sleeping, engine.sleep_level = True, level
        if level == 2:
            engine.loras.clear()  # a level-2 sleep discards the adapters with the weights
    return web.Response(status=200)


async def wake_up(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if (refused := _dev_only(engine)) is not None:
        return refused
    async with engine.lock:
        if not engine.sleeping:
            return web.Response(status=200)
        await asyncio.sleep(engine.config.wake_ms / 1000)
        if not engine.gpu_present():
            return error(500, f"CUDA error: GPU {engine.config.gpu_index} is lost", "InternalServerError")
        if engine.oom_on_wake:
            engine.oom_on_wake = False
            return error(500, engine.oom_message(engine.config.vram), "InternalServerError")
        if not engine.evicted and not engine.gpu.allocate(os.getpid(), engine.config.vram):
            return error(500, engine.oom_message(engine.config.vram), "InternalServerError")
        engine.sleeping, engine.sleep_level = False, 0
        engine.corrupted = engine.corrupted or engine.corrupt_wake
        if engine.drop_adapter:
            engine.drop_adapter, engine.adapters_dropped = False, True
    return web.Response(status=200)


async def is_sleeping(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if (refused := _dev_only(engine)) is not None:
        return refused
    return web.json_response({"is_sleeping": engine.sleeping})


# ------------------------------------------------------------------------- adapters at run time


def _lora_off(engine: Engine) -> web.Response | None:
    if not engine.config.runtime_lora:
        return web.json_response({"detail": "Not Found"}, status=404)  # vLLM registers no such route
    if not engine.config.enable_lora:
        return error(400, "LoRA is not enabled. Please start the server with --enable-lora.", "BadRequestError")
    return None


async def load_lora_adapter(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if (refused := _lora_off(engine)) is not None:
        return refused
    body = await read_json(request)
    if isinstance(body, web.Response):
        return body
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        return error(400, "Both 'lora_name' and 'lora_path' must be provided.", "BadRequestError")
    if name in engine.loras:
        return error(400, f"The lora adapter '{name}' has already been loaded.", "BadRequestError")
    try:
        config = json.loads((Path(path) / "adapter_config.json").read_text())
        rank = int(config.get("r", 0))
    except (OSError, ValueError, TypeError) as exc:
        return error(404, f"Loading lora {name} failed: No adapter found for {path}: {exc}", "NotFoundError")
    if rank > engine.config.max_lora_rank:
        return error(
            400,
            f"LoRA rank {rank} is greater than max_lora_rank {engine.config.max_lora_rank}.",
            "BadRequestError",
        )
    engine.loras[name] = str(config.get("haru_sim_says") or name)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if (refused := _lora_off(engine)) is not None:
        return refused
    body = await read_json(request)
    if isinstance(body, web.Response):
        return body
    name = body.get("lora_name")
    if name not in engine.loras:
        return error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
    del engine.loras[name]
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


# ------------------------------------------------------------------------------- fault injection


def _loopback(request: web.Request) -> bool:
    return request.remote in ("127.0.0.1", "::1", "localhost")


async def sim_fault(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if not _loopback(request):
        return web.json_response({"detail": "Not Found"}, status=404)
    fault = request.match_info["fault"]
    if fault == "crash":
        asyncio.get_running_loop().call_later(0.05, os._exit, 3)
    elif fault == "evict":
        engine.evicted = True
        engine.gpu.free(os.getpid())
    elif fault == "hang":
        engine.hung = True
        engine.released.clear()
    elif fault == "oom_on_wake":
        engine.oom_on_wake = True
    elif fault == "fail_probe":
        engine.fail_probe = True
    elif fault == "corrupt_wake":
        engine.corrupt_wake = True
    elif fault == "sleep_frees_nothing":
        engine.frees_nothing = True
    elif fault == "drop_adapter":
        engine.drop_adapter = True
    elif fault == "fail_lora":
        engine.failing_loras.add(request.query.get("name", ""))
    elif fault == "reset":
        engine.hung = engine.fail_probe = engine.oom_on_wake = False
        engine.corrupt_wake = engine.corrupted = engine.drop_adapter = engine.adapters_dropped = False
        engine.frees_nothing = False
        engine.failing_loras.clear()
        engine.released.set()
    else:
        return web.json_response({"detail": f"no fault {fault!r}"}, status=404)
    return web.json_response({"ok": True, "fault": fault})


async def sim_state(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if not _loopback(request):
        return web.json_response({"detail": "Not Found"}, status=404)
    c = engine.config
    return web.json_response(
        {
            "pid": os.getpid(),
            "model": c.name,
            "names": list(c.names),
            "domain": c.domain,
            "gpu_index": c.gpu_index,
            "vram": c.vram,
            "sleeping": engine.sleeping,
            "evicted": engine.evicted,
            "hung": engine.hung,
            "fail_probe": engine.fail_probe,
            "oom_on_wake": engine.oom_on_wake,
            "gpu_present": engine.gpu_present(),
            "kv_cache_bytes": engine.kv_cache_bytes,
            "mis_sized": engine.mis_sized,
            "adapters": list(c.adapters),
            "corrupt_wake": engine.corrupt_wake,
            "corrupted": engine.corrupted,
            "adapters_dropped": engine.adapters_dropped,
            "loras": dict(engine.loras),
        }
    )


@web.middleware
async def hang_middleware(request: web.Request, handler):
    engine = request.app[ENGINE]
    if engine.hung and not request.path.startswith("/_sim/"):
        await engine.released.wait()
    return await handler(request)


def build_app(engine: Engine) -> web.Application:
    app = web.Application(middlewares=[hang_middleware])
    app[ENGINE] = engine
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_get("/_sim/state", sim_state)
    app.router.add_post("/_sim/{fault}", sim_fault)
    return app
