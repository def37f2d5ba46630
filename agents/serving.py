"""The serving port: the domain's inference traffic, on one port, to the runtimes on 127.0.0.1.

Only these are forwarded, to the runtime chosen by the body's `model` (only `model` is read; the
body goes upstream byte-identical and the response, JSON or SSE, streams back unbuffered):

    POST /v1/chat/completions   POST /v1/completions   POST /v1/embeddings
    POST /tokenize   POST /apply-template   (the runtime's tokenizer: vLLM has the first, llama-server both)
    GET  /v1/models             (answered here: this domain's admitted models and their residency)

Everything else (vLLM's /sleep, /wake_up, /is_sleeping, /health, any other path) is 404, so the
sleep and wake controls are structurally unreachable from off the host. With HARU_SERVING_TOKEN set,
every request needs `Authorization: Bearer <token>` (compared in constant time). A client that
disconnects cancels its upstream request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp
import msgspec
import structlog
from aiohttp import web

from haru.agents import portholder, probes
from haru.agents.errors import PortHolderError, RuntimeProblem
from haru.agents.gpu_watch import GpuWatcher
from haru.agents.model_slot import ModelSlot
from haru.agents.model_slots import ModelSlots
from haru.agents.serving_env import ServingEnv
from haru.core.adapters import split_runtime_name
from haru.core.errors import ConfigError
from haru.core.openai_errors import BadBody, answer_status, error_body, model_of
from haru.core.residency import ANSWERS
from haru.core.specs import READY_PATH, Policy
from haru.host.httpguard import BodyTimeout, BodyTooLarge, GuardedServer, read_body

__all__ = ["ServingProxy", "FORWARDED", "bind_refusal", "check_serving"]

# The runtime's tokenizer endpoints too (vLLM /tokenize; llama-server /tokenize and /apply-template): the
# gateway counts the tokens of a stream it continued (docs/gateway.md, "Continued streams").
FORWARDED = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize", "/apply-template"})


# READY_PATH is the one path a load balancer may read without the token (SkyServe's readiness probe sends no
# header): 200 or 503, and a body that says nothing but that (the port holder answers 503 while it bridges).
# Declared but not meant to run here: they neither make nor break readiness.
_NOT_RUN = frozenset({"not_admitted", "stopped"})


def ready_for_balancer(role: str, states: Iterable[str]) -> bool:
    """Is this host a fit member of its domain, as a load balancer in front of it must know (pure)?

    The active: every model it runs is resident. A standby: every model is asleep or resident, so it
    can take over. Anything loading, waking, lost or failed is not ready. A standby must answer 200 as
    well: SkyServe terminates a replica that is not ready past `initial_delay_seconds`, or not ready for
    longer than its failure threshold after it was (sky/serve/replica_managers.py), so a readiness that
    meant "active" would have SkyServe tear down every healthy standby. Traffic still reaches only the
    active: each domain is its own service, and the gateway sends to the active's."""
    run = [s for s in states if s not in _NOT_RUN]
    allowed = ("resident",) if role == "active" else ("resident", "sleeping")
    return bool(run) and all(s in allowed for s in run)


# Request headers that describe the body or the client's wishes; the rest stay at the door.
_PASS_REQUEST = ("content-type", "accept", "accept-encoding", "user-agent", "x-request-id", "openai-organization")
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authenticate",
        "proxy-authorization",
        "content-length",
        "server",
        "date",
    }
)


SERVING_DRAIN_S = 60.0  # an agent stopping lets the requests in flight (streams too) finish, this long at most
# On a 502/503 that says the runtime behind this port is gone (lost, or not answering) or asleep (the domain
# was demoted while a gateway still routed here): what the gateway reads to send the request, which no
# runtime acted on, once more to a live domain (gateway/proxy.py).
GONE_HEADER = "X-Haru-Runtime-Gone"
_DIAGNOSIS_REUSE_S = 0.25  # how long one diagnosis of a failing runtime answers for the next failures


def _not_serving_status(state: str, reason: str) -> tuple[int, str]:
    """(status, OpenAI error code) for a model this domain has but cannot serve now: the row of its
    router answer (`haru.core.residency.ANSWERS`) in the status table the gateway answers from."""
    return answer_status(ANSWERS.get(state, ("unknown", ""))[0], reason)


def error(
    status: int, code: str, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    """OpenAI's error shape (`haru.core.openai_errors`, the gateway's too)."""
    return web.Response(
        status=status, body=error_body(status, code, message, param), content_type="application/json", headers=headers
    )


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def bind_refusal(host: str, token: str) -> str:
    """Why the serving port may not listen on `host` ('' = it may): the gateway's rule, loopback unless a
    token is set. Without HARU_SERVING_TOKEN anyone who reached the port could send inference requests."""
    if token or host in LOOPBACK:
        return ""
    return (
        f"the serving port would listen on {host or 'every address'} without HARU_SERVING_TOKEN, so anyone who "
        f"can reach it could send inference requests: set HARU_SERVING_TOKEN (the same value on the gateway, "
        f'which sends it), or listen on loopback only: "serving": {{"host": "127.0.0.1"}} in the agent config'
    )


def check_serving(config: Any, slots: Any, token: str) -> None:
    """Refuse, before the agent claims its domain or touches a runtime, a serving port that would break
    the rule (`bind_refusal`, with the `token` the agent was given); a `serve: direct` domain opens none
    (its layout said its network is private)."""
    if not config.serving.enabled or slots.domain.spec.serve == "direct":
        return
    refusal = bind_refusal(config.serving.host, token)
    if refusal:
        raise ConfigError(refusal)


class RoleNow(Protocol):
    """The domain's role as it is now (agents/role.py's `Role`)."""

    @property
    def now(self) -> str: ...


class ServingProxy:
    def __init__(
        self,
        slots: ModelSlots,
        gpu: GpuWatcher,
        *,
        policy: Callable[[], Policy],
        keep_runtimes: Callable[[], bool],
        role: RoleNow,
        state_dir: Path,
        host: str,
        port: int,
        declared_url: str = "",
        env: ServingEnv,
    ) -> None:
        """`slots`: the host's models (agents/model_slots.py); `gpu`: the GPU watcher (its last reading);
        `policy`, `keep_runtimes`: the agent's, as they are now. `host`/`port`: the agent config's `serving`;
        port 0 takes the port of the domain's declared serving URL (`declared_url`), else any free one."""
        self.slots = slots
        self.gpu = gpu
        self.policy = policy
        self.keep_runtimes = keep_runtimes
        self.role = role
        self.state_dir = state_dir
        self.logger = structlog.get_logger("haru.agent.serving").bind(fleet=slots.fleet, domain=slots.domain)
        self.token = env.token
        self.max_body = env.max_body
        self.limits = env.limits
        self._diagnosed: dict[str, tuple[float, str]] = {}  # model -> (when, reason) of the last diagnosis
        self.host = host
        if not port and declared_url:
            port = urlsplit(declared_url).port or 0
        self.port = port
        self._runner: web.ServerRunner | None = None
        self._site: web.BaseSite | None = None
        self._session: aiohttp.ClientSession | None = None
        # A resend goes on a connection of its own: when the runtime closed one idle kept-alive connection
        # (llama-server's 5 s keep-alive timeout, its 100-request limit), the pool's others are as stale.
        self._fresh: aiohttp.ClientSession | None = None
        self._lease: socket.socket | None = None  # the connection to the port holder that keeps its bridge off
        self._inflight: dict[str, int] = {}  # model -> requests being answered (drain)
        self._idle: asyncio.Event | None = None  # set when a count falls to 0, for `drain`

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://{host}:{self.port}"

    @property
    def listening_url(self) -> str:
        """The URL while the port listens ("" before `start`)."""
        return self.url if self._site is not None else ""

    async def start(self) -> None:
        refusal = bind_refusal(self.host, self.token)
        if refusal:
            raise ConfigError(refusal)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
        )
        self._fresh = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            timeout=aiohttp.ClientTimeout(total=None),
            auto_decompress=False,
        )
        server = GuardedServer(self._handle, limits=self.limits, handler_cancellation=True, access_log=None)
        self.server = server
        self._runner = web.ServerRunner(server, handle_signals=False, access_log=None)
        await self._runner.setup()
        # The listening socket comes from the port holder, which outlives this agent: a restart never
        # closes the port (agents/portholder.py says how, docs/architecture.md why).
        try:
            # `fd` also stops the holder's bridge; the lease it returns, open while this agent runs, starts
            # it again when this process exits however it exits (SIGKILL too).
            sock, self._lease = await asyncio.to_thread(
                portholder.listening_socket, self.state_dir, self.host or "127.0.0.1", self.port
            )
            self._site = web.SockSite(self._runner, sock, backlog=portholder.BACKLOG, shutdown_timeout=SERVING_DRAIN_S)
            await self._site.start()
        except (OSError, PortHolderError) as exc:
            self._release()
            self._site = None
            await self._runner.cleanup()
            await self._close_sessions()
            raise ConfigError(
                f"cannot open the serving port {self.host}:{self.port}: "
                f"{getattr(exc, 'strerror', None) or exc}; free it or set "
                f'"serving": {{"port": ...}} in the agent config'
            ) from exc
        self.port = sock.getsockname()[1]
        self.logger.info("serving port open", url=self.url)

    async def stop(self) -> None:
        """Stop accepting, let the requests in flight finish (streams included, up to SERVING_DRAIN_S),
        close idle kept-alive connections (the gateway resends what it had not yet sent on one). The
        port stays open in its holder unless the agent stops for good; when a restart is expected the
        holder bridges (accepts and forwards to the runtimes) from the moment this agent stops accepting."""
        if self._site is not None and self._runner is not None and self.keep_runtimes():
            await self._site.stop()  # stops accepting (closes this process's copy of the listening socket)
            if not await asyncio.to_thread(portholder.bridge, self.state_dir):
                self.logger.warning(
                    "the serving port holder did not answer `bridge`: requests wait for the next "
                    "agent in the port's accept queue",
                    state_dir=str(self.state_dir),
                )
        if self._runner is not None:
            await self._runner.cleanup()
        await self._close_sessions()
        if not self.keep_runtimes():
            await asyncio.to_thread(portholder.stop_holder, self.state_dir)
        self._release()

    def _release(self) -> None:
        if self._lease is not None:
            self._lease.close()
            self._lease = None

    def _authorized(self, request: web.BaseRequest) -> bool:
        if not self.token:
            return True
        header = request.headers.get("Authorization", "")
        scheme, _, value = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.token.encode())

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        if path == READY_PATH and request.method in ("GET", "HEAD"):
            ready = ready_for_balancer(self.role.now, (m.state_tag for m in self.slots.models.values()))
            return web.json_response({"ready": ready}, status=200 if ready else 503)
        if path == "/v1/models" and request.method == "GET":
            if not self._authorized(request):
                return error(401, "unauthorized", "missing or wrong bearer token (HARU_SERVING_TOKEN)")
            return self._models()
        if path not in FORWARDED:
            return error(
                404,
                "not_found",
                f"{request.method} {path} is not served here; this port serves "
                f"POST {', '.join(sorted(FORWARDED))}, GET /v1/models and GET {READY_PATH}",
            )
        if request.method != "POST":
            return error(405, "method_not_allowed", f"{path} takes POST", headers={"Allow": "POST"})
        if not self._authorized(request):
            return error(401, "unauthorized", "missing or wrong bearer token (HARU_SERVING_TOKEN)")
        try:
            body = await read_body(request, self.limits.body_timeout_s, self.max_body)
        except BodyTooLarge:
            return error(
                413, "payload_too_large", f"the body is over {self.max_body} bytes", headers={"Connection": "close"}
            )
        except BodyTimeout:
            return error(
                408,
                "request_timeout",
                f"the body did not arrive within HARU_CLIENT_BODY_TIMEOUT_MS "
                f"({int(self.limits.body_timeout_s * 1000)} ms)",
                headers={"Connection": "close"},
            )
        name = model_of(body)
        if isinstance(name, BadBody):
            return error(400, "invalid_request", name.message, param=name.param)
        m = (
            self.slots.models.get(name)
            or next((s for s in self.slots.models.values() if name in s.spec.adapters), None)  # a LoRA adapter
            or self._adapter_base(name)  # a version of an adapter loaded at run time: its base model's runtime
        )
        if m is None:
            return error(
                404,
                "model_not_found",
                f"the model `{name}` does not exist on domain {self.slots.domain!r}",
                param="model",
            )
        if m.state_tag != "resident":
            return self._not_serving(m)
        inflight = self._inflight
        inflight[name] = inflight.get(name, 0) + 1
        try:
            return await self._forward(request, m, m.runtime.base_url + path, body)
        finally:
            inflight[name] -= 1
            if not inflight[name] and self._idle is not None:
                self._idle.set()

    def _adapter_base(self, name: str) -> ModelSlot | None:
        if split_runtime_name(name) is None:
            return None
        return next((m for m in self.slots.models.values() if name in m.runtime_adapters), None)

    def in_flight(self, names: list[str]) -> int:
        """Requests to `names` being answered now (streams until their last byte)."""
        return sum(self._inflight.get(n, 0) for n in names)

    async def drain(self, names: list[str], timeout_s: float) -> int:
        """Wait until no request to `names` is in flight, `timeout_s` at most; return how many still are.

        The old active after a planned flip: its new requests go to the new active already, and the
        ones it is answering finish before its runtimes are put to sleep (the `sleep` command)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout_s, 0.0)
        while self.in_flight(names) and loop.time() < deadline:
            self._idle = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await self._idle.wait()
        return self.in_flight(names)

    def _not_serving(self, m, reason: str = "", detail: str = "", asleep: bool = False) -> web.Response:
        """The residency answer for a model this port cannot serve now (`asleep`: its runtime said it sleeps,
        before the agent recorded it). A sleeping model's answer is marked like a lost one's: no runtime
        acted on the request, so a gateway that still routed here sends it to the active instead."""
        state = "sleeping" if asleep else m.state_tag if not reason else "lost"
        reason = reason or getattr(m.state, "reason", "")
        status, code = _not_serving_status(state, reason)
        headers = {"Retry-After": "1"} if code in ("model_warming", "model_asleep") else None
        where = f"on domain {self.slots.domain!r}"
        if state == "lost" and reason == "gpu_detached":
            return error(
                503,
                "gpu_detached",
                f"the model `{m.name}` is lost {where}: its GPU "
                f"{m.spec.gpu_index} was detached by the provider (not the operator's doing); try "
                f"another domain" + (f" ({detail})" if detail else ""),
                headers={GONE_HEADER: "gpu_detached"},
            )
        said = f" ({reason})" if state == "lost" and reason else ""
        if state == "lost":
            headers = {GONE_HEADER: reason or "lost"}
        elif state == "sleeping":
            headers = {**(headers or {}), GONE_HEADER: "asleep"}
        elif state == "loading" and getattr(m.state, "attempt", 1) > 1:  # restarting after a loss: gone too
            headers = {**(headers or {}), GONE_HEADER: "restarting"}
        return error(
            status,
            code,
            f"the model `{m.name}` is {state}{said} {where}" + (f": {detail}" if detail else ""),
            headers=headers,
        )

    async def _diagnose(self, m, status: int) -> web.Response | None:
        """The runtime answered `status` (5xx, or 404) for a model the agent held resident: is it the
        runtime's own answer to this request, or was the model just lost (a detached GPU makes vLLM
        say 500 "CUDA error", an eviction 404 "does not exist") before the periodic probe noticed?
        The one-bit diagnosis, now: the residency answer when the model is gone, None otherwise."""
        if m.state_tag != "resident":
            return self._not_serving(m)  # the agent recorded the change while the request ran
        if status == 503 and m.runtime.can_sleep and await self._asleep(m):
            return self._not_serving(m, asleep=True, detail="put to sleep while the request came in")
        now = time.monotonic()
        cached = self._diagnosed.get(m.name)
        if cached is not None and now - cached[0] < _DIAGNOSIS_REUSE_S:
            reason = cached[1]  # a burst of failing requests asks the runtime once, not once each
        else:
            external = m.runtime.kind == "external"
            gpu = None if external else self.gpu.read(m.spec.gpu_index)
            alive = m.process_alive()
            holds = True
            if alive and (gpu is None or gpu.present is not False):
                holds = await probes.holds_model(m.runtime, timeout_s=min(2.0, self.policy().probe_timeout_ms / 1000))
            reason = probes.diagnose(process_alive=alive, gpu=gpu, runtime_holds_model=holds)
            self._diagnosed[m.name] = (time.monotonic(), reason)
        if reason == "unhealthy":
            return None  # the runtime's own answer: passed through
        self.slots.recheck(m)  # record it now, not at the next probe
        self.logger.info("runtime error translated", model=m.name, runtime_status=status, reason=reason)
        return self._not_serving(m, reason, f"the runtime answered {status}")

    async def _asleep(self, m) -> bool:
        """Whether the runtime says it sleeps (a `sleep` command under way: the agent records it once done)."""
        try:
            return await m.runtime.is_sleeping(timeout_s=min(2.0, self.policy().probe_timeout_ms / 1000)) is True
        except (
            RuntimeProblem,
            TimeoutError,
            aiohttp.ClientError,
            OSError,
        ):  # no answer is no evidence: the runtime's own 503 goes through as before
            return False

    def _models(self) -> web.Response:
        created = int(time.time())
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "haru",
                "domain": self.slots.domain,
                "residency": m.state_tag,
            }
            for name, m in self.slots.models.items()
        ]
        return web.Response(body=msgspec.json.encode({"object": "list", "data": data}), content_type="application/json")

    async def _close_sessions(self) -> None:
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()

    async def _forward(self, request: web.BaseRequest, m, url: str, body: bytes) -> web.StreamResponse:
        assert self._session is not None and self._fresh is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() in _PASS_REQUEST}
        for attempt, session in ((0, self._session), (1, self._fresh)):
            head = [False]
            try:
                return await self._forward_once(session, request, m, url, body, headers, head)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if (
                    attempt == 0
                    and not head[0]
                    and _not_sent(exc)
                    and not (request.transport is None or request.transport.is_closing())
                ):
                    continue  # a kept-alive connection the runtime had closed: once more, on a new connection
                return await self._unreachable(request, m, url, exc)
            except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                return await self._unreachable(request, m, url, exc)
        raise AssertionError("unreachable")

    async def _unreachable(self, request: web.BaseRequest, m, url: str, exc: BaseException) -> web.StreamResponse:
        if request.transport is None or request.transport.is_closing():
            raise asyncio.CancelledError from exc
        translated = await self._diagnose(m, 502)
        if translated is not None:
            return translated
        return error(
            502,
            "upstream_unreachable",
            f"the runtime at {url} did not answer: {exc}",
            headers={GONE_HEADER: "unreachable"},
        )

    async def _forward_once(
        self,
        session: aiohttp.ClientSession,
        request: web.BaseRequest,
        m,
        url: str,
        body: bytes,
        headers: dict,
        head: list[bool],
    ) -> web.StreamResponse:
        async with session.post(url, data=body, headers=headers, allow_redirects=False) as upstream:
            head[0] = True
            if upstream.status >= 500 or upstream.status == 404:
                translated = await self._diagnose(m, upstream.status)
                if translated is not None:
                    return translated
            out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
            streaming = upstream.content_length is None or "text/event-stream" in upstream.headers.get(
                "Content-Type", ""
            )
            if not streaming:
                data = await upstream.read()
                return web.Response(status=upstream.status, body=data, headers=out_headers)
            response = web.StreamResponse(status=upstream.status, headers=out_headers)
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response


def _not_sent(exc: BaseException) -> bool:
    """Whether the runtime cannot have acted on the request: the connection (a kept-alive one the runtime
    closed) failed before any byte of a response, while the body was being written or before the runtime
    said anything. Such a request is sent once more on a fresh connection; never one that got an answer."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and "write request body" in str(exc)
