"""The runtime seam: one small interface over vLLM, llama-server and an external endpoint.

A runtime is one model served by one OpenAI-compatible HTTP server bound to 127.0.0.1. The agent
drives every runtime through `Runtime`; the simulator (`agents.sim.vllm`) is driven through the
vLLM adapter by pointing `ModelSpec.binary` at it, so tests run the same code paths as a GPU host.

Nothing a runtime says is trusted on its own: a 200 from `/sleep` or `/wake_up` is checked against
`/is_sleeping`, and "ready" means health passed, `/v1/models` lists the model and a one-token
completion answered (see `agents.probes`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import msgspec

from haru.agents.errors import OutOfMemory, ProbeUnanswered, RuntimeRefused, RuntimeUnreachable
from haru.core.launch import ArgConflict, Launch, with_interpreter
from haru.core.launch import launch as plan_launch
from haru.core.specs import ModelSpec
from haru.host.children import start_time
from haru.host.natsd import free_port

__all__ = [
    "Health",
    "Runtime",
    "HttpRuntime",
    "ProcessRuntime",
]


class Health(msgspec.Struct, frozen=True):
    ok: bool
    status: int = 0  # HTTP status (0 = no answer)
    detail: str = ""


class Runtime(Protocol):
    """What the agent needs from a runtime. One instance = one model = at most one live process."""

    spec: ModelSpec
    kind: str  # vllm | llama_server | external
    can_sleep: bool

    @property
    def base_url(self) -> str: ...
    @property
    def pid(self) -> int | None: ...
    def alive(self) -> bool: ...
    async def start(self) -> None: ...
    async def wait_exit(self) -> int | None: ...
    async def stop(self, grace_s: float) -> int | None: ...
    async def health(self, timeout_s: float = 5.0) -> Health: ...
    async def listening(self) -> bool: ...
    async def list_models(self, timeout_s: float = 5.0) -> list[str]: ...
    async def is_sleeping(self, timeout_s: float = 5.0) -> bool | None: ...
    async def sleep(self, level: int, timeout_s: float) -> None: ...
    async def wake(self, timeout_s: float) -> None: ...
    async def probe_completion(self, timeout_s: float) -> int: ...
    async def greedy_answer(self, model: str, timeout_s: float) -> str: ...
    def output_tail(self, limit: int = 2000) -> str: ...
    def learn_from_exit(self, output: str) -> str: ...
    async def close(self) -> None: ...


def killpg(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class _Models(msgspec.Struct):
    data: list[dict[str, Any]] = []


_models_decoder = msgspec.json.Decoder(_Models)


class _Sleeping(msgspec.Struct):
    is_sleeping: bool


_sleeping_decoder = msgspec.json.Decoder(_Sleeping)


class _Choices(msgspec.Struct):
    choices: list[dict[str, Any]] = []


_choices_decoder = msgspec.json.Decoder(_Choices)

# The wake check: a fixed prompt, completed greedily (temperature 0, seed 0) for a few tokens.
WAKE_CHECK_PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
WAKE_CHECK_TOKENS = 8

_OOM_MARKERS = ("out of memory", "outofmemory", "cuda error: out of memory")


class HttpRuntime:
    """The HTTP half every runtime shares: health, models, sleep/wake (vLLM), probes."""

    kind = "external"
    can_sleep = False
    health_path = "/health"

    def __init__(self, spec: ModelSpec, *, session: aiohttp.ClientSession, host: str = "127.0.0.1") -> None:
        self.spec = spec
        self._session = session
        self._host = host
        self._port = spec.port

    @property
    def base_url(self) -> str:
        return f"http://{self._host}:{self._port}"

    @property
    def pid(self) -> int | None:
        return None

    def alive(self) -> bool:
        return True

    def output_tail(self, limit: int = 2000) -> str:
        return ""

    def learn_from_exit(self, output: str) -> str:
        """What a start that exited teaches about this runtime's abilities ("" = nothing; see vLLM's)."""
        return ""

    async def close(self) -> None:
        pass

    async def _request(
        self, method: str, path: str, *, timeout_s: float, json: object | None = None
    ) -> tuple[int, bytes]:
        url = self.base_url + path
        try:
            async with self._session.request(
                method, url, json=json, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                return resp.status, await resp.read()
        except TimeoutError as exc:
            raise RuntimeUnreachable(f"{self.spec.name}: {method} {path} got no answer in {timeout_s:.1f}s") from exc
        except aiohttp.ClientError as exc:
            raise RuntimeUnreachable(f"{self.spec.name}: {method} {path} failed: {exc}") from exc

    async def listening(self) -> bool:
        """Whether the runtime's port takes connections (here: assumed; a spawned runtime's is asked)."""
        return True

    async def health(self, timeout_s: float = 5.0) -> Health:
        try:
            status, body = await self._request("GET", self.health_path, timeout_s=timeout_s)
        except RuntimeUnreachable as exc:
            return Health(ok=False, status=0, detail=str(exc))
        text = body[:300].decode(errors="replace")
        return Health(ok=status == 200, status=status, detail="" if status == 200 else text)

    async def list_models(self, timeout_s: float = 5.0) -> list[str]:
        status, body = await self._request("GET", "/v1/models", timeout_s=timeout_s)
        if status != 200:
            raise RuntimeRefused(
                f"{self.spec.name}: /v1/models answered {status}",
                status=status,
                body=body[:300].decode(errors="replace"),
            )
        try:
            models = _models_decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise RuntimeRefused(
                f"{self.spec.name}: /v1/models is not an OpenAI model list: {exc}", status=status
            ) from exc
        return [str(m.get("id", "")) for m in models.data]

    async def is_sleeping(self, timeout_s: float = 5.0) -> bool | None:
        if not self.can_sleep:
            return None
        status, body = await self._request("GET", "/is_sleeping", timeout_s=timeout_s)
        if status != 200:
            raise RuntimeRefused(f"{self.spec.name}: /is_sleeping answered {status}", status=status)
        try:
            return _sleeping_decoder.decode(body).is_sleeping
        except msgspec.DecodeError as exc:
            raise RuntimeRefused(f"{self.spec.name}: /is_sleeping said {body[:100]!r}", status=status) from exc

    async def sleep(self, level: int, timeout_s: float) -> None:
        raise RuntimeRefused(f"{self.spec.name}: a {self.kind} runtime has no sleep mode")

    async def wake(self, timeout_s: float) -> None:
        raise RuntimeRefused(f"{self.spec.name}: a {self.kind} runtime has no sleep mode")

    async def probe_completion(self, timeout_s: float) -> int:
        """A real one-token completion. Returns its latency in ms; raises ProbeUnanswered."""
        started = time.monotonic()
        body = {"model": self.spec.name, "prompt": "ping", "max_tokens": 1, "temperature": 0}
        try:
            status, raw = await self._request("POST", "/v1/completions", timeout_s=timeout_s, json=body)
        except RuntimeUnreachable as exc:
            raise ProbeUnanswered(f"{self.spec.name}: probe completion got no answer: {exc}") from exc
        if status != 200:
            text = raw[:300].decode(errors="replace")
            if any(m in text.lower() for m in _OOM_MARKERS):
                raise OutOfMemory(f"{self.spec.name}: probe completion: {text}", status=status, body=text)
            raise ProbeUnanswered(f"{self.spec.name}: probe completion answered {status}: {text}")
        try:
            choices = _choices_decoder.decode(raw).choices
        except msgspec.DecodeError as exc:
            raise ProbeUnanswered(f"{self.spec.name}: probe completion body is not a completion: {exc}") from exc
        if not choices:
            raise ProbeUnanswered(f"{self.spec.name}: probe completion returned no choices")
        return int((time.monotonic() - started) * 1000)

    async def greedy_answer(self, model: str, timeout_s: float) -> str:
        """The text of a greedy, fixed-seed completion of `WAKE_CHECK_PROMPT` by `model` (the served
        model or one of its adapters): the same weights give the same text, so the answer recorded
        before a sleep is what a correct wake must give again. Raises ProbeUnanswered."""
        body = {
            "model": model,
            "prompt": WAKE_CHECK_PROMPT,
            "max_tokens": WAKE_CHECK_TOKENS,
            "temperature": 0,
            "seed": 0,
        }
        try:
            status, raw = await self._request("POST", "/v1/completions", timeout_s=timeout_s, json=body)
        except RuntimeUnreachable as exc:
            raise ProbeUnanswered(
                f"{self.spec.name}: the greedy check completion ({model}) got no answer: {exc}"
            ) from exc
        if status != 200:
            raise ProbeUnanswered(
                f"{self.spec.name}: the greedy check completion ({model}) answered {status}: "
                f"{raw[:300].decode(errors='replace')}"
            )
        try:
            choices = _choices_decoder.decode(raw).choices
        except msgspec.DecodeError as exc:
            raise ProbeUnanswered(
                f"{self.spec.name}: the greedy check completion ({model}) is not a completion: {exc}"
            ) from exc
        if not choices or not isinstance(choices[0].get("text"), str):
            raise ProbeUnanswered(f"{self.spec.name}: the greedy check completion ({model}) returned no text")
        return str(choices[0]["text"])

    @staticmethod
    def _raise_for(name: str, what: str, status: int, body: bytes) -> None:
        text = body[:500].decode(errors="replace")
        if any(m in text.lower() for m in _OOM_MARKERS):
            raise OutOfMemory(f"{name}: {what} failed: {text}", status=status, body=text)
        raise RuntimeRefused(f"{name}: {what} answered {status}: {text}", status=status, body=text)


class ProcessRuntime(HttpRuntime):
    """A runtime the agent spawns: own session (process group), output to a log file, exit waiter."""

    default_binary: list[str] = []

    async def listening(self) -> bool:
        """Whether the runtime's port accepts a TCP connection yet: a bare connect, closed at once (~90 us
        of the agent's CPU when refused, a third of an HTTP request's), so a loading runtime can be
        watched every few ms. vLLM binds its port at start but listens only once its engine is up (its
        port refuses connections for the whole load); llama-server listens before its model is loaded."""
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_INET6 if ":" in self._host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, (self._host, self._port))
            except OSError:
                return False
            # Connecting to a free port of the ephemeral range can pick that very port as its own source:
            # TCP's simultaneous open, a socket connected to itself. That is nobody listening.
            return bool(sock.getsockname() != sock.getpeername())

    def __init__(
        self,
        spec: ModelSpec,
        *,
        session: aiohttp.ClientSession,
        log_dir: Path,
        base_env: dict[str, str] | None = None,
        bind_host: str = "127.0.0.1",
        gpu_memory_bytes: int = 0,
    ) -> None:
        # Loopback unless the domain serves `direct` (a firewalled private network): then the runtime
        # binds where routers reach it, and the agent talks to it there (0.0.0.0 is reached on loopback).
        super().__init__(spec, session=session, host="127.0.0.1" if bind_host in ("0.0.0.0", "::", "") else bind_host)
        self.bind_host = bind_host or "127.0.0.1"
        self._log_dir = Path(log_dir)
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._popen: subprocess.Popen[Any] | None = None  # ours; None for an adopted runtime
        self._pid: int | None = None
        self._start: int | None = None  # kernel start time of `_pid` (/proc/<pid>/stat)
        self._exit: asyncio.Future[int | None] | None = None
        self._adopted = False  # taken over from a previous agent, not our child
        self._argv: list[str] = []
        self._log_path = self._log_dir / f"runtime-{_file_token(spec.name)}.log"
        self.gpu_memory_bytes = gpu_memory_bytes  # the GPU's declared memory: vLLM's fraction is of it

    # -- the command line: the plan's (haru.core.launch), never hand-written
    def launch(self) -> Launch:
        """The exact argv and environment, from the plan (`haru.core.launch.launch`). Raises RuntimeRefused
        when the model's args contradict its plan (a log declared before `haru apply` checked them)."""
        return self._launch()

    def _launch(self, *, sleep_mode: bool = True, platform: str = "") -> Launch:
        try:
            spec = (
                self.spec if self.spec.runtime == self.kind else msgspec.structs.replace(self.spec, runtime=self.kind)
            )
            if not spec.binary and (managed := self.managed_binary()):
                spec = msgspec.structs.replace(spec, binary=managed)
            if spec.binary[:1] == ["python"]:
                spec = msgspec.structs.replace(spec, binary=with_interpreter(spec.binary, sys.executable))
            return plan_launch(
                spec,
                gpu_memory_bytes=self.gpu_memory_bytes,
                port=self._port,
                bind_host=self.bind_host,
                base_env=self._base_env,
                sleep_mode=sleep_mode,
                platform=platform,
            )
        except ArgConflict as exc:
            raise RuntimeRefused(f"{self.spec.name}: {exc}; fix: {exc.fix}") from exc
        except ValueError as exc:
            raise RuntimeRefused(f"{self.spec.name}: cannot plan its command line: {exc}") from exc

    def managed_binary(self) -> list[str]:
        """The binary to run when the layout names none, if Haru manages one ([] = the plan's default)."""
        return []

    def argv(self) -> list[str]:
        return self.launch().argv

    def env(self) -> dict[str, str]:
        """The agent's environment, the runtime pinned to its GPU, then the model's own `env` (which wins).

        CUDA numbers devices fastest-first unless told PCI order; NVML (and so the layout's `gpu` index)
        uses PCI order. Both are set, so the index an operator declares is the card the runtime uses.
        """
        return self.launch().env

    # -- process
    #
    # The runtime is a plain Popen child (not an asyncio subprocess: asyncio kills a child whose
    # transport it closes, and a runtime must outlive the agent). Its exit is watched through a pidfd,
    # the same way for a child of ours and for a runtime adopted from a previous agent.
    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def adopted(self) -> bool:
        return self._adopted

    @property
    def log_path(self) -> Path:
        return self._log_path

    def alive(self) -> bool:
        return self._pid is not None and self._exit is not None and not self._exit.done()

    async def start(self) -> None:
        if self.alive():
            return
        if not self.spec.port:
            self._port = free_port()
        self._log_dir.mkdir(parents=True, exist_ok=True)
        planned = self.launch()
        argv = planned.argv
        with open(self._log_path, "ab") as log:
            log.write(f"--- haru agent starting: {' '.join(argv)}\n".encode())
            log.flush()
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=planned.env,
                    # Its own session, and no parent-death signal: it outlives the agent (a restart, an
                    # upgrade, a crash) and the next agent adopts it from its identity file.
                    start_new_session=True,
                )
            except OSError as exc:
                raise RuntimeUnreachable(f"{self.spec.name}: cannot start {argv[0]!r}: {exc}") from exc
        self._popen = proc
        self._argv = list(argv)
        self._watch(proc.pid, start_time(proc.pid), child=proc)

    def _watch(self, pid: int, start: int | None, child: subprocess.Popen[Any] | None) -> bool:
        """Watch `pid`'s exit through a pidfd. False if it is not the process started at `start` any more."""
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            fd = -1
        if fd < 0 or (child is None and start_time(pid) != start):  # gone, or its pid reused
            if fd >= 0:
                os.close(fd)
            if child is None:
                return False
        done: asyncio.Future[Any] = loop.create_future()

        def exited() -> None:
            if fd >= 0:
                loop.remove_reader(fd)
                os.close(fd)
            if not done.done():
                # Our child: its status (negative = signal). An adopted one is not ours to reap.
                done.set_result(child.wait() if child is not None else None)
                # What it left in its group dies with it: vLLM's engine process outlives a SIGKILLed API
                # server, holding the model's memory (the group id stays taken while it has members).
                killpg(pid, signal.SIGKILL)

        if fd >= 0:
            loop.add_reader(fd, exited)
        else:
            exited()
        self._pid, self._start, self._adopted, self._exit = pid, start, child is None, done
        return True

    # -- a runtime that outlived its agent
    def identity(self) -> dict[str, Any] | None:
        """What the next agent needs to adopt this process: pid, kernel start time, argv, port, model, plan."""
        if not self.alive() or self._pid is None:
            return None
        return {
            "pid": self._pid,
            "start": self._start,
            "argv": self._argv,
            "port": self._port,
            "model": self.spec.name,
            "runtime": self.kind,
            "plan": msgspec.to_builtins(self.spec),
        }

    def planned_argv(self, port: int) -> list[str] | None:
        """The argv this runtime would be started with on `port` (None: the plan cannot be built)."""
        saved = self._port
        self._port = port
        try:
            return self.launch().argv
        except RuntimeRefused:
            return None
        finally:
            self._port = saved

    def adopt(self, pid: int, start: int, port: int, argv: list[str]) -> bool:
        """Take over a live runtime a previous agent started. False if it is not that process any more
        (gone, or its pid reused by an unrelated process: never signalled then)."""
        if self.alive():
            return False
        self._port = port
        self._argv = list(argv)
        self._popen = None
        return self._watch(pid, start, child=None)

    async def wait_exit(self) -> int | None:
        """Resolves when the current process exits, with its exit code (negative = signal; None for an
        adopted runtime, whose status goes to its reaper)."""
        if self._exit is None:
            await asyncio.Future()  # never started: never exits
        return await asyncio.shield(self._exit)  # type: ignore[arg-type]

    async def stop(self, grace_s: float) -> int | None:
        """SIGTERM to the process group, SIGKILL after `grace_s`; returns the exit code."""
        pid, done = self._pid, self._exit
        if pid is None or done is None:
            return None
        if not done.done():
            killpg(pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(grace_s):
                    await asyncio.shield(done)
            except TimeoutError:
                killpg(pid, signal.SIGKILL)
                await asyncio.shield(done)
        killpg(pid, signal.SIGKILL)  # stragglers left in the group (a pgid is not reused while it has members)
        return done.result()

    def output_tail(self, limit: int = 2000) -> str:
        try:
            with open(self._log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - limit))
                return f.read().decode(errors="replace")
        except OSError:
            return ""


def _file_token(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:100]
