"""Streams that survive their domain: a streamed chat completion cut mid-generation is continued where
it can be served, and spliced into the same SSE stream (docs/gateway.md, "Continued streams").

The proxy relays a `text/event-stream` answer to `POST /v1/chat/completions` through `relay`: whole
events only (a piece that ends inside an event keeps its tail until the rest arrives, so a cut never
leaves the client half an event), each kept (up to `keep_bytes` a stream) as it goes out. When the
upstream breaks off before the stream's end (the domain, its agent or its runtime died), `resume`:

1. reads what the client already has from the kept events (pure: `transcript`): the completion id,
   `created`, the text so far, whether it already finished;
2. refuses what cannot be continued faithfully (`not_continuable`: n > 1, tools, guided or JSON-schema
   decoding, logprobs, a transcript over the bound): those end with an SSE error event in OpenAI's
   shape, never a silent cut;
3. waits for a domain that serves the model (the new active once the route moves, or the same domain
   once its serving port answers again), bounded like a held request (gateway/hold.py), and asks its
   runtime to continue the assistant message (`continuation_body`: vLLM `continue_final_message: true`
   with `add_generation_prompt: false`; llama-server treats a final assistant message as a prefill);
4. splices the continuation into the same stream (`splice_event`): the original id and `created`, no
   second role chunk, and a `usage` that counts the whole request: before the continuation is sent, the
   runtime that serves it counts the original prompt and the continuation's through its tokenizer
   endpoint (`Resumer._count`; gateway/usage.py has the calls and the rewrite, `spliced_usage`).

None of this runs for a request that is not a streamed chat completion, and nothing of it but the
event boundary and the keeping runs while a stream is healthy.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Final

import msgspec
import structlog

from haru.core.openai_errors import error_body
from haru.gateway.errors import UpstreamError
from haru.gateway.hold import hold_plan
from haru.gateway.routing import Forward
from haru.gateway.sse import boundary, events
from haru.gateway.stranded import judged_unreachable
from haru.gateway.usage import (
    Counted,
    UsageTap,
    count_of,
    count_requests,
    llama_tokenize_body,
    prompt_of,
    spliced_usage,
)

if TYPE_CHECKING:
    from aiohttp import web

    from haru.gateway.proxy import Proxy
    from haru.gateway.upstream import Connection

log = structlog.get_logger("haru.gateway")

KEEP_BYTES: Final = 1 << 20  # what is kept of one stream to continue it; beyond it, a cut ends with an error event
ATTEMPT_GAP_S: Final = 0.25  # between tries on a domain whose serving port does not answer yet
MAX_RESUMES: Final = 4  # continuations of one stream (each after a cut)

_json = msgspec.json.Decoder()
_encode = msgspec.json.Encoder().encode


class Transcript(msgspec.Struct):
    """What a client has received of a streamed chat completion."""

    id: str = ""
    created: int = 0
    model: str = ""
    text: str = ""
    role_sent: bool = False
    finished: bool = False  # a finish_reason or [DONE] went out: nothing is left to continue
    done: bool = False  # the [DONE] that ends the stream went out
    chunks: int = 0  # chunks that carried content (about one token each from vLLM and llama-server)
    other: str = ""  # why the stream cannot be continued from the transcript ('' = it can)


def transcript(sent: bytes) -> Transcript:
    """Read the events a client has received (pure)."""
    t = Transcript()
    parts: list[str] = []
    for payload in events(sent):
        if payload.strip() == b"[DONE]":
            t.finished = t.done = True
            continue
        try:
            obj = _json.decode(payload)
        except msgspec.DecodeError:
            t.other = "an event that is not JSON"
            continue
        if not isinstance(obj, dict):
            continue
        if "error" in obj:
            t.finished = True
            continue
        t.id = t.id or str(obj.get("id", ""))
        t.created = t.created or int(obj.get("created") or 0)
        t.model = t.model or str(obj.get("model", ""))
        for choice in obj.get("choices") or ():
            if choice.get("index", 0) != 0:
                t.other = "more than one choice"
            delta = choice.get("delta") or {}
            if delta.get("role"):
                t.role_sent = True
            if delta.get("tool_calls") or delta.get("function_call"):
                t.other = "a tool call is being streamed"
            content = delta.get("content")
            if content:
                parts.append(content)
                t.chunks += 1
            if choice.get("finish_reason"):
                t.finished = True
    t.text = "".join(parts)
    return t


def not_continuable(request: dict[str, Any]) -> str:
    """Why a chat request cannot be continued faithfully after a cut ('' = it can)."""
    if (request.get("n") or 1) > 1:
        return "n > 1 (several choices cannot be continued as one)"
    if request.get("tools") or request.get("functions") or request.get("tool_choice") not in (None, "none"):
        return "it uses tools"
    fmt = request.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        return f"it asks for {fmt.get('type')} output (guided decoding restarts from the prefix's start)"
    guided = [k for k in request if k.startswith("guided_") or k in ("structured_outputs", "grammar", "json_schema")]
    if guided:
        return f"it uses guided decoding ({guided[0]})"
    if request.get("logprobs") or request.get("top_logprobs"):
        return "it asks for logprobs (the prefix's would be missing)"
    return ""


def continuation_body(request: dict[str, Any], sent: Transcript, runtime: str) -> bytes:
    """The request that asks a runtime to continue the assistant message the client has so far."""
    return _encode(continuation_request(request, sent, runtime))


def continuation_request(
    request: dict[str, Any], sent: Transcript, runtime: str, received: int | None = None
) -> dict[str, Any]:
    """`continuation_body` as a dict. `received`: the tokens the client has, as the runtime counted
    them (`usage.Counted`); without it, its content chunks stand for them in `max_tokens`."""
    req = dict(request)
    messages = list(req.get("messages") or [])
    last = messages[-1] if messages else None
    if isinstance(last, dict) and last.get("role") == "assistant" and isinstance(last.get("content"), str):
        messages[-1] = {**last, "content": last["content"] + sent.text}  # the client's own prefill, extended
    else:
        messages.append({"role": "assistant", "content": sent.text})
    req["messages"] = messages
    if runtime != "llama_server":  # vLLM (and OpenAI-compatible servers that follow it)
        req["continue_final_message"] = True
        req["add_generation_prompt"] = False
    for key in ("max_tokens", "max_completion_tokens"):
        value = req.get(key)
        if isinstance(value, int) and value > 0:
            req[key] = max(1, value - (sent.chunks if received is None else received))
    return req


def splice_event(payload: bytes, sent: Transcript, counted: Counted | None = None) -> bytes | None:
    """One event of a continuation as the client should see it: the original id and `created`, no
    second role chunk, and a `usage` that counts what the client's request cost (`usage.spliced_usage`,
    with the runtime's `counted`). None: nothing left to send (a role-only chunk)."""
    if payload.strip() == b"[DONE]":
        return b"data: [DONE]\n\n"
    try:
        obj = _json.decode(payload)
    except msgspec.DecodeError:
        return b"data: " + payload + b"\n\n"
    if isinstance(obj, dict) and "error" not in obj:
        if sent.id:
            obj["id"] = sent.id
        if sent.created:
            obj["created"] = sent.created
        usage = obj.get("usage")
        if isinstance(usage, dict):
            obj["usage"] = spliced_usage(usage, counted, sent.chunks)
        choices = obj.get("choices") or []
        if not sent.role_sent:  # the cut came before the role chunk: this one is the stream's first
            sent.role_sent = any("role" in (c.get("delta") or {}) for c in choices)
            return b"data: " + _encode(obj) + b"\n\n"
        for choice in choices:
            delta = choice.get("delta")
            if isinstance(delta, dict) and "role" in delta:
                del delta["role"]
        if choices and all(_empty(c) for c in choices) and not obj.get("usage"):
            return None  # it carried the role only
    return b"data: " + _encode(obj) + b"\n\n"


def _empty(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta") or {}
    return not choice.get("finish_reason") and all(v in ("", None) for v in delta.values())


def error_event(message: str, code: str = "stream_interrupted") -> bytes:
    return b"data: " + error_body(502, code, message) + b"\n\n"


# ----------------------------------------------------------------------------------- the shell


class Resumer:
    """Relays streamed chat completions and continues them after a cut. One per proxy."""

    def __init__(self, proxy: Proxy, keep_bytes: int = KEEP_BYTES) -> None:
        self.proxy = proxy
        self.keep_bytes = keep_bytes

    async def relay(
        self,
        request: web.BaseRequest,
        response: web.StreamResponse,
        conn: Connection,
        fwd: Forward,
        body: bytes,
        path: str,
    ) -> bool:
        """Relay the stream whole event by whole event; on a cut, continue it. True when it ended
        cleanly (the proxy then counts its latency)."""
        tap = UsageTap()
        try:
            return await self._relay(request, response, conn, fwd, body, path, tap)
        finally:
            self.proxy.metrics.tokens(fwd.fleet, fwd.model, tap.usage)

    async def _relay(
        self,
        request: web.BaseRequest,
        response: web.StreamResponse,
        conn: Connection,
        fwd: Forward,
        body: bytes,
        path: str,
        tap: UsageTap,
    ) -> bool:
        kept: list[bytes] = []
        size = 0
        pending = b""
        while True:
            try:
                chunk = await conn.next()
            except UpstreamError as exc:
                sent = b"".join(kept) if size <= self.keep_bytes else b""
                return await self.resume(
                    request, response, fwd, body, path, sent, size > self.keep_bytes, str(exc), tap
                )
            if not chunk:
                tap.feed(pending)
                await response.write_eof(pending)
                return True
            data = pending + chunk if pending else chunk
            end = boundary(data)
            if end == len(data):
                out, pending = data, b""
            else:
                out, pending = data[:end], data[end:]
            if size <= self.keep_bytes:
                kept.append(out)
                size += len(out)
            if conn.complete and not conn.chunks:
                tap.feed(data)
                await response.write_eof(data)
                return True
            tap.feed(out)
            if out:
                await response.write(out)

    async def resume(
        self,
        request: web.BaseRequest,
        response: web.StreamResponse,
        fwd: Forward,
        body: bytes,
        path: str,
        sent_bytes: bytes,
        overflowed: bool,
        why: str,
        tap: UsageTap | None = None,
    ) -> bool:
        metrics = self.proxy.metrics
        fleet, model = fwd.fleet, fwd.model
        sent = transcript(sent_bytes)
        if sent.finished:
            # everything the client needs went out; only the framing was cut (the upstream's [DONE] can be
            # the segment a lost link never delivered): close the stream as the upstream would have
            await response.write_eof(b"" if sent.done else b"data: [DONE]\n\n")
            return True
        try:
            original = _json.decode(body)
        except msgspec.DecodeError:
            original = {}
        refusal = not_continuable(original) if isinstance(original, dict) else "the body is not a JSON object"
        refusal = (
            refusal
            or sent.other
            or (
                f"over {self.keep_bytes} bytes of it had gone out (the gateway keeps that much to continue a stream)"
                if overflowed
                else ""
            )
        )
        log.warning(
            "gateway.stream_cut",
            fleet=fleet,
            domain=fwd.domain,
            model=model,
            error=why,
            continuable=not refusal,
            why_not=refusal,
            sent_chars=len(sent.text),
        )
        if refusal:
            return await self._end_with_error(
                response,
                fleet,
                f"the stream from domain {fwd.domain!r} broke off ({why}) and cannot be continued "
                f"faithfully: {refusal}; send the request again",
            )
        routes = self.proxy.table.get(fleet)
        plan = hold_plan(routes, "upstream_unreachable", unreachable=True, now=time.time())
        policy = routes.view.policy if routes is not None and routes.view is not None else None
        budget_ms = plan.budget_ms if plan is not None else (policy.hold_max_ms if policy is not None else 0)
        started = time.monotonic()
        deadline = started + budget_ms / 1000
        attempts = 0
        last = why
        while attempts < MAX_RESUMES:
            target = self.proxy.table.resolve(fleet, model, time.time())
            if type(target) is Forward and not judged_unreachable(self.proxy.table.get(fleet), target.domain):
                try:
                    outcome = await self._continue(request, response, target, original, path, sent, tap)
                except (UpstreamError, TimeoutError) as exc:
                    outcome = f"domain {target.domain!r}: {exc or type(exc).__name__}"
                if outcome is True:
                    metrics.resumed(fleet, "continued")
                    return True
                if isinstance(outcome, Transcript):  # cut again, after more went out: once more from there
                    if outcome.finished:
                        await response.write_eof()
                        metrics.resumed(fleet, "continued")
                        return True
                    sent = outcome
                    attempts += 1
                    started = time.monotonic()
                    deadline = started + budget_ms / 1000
                    last = f"the continuation on {target.domain!r} broke off too"
                    continue
                last = str(outcome)
            now = time.monotonic()
            if now >= deadline:  # past the estimate: on while the failover is still coming (gateway/hold.py)
                now_plan = hold_plan(
                    self.proxy.table.get(fleet), "upstream_unreachable", unreachable=True, now=time.time()
                )
                deadline = self.proxy.holds.later(fleet, now_plan, started, now)
                if deadline <= now:
                    break
            await self.proxy.holds.next_change(fleet, min(ATTEMPT_GAP_S, deadline - now))
        waited_ms = int((time.monotonic() - started) * 1000)
        return await self._end_with_error(
            response,
            fleet,
            f"the stream from domain {fwd.domain!r} broke off ({why}) and no domain could "
            f"continue it within {waited_ms} ms (last: {last}); send the request again",
        )

    async def _end_with_error(self, response: web.StreamResponse, fleet: str, message: str) -> bool:
        self.proxy.metrics.resumed(fleet, "error_event")
        await response.write_eof(error_event(message))
        return False

    async def _continue(
        self,
        request: web.BaseRequest,
        response: web.StreamResponse,
        target: Forward,
        original: dict[str, Any],
        path: str,
        sent: Transcript,
        tap: UsageTap | None = None,
    ) -> bool | Transcript | str:
        """One try on `target`: True when the continuation ran to its end, a Transcript when it broke off
        after some of it went out, or why it could not start."""
        proxy = self.proxy
        pool = proxy.pool
        assert pool is not None and proxy._loop is not None
        routes = proxy.table.get(target.fleet)
        runtime = "vllm"
        if routes is not None and routes.view is not None:
            dv = routes.view.domains.get(target.domain)
            mv = dv.models.get(target.model) if dv is not None else None
            runtime = mv.runtime if mv is not None else runtime
        cont = continuation_request(original, sent, runtime)
        headers = proxy._header_block(request)
        counted = await self._count(target, headers, runtime, original, cont)
        if counted is not None:
            cont = continuation_request(original, sent, runtime, counted.received)
        body = _encode(cont)
        tgt = pool.target(target.url)
        head = pool.head(tgt, path, headers)
        conn = await pool.request(tgt, head, body, proxy._loop.time() + proxy.header_timeout)
        try:
            if conn.status != 200:
                detail = (await conn.read())[:300].decode("utf-8", "replace")
                return f"domain {target.domain!r} answered {conn.status}: {detail}"
            log.info(
                "gateway.stream_continued",
                fleet=target.fleet,
                domain=target.domain,
                model=target.model,
                runtime=runtime,
                sent_chars=len(sent.text),
                sent_tokens=counted.received if counted is not None else None,
                prompt_tokens=counted.prompt if counted is not None else None,
            )
            now = Transcript(
                id=sent.id, created=sent.created, model=sent.model, text=sent.text, role_sent=True, chunks=sent.chunks
            )
            parts = [sent.text]
            pending = b""
            while True:
                try:
                    chunk = await conn.next()
                except UpstreamError:
                    now.text = "".join(parts)
                    return now
                if not chunk:
                    break
                data = pending + chunk
                end = boundary(data)
                pending = data[end:]
                out = []
                for payload in events(data[:end]):
                    event = splice_event(payload, sent, counted)
                    if event is not None:
                        out.append(event)
                        _grow(now, parts, payload)
                if out:
                    spliced = b"".join(out)
                    if tap is not None:
                        tap.feed(spliced)
                    await response.write(spliced)
            await response.write_eof(pending)
            return True
        finally:
            conn.release()

    async def _count(
        self, target: Forward, headers: str, runtime: str, original: dict[str, Any], cont: dict[str, Any]
    ) -> Counted | None:
        """The original prompt's tokens and the continuation's prompt's, counted by `target`'s runtime
        (its tokenizer endpoint, through the serving port); None when it cannot say (no such endpoint:
        the usage is then approximate, docs/gateway.md). A domain that does not answer raises
        UpstreamError, as the continuation would: this try is over."""
        counts: list[int] = []
        try:
            for call_path, call in count_requests(runtime, original, cont):
                reply = await self._ask(target, headers, call_path, call)
                if call_path == "/apply-template":  # llama-server: the prompt text, then its tokens
                    text = prompt_of(reply)
                    if text is not None:
                        tokenize = llama_tokenize_body(original.get("model"), text)
                        reply = await self._ask(target, headers, "/tokenize", tokenize)
                count = count_of(reply)
                if count is None:
                    raise _Uncounted(f"{call_path} answered no token count")
                counts.append(count)
        except _Uncounted as exc:
            log.warning(
                "gateway.continuation_uncounted",
                fleet=target.fleet,
                domain=target.domain,
                model=target.model,
                runtime=runtime,
                error=str(exc) or type(exc).__name__,
            )
            return None
        prompt, continued = counts
        return Counted(prompt=prompt, received=max(continued - prompt, 0))

    async def _ask(self, target: Forward, headers: str, path: str, body: dict[str, Any]) -> Any:
        """One JSON call to `target`'s serving port; its decoded answer, or UpstreamError."""
        proxy = self.proxy
        pool = proxy.pool
        assert pool is not None and proxy._loop is not None
        tgt = pool.target(target.url)
        conn = await pool.request(
            tgt, pool.head(tgt, path, headers), _encode(body), proxy._loop.time() + proxy.header_timeout
        )
        try:
            data = await conn.read()
        finally:
            conn.release()
        if conn.status in (502, 503):  # the domain cannot serve now (its runtime is gone or waking): nor continue
            raise UpstreamError(f"{path} answered {conn.status}: {data[:200].decode('utf-8', 'replace')}")
        if conn.status != 200:
            raise _Uncounted(f"{path} answered {conn.status}: {data[:200].decode('utf-8', 'replace')}")
        try:
            return _json.decode(data)
        except msgspec.DecodeError as exc:
            raise _Uncounted(f"{path} answered something that is not JSON: {exc}") from None


class _Uncounted(Exception):
    """The runtime answered, but not with a token count (control flow inside the resumer)."""


def _grow(now: Transcript, parts: list[str], payload: bytes) -> None:
    """Add one spliced event to what the client has received (for a second cut)."""
    if payload.strip() == b"[DONE]":
        now.finished = True
        return
    try:
        obj = _json.decode(payload)
    except msgspec.DecodeError:
        return
    if isinstance(obj, dict):
        for choice in obj.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                parts.append(content)
                now.chunks += 1
            if choice.get("finish_reason"):
                now.finished = True
