"""A simulated vLLM server: a real HTTP process that speaks vLLM's OpenAI-compatible API.

    python -m haru.agents.sim.vllm serve <source> --host 127.0.0.1 --port P --served-model-name NAME \
        [--enable-sleep-mode] [any other vllm flag, accepted and ignored]

The argv is `vllm serve`'s, so the agent spawns it through the same code path as real vLLM with only
the binary changed. Configuration comes from the environment (see docs/sim.md): HARU_SIM_DIR,
HARU_SIM_GPU_INDEX, HARU_SIM_DOMAIN, HARU_SIM_VRAM, HARU_SIM_LOAD_MS, HARU_SIM_WAKE_MS,
HARU_SIM_SLEEP_MS, HARU_SIM_TOKENS_PER_S, HARU_SIM_RESIDUAL, HARU_SIM_GPU_MEMORY.

Start-up follows real vLLM: the port is bound (not listening) first, so nobody else takes it; the
model "loads" for HARU_SIM_LOAD_MS holding its VRAM on the simulated GPU; only then does the HTTP
server listen. While loading, a connection is refused (real vLLM binds its socket before building
the engine and starts uvicorn after), so "the child is alive but refuses connections" means loading.

Start-up memory profiling, as vLLM does it: the weights are taken, then a profiling pass runs for
HARU_SIM_LOAD_MS, and the KV cache gets what is left of the instance's share (HARU_SIM_VRAM minus
HARU_SIM_WEIGHTS, half of it by default). What other processes hold on the GPU is read before and
after that pass: more held after (a neighbour started, or woke) is counted as the instance's own
non-torch memory, so its cache is mis-sized by that much, or, if nothing is left, it exits like vLLM
("No available memory for the cache blocks"); less held after (a neighbour exited or slept) fails
vLLM's profiling assertion ("Error in memory profiling"). Each start-up appends one line to
`<sim_dir>/profiles.jsonl` (pid, model, GPU, window, KV bytes, mis-sized, error), which tests read to
prove the agent never starts two on one GPU at once. HARU_SIM_PROFILE=0 turns the check off.

Fault injection (loopback only): POST /_sim/crash | evict | hang | oom_on_wake | fail_probe | reset,
GET /_sim/state.

LoRA adapters named by `--lora-modules NAME=PATH ...` are served under their names (their answers
name the adapter). Fault injection (loopback only): POST /_sim/crash | evict | hang | oom_on_wake |
fail_probe | sleep_frees_nothing (a sleep pauses the engine and keeps its memory, as vLLM does on a
platform without sleep mode) | corrupt_wake (every wake after it answers other text, like a wake with stale or wrong
weights) | drop_adapter (after the next wake, an adapter's requests answer as the base model: the
adapter silently stops applying) | reset, GET /_sim/state.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import re
import signal
import socket
import sys
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from haru.agents.sim.errors import SimError
from haru.agents.sim.gpu_state import SimGpuState, parse_size
from haru.core.sizes import GiB, MiB, format_size
from haru.core.subjects import model_token

VERSION = "0.0.0+haru.sim"
DEFAULT_GPU_MEMORY = 24 * GiB


# ---------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class SimConfig:
    source: str
    names: tuple[str, ...]
    host: str
    port: int
    sleep_mode: bool
    dev_mode: bool
    sim_dir: Path
    gpu_index: int
    domain: str
    vram: int
    residual: int
    gpu_memory: int
    load_ms: int
    wake_ms: int
    sleep_ms: int
    tokens_per_s: float
    weights: int = 0  # 0 = half the VRAM
    profile: bool = True
    adapters: tuple[str, ...] = ()  # served under their names (--lora-modules NAME=PATH)

    @property
    def name(self) -> str:
        return self.names[0]


def runtime_path(sim_dir: str | os.PathLike[str], model: str) -> Path:
    """`<sim_dir>/runtime-<model token>.json`: where a running sim server says who and where it is."""
    return Path(sim_dir) / f"runtime-{model_token(model)}.json"


def default_gpu_index(env: dict[str, str]) -> int:
    if env.get("HARU_SIM_GPU_INDEX"):
        return int(env["HARU_SIM_GPU_INDEX"])
    visible = env.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(visible) if visible.isdigit() else 0


def parse_config(argv: list[str], env: dict[str, str]) -> SimConfig:
    parser = argparse.ArgumentParser(prog="haru.agents.sim.vllm", description="simulated vLLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("source", help="the model (path or hub id) vLLM would load")
    serve.add_argument("--lora-modules", nargs="+", default=[])
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", nargs="+", default=None)
    serve.add_argument("--enable-sleep-mode", action="store_true")
    args, _ignored = parser.parse_known_args(argv)
    sim_dir = env.get("HARU_SIM_DIR")
    if not sim_dir:
        parser.error("HARU_SIM_DIR is not set; set it to the simulated host's directory (e.g. ~/.haru/sim/a)")
    return SimConfig(
        source=args.source,
        names=tuple(args.served_model_name or [args.source]),
        host=args.host,
        adapters=tuple(m.split("=", 1)[0] for m in args.lora_modules),
        port=args.port,
        sleep_mode=args.enable_sleep_mode,
        dev_mode=env.get("VLLM_SERVER_DEV_MODE", "0") == "1",
        sim_dir=Path(sim_dir),
        gpu_index=default_gpu_index(env),
        domain=env.get("HARU_SIM_DOMAIN", "sim"),
        vram=parse_size(env.get("HARU_SIM_VRAM", "4GiB")),
        residual=parse_size(env.get("HARU_SIM_RESIDUAL", str(256 * MiB))),
        gpu_memory=parse_size(env.get("HARU_SIM_GPU_MEMORY", str(DEFAULT_GPU_MEMORY))),
        load_ms=int(env.get("HARU_SIM_LOAD_MS", "300")),
        wake_ms=int(env.get("HARU_SIM_WAKE_MS", "100")),
        sleep_ms=int(env.get("HARU_SIM_SLEEP_MS", "50")),
        tokens_per_s=float(env.get("HARU_SIM_TOKENS_PER_S", "200")),
        weights=parse_size(env.get("HARU_SIM_WEIGHTS", "0")),
        profile=env.get("HARU_SIM_PROFILE", "1") != "0",
    )


# ------------------------------------------------------------------------------ memory profiling


@dataclass(frozen=True)
class Profiled:
    """The outcome of start-up profiling: the KV cache it sized, and vLLM's error if it could not."""

    kv_cache_bytes: int
    planned_kv_bytes: int
    error: str = ""

    @property
    def mis_sized(self) -> bool:
        return self.kv_cache_bytes != self.planned_kv_bytes


def profile_outcome(vram: int, weights: int, others_before: int, others_after: int, gpu_total: int) -> Profiled:
    """What vLLM's start-up profiling concludes when the other processes on the GPU held
    `others_before` bytes as it began and `others_after` as it ended. Pure."""
    weights = weights or vram // 2
    planned = max(0, vram - weights)
    if others_after < others_before:
        before_free = max(0, gpu_total - others_before - vram)
        after_free = max(0, gpu_total - others_after - vram)
        return Profiled(
            0,
            planned,
            (
                f"AssertionError: Error in memory profiling. Initial free memory {before_free / GiB:.2f} GiB, current "
                f"free memory {after_free / GiB:.2f} GiB. This happens when other processes sharing the same container "
                f"release GPU memory while vLLM is profiling during initialization. To fix this, ensure consistent GPU "
                f"memory allocation or isolate vLLM in its own container."
            ),
        )
    kv = planned - (others_after - others_before)
    if kv <= 0:
        return Profiled(
            0,
            planned,
            "ValueError: No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine.",
        )
    return Profiled(kv, planned)


def _others(gpu: SimGpuState, pid: int) -> int:
    try:
        allocations = gpu.read()["allocations"]
    except SimError:
        return 0
    return sum(n for key, n in allocations.items() if key != str(pid))


# ---------------------------------------------------------------------------------------- engine


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


def _tokens(
    domain: str, model: str, max_tokens: int | None, ignore_eos: bool, corrupted: bool = False
) -> tuple[list[str], str]:
    """The reply, as tokens, and the finish reason. The first token names the domain."""
    words = [f"[domain {domain}]", " hello", " from", f" {model}", " on", " the", " simulated", " GPU", "."]
    if corrupted:
        words = [f"[domain {domain}]", " ##", " garbled", " after", " wake", " ##", ".", ".", "."]
    filler = [" lorem", " ipsum", " dolor", " sit", " amet"]
    if ignore_eos and max_tokens:
        out = [words[i] if i < len(words) else filler[i % len(filler)] for i in range(max_tokens)]
        return out, "length"
    if max_tokens is not None and max_tokens < len(words):
        return words[:max_tokens], "length"
    return words, "stop"


# ------------------------------------------------------------------------- continuing a message
# Both ways a runtime is asked to continue an assistant message (the gateway's continued streams,
# gateway/resume.py): vLLM's `continue_final_message: true` with `add_generation_prompt: false`, and
# llama-server's assistant prefill (a final assistant message is continued as it is), which the
# simulator follows when HARU_SIM_PREFILL=1. Without either, a final assistant message is history and
# the reply starts afresh, as real vLLM's does.


def _continued_prefix(body: dict) -> str | None | web.Response:
    """The assistant text to continue (None: a fresh reply), or vLLM's 400 for a request it refuses."""
    messages = body["messages"]
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    final_assistant = last.get("role") == "assistant"
    if body.get("continue_final_message"):
        if body.get("add_generation_prompt", True):
            return error(
                400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.", "BadRequestError"
            )
        if not final_assistant:
            return error(
                400,
                "`continue_final_message` needs the last message to be an assistant message",
                "BadRequestError",
                "messages",
            )
        return str(last.get("content") or "")
    if final_assistant and os.environ.get("HARU_SIM_PREFILL") == "1":
        return str(last.get("content") or "")
    return None


def _continuation(
    domain: str, model: str, prefix: str, max_tokens: int | None, ignore_eos: bool
) -> tuple[list[str], str]:
    """The rest of the reply after `prefix`: the reply's tokens (`_tokens`, whichever domain began it)
    that the prefix does not hold yet."""
    whole, finish = _tokens(domain, model, None if not ignore_eos else (max_tokens or 0) + 4096, ignore_eos)
    rest = prefix
    done = 0
    for i, token in enumerate(whole):
        if i == 0 and rest.startswith("[domain ") and "]" in rest:
            rest = rest[rest.index("]") + 1 :]  # the first token names the domain that began the reply
        elif rest.startswith(token):
            rest = rest[len(token) :]
        else:
            break
        done += 1
    tokens = whole[done:]
    if max_tokens is not None and max_tokens < len(tokens):
        return tokens[:max_tokens], "length"
    return tokens, finish if not ignore_eos else "length"


# The simulator's tokenizer: its own reply tokens ("[domain a]", " hello", " GPU", ".") are one token each,
# so the text of N streamed chunks counts N; other text counts about a token a word. Its usage and its
# POST /tokenize both count with it, so the two agree, as a real runtime's do.
_TOKEN = re.compile(r"\[domain [^\]]*\]|\s*[^\s.]+(?:\.[^\s.]+)*|\s*\.|\s+")


def split_tokens(text: str) -> list[str]:
    """`text` in the simulator's tokens (joined, they give `text` back)."""
    return _TOKEN.findall(text)


def _prompt_tokens(body: dict) -> int:
    """A request's prompt tokens: each message's content, or the prompt (at least 1)."""
    if "messages" in body:
        n = sum(len(split_tokens(str(m.get("content", "")))) for m in body["messages"] if isinstance(m, dict))
    else:
        prompt = body.get("prompt", "")
        n = sum(len(split_tokens(str(p))) for p in (prompt if isinstance(prompt, list) else [prompt]))
    return max(n, 1)


async def _read_json(request: web.Request) -> dict | web.Response:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return error(400, f"request body is not JSON: {exc}", "BadRequestError")
    if not isinstance(body, dict):
        return error(400, "request body must be a JSON object", "BadRequestError")
    return body


def _check_engine(engine: Engine, body: dict) -> web.Response | str:
    """The served name the request asks for, or the error vLLM would answer."""
    model = body.get("model") or engine.config.name
    if not isinstance(model, str):
        return error(400, "`model` must be a string", "BadRequestError", "model")
    if model not in engine.config.names + engine.config.adapters or engine.evicted:
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
    return model


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    chat = request.path.endswith("/chat/completions")
    body = await _read_json(request)
    if isinstance(body, web.Response):
        return body
    if chat and not isinstance(body.get("messages"), list):
        return error(400, "`messages` is required and must be a list", "BadRequestError", "messages")
    if not chat and "prompt" not in body:
        return error(400, "`prompt` is required", "BadRequestError", "prompt")
    model = _check_engine(engine, body)
    if isinstance(model, web.Response):
        return model
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        return error(400, "`max_tokens` must be a positive integer", "BadRequestError", "max_tokens")
    prefix = _continued_prefix(body) if chat else None
    if isinstance(prefix, web.Response):
        return prefix
    # a dropped adapter answers as the base model; a corrupted wake answers other text
    answering = engine.config.name if model in engine.config.adapters and engine.adapters_dropped else model
    if prefix is None:
        tokens, finish = _tokens(
            engine.config.domain, answering, max_tokens, bool(body.get("ignore_eos")), engine.corrupted
        )
    else:
        tokens, finish = _continuation(
            engine.config.domain, answering, prefix, max_tokens, bool(body.get("ignore_eos"))
        )
    prompt_tokens = _prompt_tokens(body)
    answer = _Answer(
        chat=chat,
        model=model,
        tokens=tokens,
        finish=finish,
        rid=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
        created=int(time.time()),
        delay=1.0 / engine.config.tokens_per_s if engine.config.tokens_per_s > 0 else 0.0,
        usage={
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + len(tokens),
            "completion_tokens": len(tokens),
        },
    )
    if not body.get("stream"):
        return await _whole(answer)
    return await _streamed(request, answer, bool((body.get("stream_options") or {}).get("include_usage")))


@dataclass(frozen=True, kw_only=True)
class _Answer:
    """What a completion answers, before it is written whole or streamed."""

    chat: bool
    model: str
    tokens: list[str]
    finish: str
    rid: str
    created: int
    delay: float  # seconds a token
    usage: dict[str, int]


async def _whole(a: _Answer) -> web.Response:
    await asyncio.sleep(a.delay * len(a.tokens))
    text = "".join(a.tokens)
    if a.chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": a.finish,
            "stop_reason": None,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": a.finish, "stop_reason": None}
    obj = "chat.completion" if a.chat else "text_completion"
    return web.json_response(
        {"id": a.rid, "object": obj, "created": a.created, "model": a.model, "choices": [choice], "usage": a.usage}
    )


async def _streamed(request: web.Request, a: _Answer, include_usage: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    obj = "chat.completion.chunk" if a.chat else "text_completion"

    async def send(choices: list[dict], extra: dict | None = None) -> None:
        chunk = {"id": a.rid, "object": obj, "created": a.created, "model": a.model, "choices": choices}
        if extra:
            chunk.update(extra)
        await response.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")

    if a.chat:
        await send(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        )
    for i, token in enumerate(a.tokens):
        await asyncio.sleep(a.delay)
        last = i == len(a.tokens) - 1
        if a.chat:
            choice = {"index": 0, "delta": {"content": token}, "logprobs": None, "finish_reason": None}
        else:
            choice = {"index": 0, "text": token, "logprobs": None, "finish_reason": a.finish if last else None}
        await send([choice])
    if a.chat:
        await send([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": a.finish, "stop_reason": None}])
    if include_usage:
        await send([], {"usage": a.usage})
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def embeddings(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await _read_json(request)
    if isinstance(body, web.Response):
        return body
    model = _check_engine(engine, body)
    if isinstance(model, web.Response):
        return model
    inputs = body.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs:
        return error(400, "`input` is required: a string or a list of strings", "BadRequestError", "input")
    data = [{"object": "embedding", "index": i, "embedding": _vector(str(text))} for i, text in enumerate(inputs)]
    n = sum(max(len(str(text).split()), 1) for text in inputs)
    return web.json_response(
        {
            "id": "embd-" + uuid.uuid4().hex,
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0},
        }
    )


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's POST /tokenize: {"model", "prompt"} or {"model", "messages", ...} → {"count", "tokens",
    "max_model_len"}, counted as the simulator's usage counts (`_prompt_tokens`)."""
    engine = request.app[ENGINE]
    body = await _read_json(request)
    if isinstance(body, web.Response):
        return body
    model = _check_engine(engine, body)
    if isinstance(model, web.Response):
        return model
    if "messages" in body:
        if not isinstance(body["messages"], list):
            return error(400, "`messages` must be a list", "BadRequestError", "messages")
        if body.get("continue_final_message") and body.get("add_generation_prompt", True):
            return error(
                400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.", "BadRequestError"
            )
        texts = [str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict)]
    elif isinstance(body.get("prompt"), str):
        texts = [body["prompt"]]
    else:
        return error(400, "`prompt` (a string) or `messages` is required", "BadRequestError", "prompt")
    pieces = [t for text in texts for t in split_tokens(text)] or [""]
    ids = [zlib.crc32(p.encode()) % 32000 for p in pieces]
    return web.json_response({"count": len(ids), "tokens": ids, "max_model_len": 4096})


def _vector(text: str, dim: int = 16) -> list[float]:
    """A deterministic unit vector for `text`."""
    digest = hashlib.sha256(text.encode()).digest()
    raw = [(b - 127.5) / 127.5 for b in digest[:dim]]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]


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
            for name in engine.config.adapters
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
    elif fault == "reset":
        engine.hung = engine.fail_probe = engine.oom_on_wake = False
        engine.corrupt_wake = engine.corrupted = engine.drop_adapter = engine.adapters_dropped = False
        engine.frees_nothing = False
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
    app.router.add_get("/_sim/state", sim_state)
    app.router.add_post("/_sim/{fault}", sim_fault)
    return app


# ------------------------------------------------------------------------------------ the process


def _record_profile(config: SimConfig, pid: int, began: float, ended: float, outcome: Profiled) -> None:
    line = json.dumps(
        {
            "pid": pid,
            "model": config.name,
            "gpu_index": config.gpu_index,
            "began": began,
            "ended": ended,
            "kv_cache_bytes": outcome.kv_cache_bytes,
            "planned_kv_bytes": outcome.planned_kv_bytes,
            "mis_sized": outcome.mis_sized,
            "error": outcome.error,
        }
    )
    with open(config.sim_dir / "profiles.jsonl", "a") as fh:  # one short line: an O_APPEND write is whole
        fh.write(line + "\n")


def _log(message: str) -> None:
    print(f"(haru-sim-vllm pid={os.getpid()}) {message}", file=sys.stderr, flush=True)


async def serve(config: SimConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    # Bind (do not listen) first, like vLLM: the port is ours, but connections are refused until loaded.
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
    except OSError as exc:
        _log(f"ERROR: cannot bind {config.host}:{config.port}: {exc}")
        return 1
    port = sock.getsockname()[1]

    pid = os.getpid()
    gpu = SimGpuState(config.sim_dir, config.gpu_index)
    gpu.ensure(config.gpu_memory)
    rt_path = runtime_path(config.sim_dir, config.name)
    rt_path.write_text(
        json.dumps(
            {
                "pid": pid,
                "port": port,
                "host": config.host,
                "model": config.name,
                "names": list(config.names),
                "domain": config.domain,
                "gpu_index": config.gpu_index,
            }
        )
    )
    engine = Engine(config=config, gpu=gpu)
    runner: web.AppRunner | None = None
    try:
        _log(
            f"loading {config.source} as {config.name!r} for domain {config.domain!r} "
            f"({format_size(config.vram)} on GPU {config.gpu_index}, {config.load_ms} ms)"
        )
        if not engine.gpu_present():
            _log(f"RuntimeError: CUDA error: no CUDA-capable device is detected (GPU {config.gpu_index} is absent)")
            return 1
        if not gpu.allocate(pid, config.vram):
            _log(f"torch.OutOfMemoryError: CUDA out of memory. {engine.oom_message(config.vram)}")
            return 1
        began, before = time.time(), _others(gpu, pid)
        with contextlib.suppress(asyncio.TimeoutError):
            async with asyncio.timeout(config.load_ms / 1000):
                await stop.wait()
        if stop.is_set():
            return 0
        if config.profile:
            total = gpu.read()["memory_total_bytes"]
            outcome = profile_outcome(config.vram, config.weights, before, _others(gpu, pid), total)
            _record_profile(config, pid, began, time.time(), outcome)
            if outcome.error:
                _log(outcome.error)
                return 1
            engine.kv_cache_bytes, engine.mis_sized = outcome.kv_cache_bytes, outcome.mis_sized
            if outcome.mis_sized:
                _log(
                    f"WARNING: KV cache sized to {format_size(outcome.kv_cache_bytes)} instead of "
                    f"{format_size(outcome.planned_kv_bytes)}: another process allocated on GPU {config.gpu_index} "
                    f"while this instance profiled its memory"
                )
        runner = web.AppRunner(build_app(engine), access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        _log(f"Started server process; listening on http://{config.host}:{port}")
        await stop.wait()
        engine.hung = False
        engine.released.set()  # let hung requests finish so shutdown is prompt
        return 0
    finally:
        if runner is not None:
            await runner.cleanup()
        gpu.free(pid)
        with contextlib.suppress(FileNotFoundError):
            rt_path.unlink()
        sock.close()


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(sys.argv[1:] if argv is None else argv, dict(os.environ))
    except SimError as exc:
        print(f"haru.agents.sim.vllm: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
