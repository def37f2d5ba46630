"""What a test of the gateway in front of a real vLLM compares: the bytes vLLM sent and the bytes the
gateway relayed (a tiny random-weight model on a busy CPU does not always generate alike twice, which
`same_generation` tells apart from a relay's fault), and a long stream read event by event while the
domain serving it fails (`Streaming`).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable

import aiohttp

__all__ = [
    "CHAT",
    "CUT_TOKENS",
    "Streaming",
    "chat_json",
    "chat_sse",
    "first_difference",
    "masked",
    "same_generation",
    "stable",
]

# Greedy and seeded: the same text every time (test_vllm_real shows it is stable across calls and restarts).
CHAT = {
    "messages": [{"role": "user", "content": "hello there"}],
    "max_tokens": 12,
    "temperature": 0,
    "seed": 7,
}
VOLATILE = ("id", "created", "system_fingerprint")
_VOLATILE_BYTES = re.compile(rb'"(id|created|system_fingerprint)":("[^"]*"|\d+|null)')
CUT_TOKENS = 400  # long enough on a CPU that a kill lands mid-generation

Answer = tuple[int, bytes, str]  # status, body, content type


def first_difference(a: bytes, b: bytes) -> int:
    """Where two byte strings first differ (the shorter one's length when it is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def masked(raw: bytes) -> bytes:
    """The response bytes with the values vLLM makes up per request (its id, the second) replaced."""
    return _VOLATILE_BYTES.sub(lambda m: m.group(0).split(b":", 1)[0] + b":*", raw)


def stable(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k not in VOLATILE}


async def chat_json(s: aiohttp.ClientSession, base: str, model: str) -> Answer:
    async with s.post(base + "/v1/chat/completions", json={**CHAT, "model": model}) as r:
        return r.status, await r.read(), r.headers.get("Content-Type", "")


async def chat_sse(s: aiohttp.ClientSession, base: str, model: str) -> Answer:
    async with s.post(base + "/v1/chat/completions", json={**CHAT, "model": model, "stream": True}) as r:
        return r.status, await r.read(), r.headers.get("Content-Type", "")


async def same_generation(
    ask: Callable[[str], Awaitable[Answer]], gateway: str, direct: str, tries: int = 3
) -> tuple[Answer, Answer]:
    """An answer through the gateway and one straight from vLLM that vLLM generated alike, to compare bytes
    (`ask(base)`: `chat_json` or `chat_sse` with the session and model bound).

    Greedy decoding of a tiny random-weight model on a contended CPU is not always reproducible (its
    logits are nearly flat; one float rounding another way picks another token, and the detokenizer then
    cuts chunks elsewhere), so two generations can differ with no proxy between them, and so can the events
    of one text (vLLM coalesces the deltas it is behind on). Each try asks vLLM directly, then through the
    gateway, then directly again: the gateway's answer is compared with a direct one it should match, and
    when the two direct ones differ from each other (vLLM not reproducible this time), the try is repeated
    rather than blaming the relay."""
    for _ in range(tries):
        first = await ask(direct)
        through = await ask(gateway)
        second = await ask(direct)
        for status, body, _ctype in (first, through, second):
            assert status == 200, (status, body)
        if masked(through[1]) in (masked(first[1]), masked(second[1])):
            return through, next(d for d in (first, second) if masked(d[1]) == masked(through[1]))
        if masked(first[1]) == masked(second[1]):
            if _rechunked(through[1], first[1]):
                continue  # the same tokens, cut into events elsewhere by vLLM itself: not the relay's doing
            return through, first  # vLLM reproduced itself and the gateway's differs: the caller fails
    raise AssertionError(f"vLLM never generated the same answer twice in a row in {tries} tries; cannot compare")


def _deltas(sse: bytes) -> tuple[list[str], list]:
    """An SSE chat stream's content deltas and finish reasons, event by event."""
    contents, finishes = [], []
    for block in sse.decode("utf-8", "replace").split("\n\n"):
        if block.startswith("data: {"):
            choice = json.loads(block[len("data: ") :])["choices"][0]
            contents.append(choice.get("delta", {}).get("content") or "")
            finishes.append(choice.get("finish_reason"))
    return contents, finishes


def _rechunked(a: bytes, b: bytes) -> bool:
    """Two SSE streams of the same text and end whose events are cut differently: vLLM sends the tokens
    its API server has not yet sent as one delta when it falls behind the engine (a busy CPU), so the same
    generation can arrive in fewer, longer events. A relay passes events as they come and cannot do that."""
    (ca, fa), (cb, fb) = _deltas(a), _deltas(b)
    return len(ca) != len(cb) and "".join(ca) == "".join(cb) and [f for f in fa if f] == [f for f in fb if f]


class Streaming:
    """A streamed chat through the gateway of `CUT_TOKENS` tokens, with usage, read event by event; `begun`
    once two content events arrived."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.events: list[dict] = []
        self.begun = asyncio.Event()
        self.done = False

    async def run(self, s: aiohttp.ClientSession, base: str) -> None:
        body = {
            **CHAT,
            "model": self.model,
            "max_tokens": CUT_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with s.post(base + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=300)) as r:
            assert r.status == 200, await r.text()
            pending = b""
            async for piece in r.content.iter_any():
                pending += piece
                while b"\n\n" in pending:
                    event, pending = pending.split(b"\n\n", 1)
                    data = event.removeprefix(b"data: ")
                    if data == b"[DONE]":
                        self.done = True
                        continue
                    self.events.append(json.loads(data))
                    content = [e for e in self.events if (e.get("choices") or [{}])[0].get("delta", {}).get("content")]
                    if len(content) >= 2:
                        self.begun.set()
        assert not self.begun.is_set() or self.done, "the stream ended without [DONE]"

    def outcome(self) -> tuple[dict, list[str]]:
        """The usage the stream ended with and its finish reasons; fails on an error event."""
        assert not any("error" in e for e in self.events), self.events[-1]
        finishes = [c["finish_reason"] for e in self.events for c in e.get("choices") or () if c.get("finish_reason")]
        return self.events[-1]["usage"], finishes
