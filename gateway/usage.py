"""Token usage, read from the responses the gateway relays and rewritten for the streams it continued.

Pure: no I/O, no logging. Three jobs:

- `usage_of` reads `usage` out of a JSON body, decoding nothing else (a Struct of that one field);
- `UsageTap` follows an SSE body as it goes out and keeps the last `usage` it carried, decoding only
  the events that hold the word `"usage"` (the others cost a substring search);
- the continued-stream side (docs/gateway.md, "Continued streams"): `count_requests` are the tokenizer
  calls that count a continuation's prompt on the runtime that serves it, `count_of` reads their answer,
  and `spliced_usage` is the usage a client of a continued stream gets: what its request cost.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from haru.gateway.sse import boundary, events

__all__ = ["Usage", "UsageTap", "usage_of", "count_requests", "count_of", "spliced_usage", "Counted"]

KEEP_PENDING: Final = 1 << 16  # an unfinished SSE event longer than this is not read for usage


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Body(msgspec.Struct):
    usage: Usage | None = None


_body = msgspec.json.Decoder(_Body)
_USAGE: Final = b'"usage"'


def usage_of(body: bytes) -> Usage | None:
    """The `usage` of a JSON response body (None: it has none, or it is not such JSON)."""
    if _USAGE not in body:
        return None
    try:
        return _body.decode(body).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class UsageTap:
    """The last `usage` an SSE body carried, read as the body goes by (`feed` each piece in order).

    The last, because a runtime that reports usage in every chunk (vLLM's `continuous_usage_stats`)
    reports it cumulatively: the last is the total."""

    __slots__ = ("pending", "usage")

    def __init__(self) -> None:
        self.pending = b""
        self.usage: Usage | None = None

    def feed(self, data: bytes) -> None:
        if not self.pending and data.endswith(b"\n\n") and _USAGE not in data:
            return  # whole events, none with usage: the common piece
        if self.pending:
            data = self.pending + data
        end = boundary(data)
        if end and data.find(_USAGE, 0, end) >= 0:
            for payload in events(data[:end]):
                if _USAGE in payload:
                    found = usage_of(payload)
                    if found is not None:
                        self.usage = found
        rest = len(data) - end
        self.pending = data[end:] if 0 < rest <= KEEP_PENDING else b""


# ------------------------------------------------------------------------------ continued streams


class Counted(msgspec.Struct, frozen=True):
    """A continuation's token accounting, counted by the runtime that serves it (before it is sent).

    prompt: the original request's prompt; received: what the client already has (the continuation's
    prompt less the original's: the partial answer as the continuation sees it)."""

    prompt: int
    received: int


def count_requests(
    runtime: str, request: dict[str, Any], continuation: dict[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    """The tokenizer calls that count the original request's prompt and the continuation's, in order:
    `(path, body)`. vLLM (and `external`): `POST /tokenize` with the messages, as each would be
    templated. llama-server: `POST /apply-template` for each (the prompt text), then `POST /tokenize`
    of that text (see `count_of`). Every body names the model, which the serving port routes by."""
    model = request.get("model")
    if runtime == "llama_server":
        return [
            ("/apply-template", {"model": model, "messages": request.get("messages") or []}),
            ("/apply-template", {"model": model, "messages": continuation.get("messages") or []}),
        ]
    common: dict[str, Any] = {k: request[k] for k in ("chat_template", "chat_template_kwargs") if k in request}
    return [
        (
            "/tokenize",
            {"model": model, "messages": request.get("messages") or [], "add_generation_prompt": True, **common},
        ),
        (
            "/tokenize",
            {
                "model": model,
                "messages": continuation.get("messages") or [],
                "add_generation_prompt": False,
                "continue_final_message": True,
                **common,
            },
        ),
    ]


def llama_tokenize_body(model: Any, prompt: str) -> dict[str, Any]:
    """llama-server's /tokenize of a templated prompt, as its chat endpoint tokenizes one (special
    tokens added and parsed)."""
    return {"model": model, "content": prompt, "add_special": True, "parse_special": True}


def count_of(reply: Any) -> int | None:
    """The token count a tokenizer answered: vLLM's `count`, llama-server's `tokens` list (None: neither)."""
    if not isinstance(reply, dict):
        return None
    count = reply.get("count")
    if isinstance(count, int) and count >= 0:
        return count
    tokens = reply.get("tokens")
    if isinstance(tokens, list):
        return len(tokens)
    return None


def prompt_of(reply: Any) -> str | None:
    """The prompt text llama-server's /apply-template answered."""
    prompt = reply.get("prompt") if isinstance(reply, dict) else None
    return prompt if isinstance(prompt, str) else None


def spliced_usage(usage: dict[str, Any], counted: Counted | None, chunks: int) -> dict[str, Any]:
    """The `usage` of a continuation as the client of the continued stream should see it: what the
    client's request cost, not what the continuation's did.

    With `counted`: prompt_tokens the original prompt's count, completion_tokens what the client had
    before the continuation plus the continuation's own completion_tokens (exact by construction:
    both are the runtime's counts). Without (the runtime has no tokenizer endpoint): the `chunks` with
    content the client had stand for its tokens, and the original prompt is the continuation's less
    those (approximate). The continuation's `prompt_tokens_details` (its cache hits) are dropped: they
    describe a prompt the client never sent."""
    own_prompt = usage.get("prompt_tokens")
    own_completion = usage.get("completion_tokens")
    if not isinstance(own_prompt, int) or not isinstance(own_completion, int):
        return usage
    if counted is not None:
        prompt, received = counted.prompt, counted.received
    else:
        received = chunks
        prompt = max(own_prompt - chunks, 0)
    out = {k: v for k, v in usage.items() if k != "prompt_tokens_details"}
    out["prompt_tokens"] = prompt
    out["completion_tokens"] = received + own_completion
    out["total_tokens"] = prompt + received + own_completion
    return out
