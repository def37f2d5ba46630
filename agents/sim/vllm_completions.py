"""The simulated vLLM's answers: chat and text completions (whole or streamed), embeddings, and /tokenize.

A reply's first token names the domain that answered (`[domain a] hello from <model> on the simulated
GPU.`), so a test sees which domain served it; a corrupted wake answers other text, a dropped adapter
answers as the base model. Tokens come at HARU_SIM_TOKENS_PER_S.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import time
import uuid
import zlib
from dataclasses import dataclass

from aiohttp import web

from haru.agents.sim.vllm_engine import ENGINE, check_engine, error, read_json


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


def _continued_prefix(body: dict, prefill: bool) -> str | None | web.Response:
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
    if final_assistant and prefill:
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


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's POST /tokenize: {"model", "prompt"} or {"model", "messages", ...} → {"count", "tokens",
    "max_model_len"}, counted as the simulator's usage counts (`_prompt_tokens`)."""
    engine = request.app[ENGINE]
    body = await read_json(request)
    if isinstance(body, web.Response):
        return body
    model = check_engine(engine, body)
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


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    chat = request.path.endswith("/chat/completions")
    body = await read_json(request)
    if isinstance(body, web.Response):
        return body
    if chat and not isinstance(body.get("messages"), list):
        return error(400, "`messages` is required and must be a list", "BadRequestError", "messages")
    if not chat and "prompt" not in body:
        return error(400, "`prompt` is required", "BadRequestError", "prompt")
    model = check_engine(engine, body)
    if isinstance(model, web.Response):
        return model
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        return error(400, "`max_tokens` must be a positive integer", "BadRequestError", "max_tokens")
    prefix = _continued_prefix(body, engine.config.prefill) if chat else None
    if isinstance(prefix, web.Response):
        return prefix
    # a dropped adapter answers as the base model; a corrupted wake answers other text
    answering = engine.config.name if model in engine.config.adapters and engine.adapters_dropped else model
    answering = engine.loras.get(model, answering)  # an adapter loaded at run time answers as its files say
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
    body = await read_json(request)
    if isinstance(body, web.Response):
        return body
    model = check_engine(engine, body)
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


def _vector(text: str, dim: int = 16) -> list[float]:
    """A deterministic unit vector for `text`."""
    digest = hashlib.sha256(text.encode()).digest()
    raw = [(b - 127.5) / 127.5 for b in digest[:dim]]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]
