"""The domain's serving port, held by a tiny process that outlives the agent, and bridged while no agent serves.

    sock, lease = listening_socket(state_dir, host, port)  # the agent: the listening socket, from the holder
    bridge(state_dir)                                     # the agent stops accepting (a restart): the holder does
    stop_holder(state_dir)                                # the agent stopping for good: the port closes
    holder_stats(state_dir)                               # {"bridging": ..., "bridged": ..., ...}

`python -m haru.agents.portholder <control socket> <host> <port>` binds the serving port once and hands the
listening socket to whichever agent asks (over a unix socket in the agent's state directory,
`SCM_RIGHTS`); the port never closes while an agent restarts. Control requests on that unix socket:

    fd       the listening socket. The holder stops accepting: the agent does. The connection stays
             open for the agent's lifetime (its lease): when it closes (the agent exited, SIGKILL
             included) and no other agent holds one, the holder starts bridging.
    bridge   the agent has stopped accepting (stopping, a restart expected): the holder starts bridging.
    stats    counters (JSON): bridging now, connections and requests the bridge took.
    stop     the holder exits and the port closes.

**The bridge.** While no agent accepts, the holder accepts and forwards, so a request never waits for an
agent to start (1-2 s: Python, NATS, the claim, adoption). It forwards what the agent's serving port
forwards (POST /v1/chat/completions, /v1/completions, /v1/embeddings, /tokenize, /apply-template) to the
runtime named by the body's `model` in the agent's runtime identity files (`<state_dir>/runtimes/*.json`,
agents/runtime_files.py), on 127.0.0.1:<port>, with `Connection: close`, and pipes the runtime's answer back byte for
byte (its
head gets `Connection: close`; the client connection closes after it). `GET /v1/models` lists the
models of the identity files. What it does not do, on purpose: no residency answers (the agent knows
whether a model is resident, asleep or lost; the bridge only knows a runtime was adopted or started by
some agent: a model without an identity file, or whose runtime refuses the connection, is a 503 saying
the agent is restarting, and the gateway's retry and routing act on it), no keep-alive (a bridged
connection serves one request; the gateway opens another), no retries (a request reaches a runtime at
most once), no translation of a runtime's own errors. With HARU_SERVING_TOKEN in its environment
(inherited from the agent that started it) every request needs the bearer token. When an agent
attaches (`fd`) the holder stops accepting and finishes the requests it is forwarding (streams too).
Both accepting for a moment is harmless: each connection is accepted by exactly one of them.

Why this mechanism (docs/architecture.md, "The serving port across agent restarts"): it needs nothing
from the gateway's hot path, works without systemd (systemd's socket activation is the same idea for
the port, `deploy/` could use it instead), and the process does nothing per request while an agent
serves. It is stdlib asyncio and msgspec only (no aiohttp): it starts fast and stays small.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from haru.agents.errors import PortHolderError
from haru.agents.serving_env import ServingEnv
from haru.core.errors import ConfigError
from haru.core.openai_errors import BadBody, error_body, model_of
from haru.core.specs import READY_PATH

__all__ = ["listening_socket", "bridge", "stop_holder", "holder_stats", "HOLDER_SOCKET"]

HOLDER_SOCKET = "serving.sock"
BACKLOG = 1024  # connections that may wait for the next agent
_START_WAIT_S = 10.0


def _control_path(state_dir: Path) -> Path:
    return Path(state_dir) / HOLDER_SOCKET


@contextlib.contextmanager
def _short(path: Path):
    """A path to `path` short enough for a unix socket address (108 bytes): through /proc/self/fd and
    an O_PATH descriptor of its directory when the real path is longer (deep state directories)."""
    if len(str(path).encode()) < 100:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def _connect(path: Path, what: bytes, timeout: float) -> tuple[socket.socket, dict, list[int]]:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _short(path) as addr:
            c.settimeout(timeout)
            c.connect(addr)
            c.sendall(what)
            msg, fds, _flags, _addr = socket.recv_fds(c, 4096, 1)
        return c, json.loads(msg or b"{}"), fds
    except BaseException:
        c.close()
        raise


def _ask(path: Path, what: bytes, timeout: float = 5.0) -> tuple[dict, list[int]]:
    c, doc, fds = _connect(path, what, timeout)
    c.close()
    return doc, fds


def _lease(path: Path) -> tuple[dict, list[int], socket.socket]:
    """`fd`, keeping the connection: the holder bridges when it closes."""
    c, doc, fds = _connect(path, b"fd", 5.0)
    c.settimeout(None)
    return doc, fds, c


def listening_socket(state_dir: Path, host: str, port: int) -> tuple[socket.socket, socket.socket]:
    """The serving port's listening socket, from the holder (started first if none answers), and the
    lease: keep it open while this agent accepts, close it (or exit) to have the holder bridge. A holder
    bound elsewhere (the config changed host or port) is stopped and replaced."""
    path = _control_path(state_dir)
    for _ in range(2):
        try:
            doc, fds, lease = _lease(path)
        except (OSError, ValueError):
            _spawn(path, host, port)
            continue
        if not fds:
            lease.close()
            raise PortHolderError(f"the serving port holder at {path} answered without a socket: {doc}")
        sock = socket.socket(fileno=fds[0])
        if (port and doc.get("port") != port) or doc.get("host") != host:
            sock.close()
            lease.close()
            stop_holder(state_dir)
            _spawn(path, host, port)
            continue
        sock.setblocking(False)
        return sock, lease
    doc, fds, lease = _lease(path)
    sock = socket.socket(fileno=fds[0])
    sock.setblocking(False)
    return sock, lease


def bridge(state_dir: Path) -> bool:
    """Have the holder accept and forward until the next agent attaches. False when no holder answered."""
    try:
        doc, _fds = _ask(_control_path(state_dir), b"bridge", timeout=2.0)
    except (OSError, ValueError):
        return False
    return bool(doc.get("bridging"))


def holder_stats(state_dir: Path) -> dict:
    """The holder's counters: bridging (now), bridge_connections, bridged (requests sent to a runtime),
    bridge_refused (answered by the bridge itself: 4xx, 503), leases (agents attached)."""
    doc, _fds = _ask(_control_path(state_dir), b"stats", timeout=2.0)
    return doc


def stop_holder(state_dir: Path) -> None:
    """Close the serving port for good (the agent stops and unloads)."""
    with contextlib.suppress(OSError, ValueError):
        _ask(_control_path(state_dir), b"stop", timeout=2.0)


def _spawn(path: Path, host: str, port: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "haru.agents.portholder", str(path), host, str(port)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # it outlives the agent, like the runtimes
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])
                ),
            },
        )
    except OSError as exc:
        raise PortHolderError(f"cannot start the serving port holder: {exc}") from exc
    deadline = time.monotonic() + _START_WAIT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
            raise PortHolderError(
                f"cannot open the serving port {host}:{port}: {err or 'the holder exited'}; free "
                f'it or set "serving": {{"port": ...}} in the agent config'
            )
        if path.exists():
            if proc.stderr is not None:
                proc.stderr.close()
            return
        time.sleep(0.01)
    raise PortHolderError(f"the serving port holder did not come up in {_START_WAIT_S:.0f}s")


# ----------------------------------------------------------------------------- the holder process

FORWARDED = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize", "/apply-template"}
)  # agents/serving.py's
MAX_HEAD = 64 * 1024
_PASS_REQUEST = ("content-type", "accept", "accept-encoding", "user-agent", "x-request-id", "openai-organization")
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    411: "Length Required",
    413: "Payload Too Large",
    502: "Bad Gateway",
    503: "Service Unavailable",
}


class _Refused(Exception):
    """An answer of the bridge's own (status, code, message)."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


def _response(status: int, body: bytes, extra: str = "") -> bytes:
    return (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n"
    ).encode() + body


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Send the answer, then read (and drop) what the client still sends, briefly: closing a socket with
    unread bytes resets it, and the reset can destroy the answer before the client reads it."""
    await writer.drain()
    with contextlib.suppress(OSError, asyncio.TimeoutError):
        writer.write_eof()
        async with asyncio.timeout(2.0):
            while await reader.read(65536):
                pass


class Holder:
    def __init__(self, path: Path, listener: socket.socket, answer: dict, env: ServingEnv) -> None:
        """`env`: the serving port's settings, read by this process's `main` (the agent's environment)."""
        self.path, self.listener, self.answer = path, listener, answer
        self.state_dir = path.parent
        self.token = env.token
        self.max_body = env.max_body
        self.read_timeout_s = env.limits.body_timeout_s  # head and body, together
        self.leases = 0
        self.bridging = False
        self.stats = {"bridge_connections": 0, "bridged": 0, "bridge_refused": 0}
        self.tasks: set[asyncio.Task] = set()
        self.done = asyncio.Event()

    # -- accepting ---------------------------------------------------------------------------------
    def start_bridging(self) -> None:
        if not self.bridging:
            self.bridging = True
            asyncio.get_running_loop().add_reader(self.listener.fileno(), self._accept)

    def stop_bridging(self) -> None:
        """Stop accepting (an agent does); the connections taken so far are finished."""
        if self.bridging:
            self.bridging = False
            asyncio.get_running_loop().remove_reader(self.listener.fileno())

    def _accept(self) -> None:
        # Not a cancellable sock_accept: stop_bridging is synchronous, so no accepted connection is dropped.
        for _ in range(64):
            try:
                conn, _addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return  # the agent took it, or none waits
            except OSError:  # out of descriptors (EMFILE): pause rather than spin on a readable socket
                loop = asyncio.get_running_loop()
                loop.remove_reader(self.listener.fileno())
                loop.call_later(0.1, self._resume)
                return
            conn.setblocking(False)
            self.stats["bridge_connections"] += 1
            self._spawn_task(self._serve(conn))

    def _resume(self) -> None:
        if self.bridging:  # add_reader replaces a registration: never two
            asyncio.get_running_loop().add_reader(self.listener.fileno(), self._accept)

    def _spawn_task(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- the control socket ------------------------------------------------------------------------
    async def control(self, control: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(control)
            except OSError:  # out of descriptors: the control socket must outlive it
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            self._spawn_task(self._command(conn))

    def _doc(self) -> bytes:
        return json.dumps({**self.answer, "bridging": self.bridging, "leases": self.leases, **self.stats}).encode()

    async def _command(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with conn:
            try:
                what = await asyncio.wait_for(loop.sock_recv(conn, 16), 5.0)
            except (TimeoutError, OSError):
                return
            if what == b"fd":
                self.leases += 1
                self.stop_bridging()
                try:
                    socket.send_fds(conn, [self._doc()], [self.listener.fileno()])
                    while await loop.sock_recv(conn, 64):  # the lease: until the agent closes it or exits
                        pass
                except OSError:
                    pass
                finally:
                    self.leases -= 1
                    if self.leases == 0 and not self.done.is_set():
                        self.start_bridging()
                return
            if what == b"bridge":
                self.start_bridging()
            with contextlib.suppress(OSError):
                await loop.sock_sendall(conn, self._doc())
            if what == b"stop":
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                self.stop_bridging()
                self.done.set()

    # -- the bridge --------------------------------------------------------------------------------
    async def _serve(self, conn: socket.socket) -> None:
        reader, writer = await asyncio.open_connection(sock=conn, limit=MAX_HEAD)
        try:
            try:
                path, headers, body = await asyncio.wait_for(self._read_request(reader), self.read_timeout_s)
                port, name = self._route(path, headers, body)
            except _Refused as r:
                self.stats["bridge_refused"] += 1
                writer.write(
                    _response(
                        r.status,
                        error_body(r.status, r.code, r.message, r.param),
                        "Allow: POST\r\n" if r.status == 405 else "",
                    )
                )
                await _linger(reader, writer)
                return
            except TimeoutError:
                writer.write(
                    _response(
                        408,
                        error_body(
                            408,
                            "request_timeout",
                            f"the request did not arrive within {self.read_timeout_s:.0f} s "
                            "(HARU_CLIENT_BODY_TIMEOUT_MS)",
                        ),
                    )
                )
                await writer.drain()
                return
            if port is None:  # GET /v1/models
                writer.write(_response(200, self._models()))
                await writer.drain()
                return
            await self._forward(reader, writer, port, name, path, headers, body)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass  # the client went away or sent no HTTP: nothing to answer
        except Exception as exc:  # a bug here must not take the port down: this connection ends, the rest go on
            with contextlib.suppress(OSError, ValueError):
                print(f"portholder: {type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _read_request(self, reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise _Refused(400, "invalid_request", f"the request head is over {MAX_HEAD} bytes") from None
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, _version = lines[0].split(" ", 2)
        except ValueError:
            raise _Refused(400, "invalid_request", "not an HTTP/1.1 request line") from None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                k, sep, v = line.partition(":")
                if not sep:
                    raise _Refused(400, "invalid_request", f"a request header line without a colon: {line[:80]!r}")
                headers[k.strip().lower()] = v.strip()
        path = target.split("?", 1)[0]
        if path == READY_PATH and method in ("GET", "HEAD"):  # a load balancer's probe: no token, no detail
            raise _Refused(503, "not_ready", "the agent is restarting")
        if path == "/v1/models" and method == "GET":
            self._authorize(headers)
            return path, headers, b""
        if path not in FORWARDED:
            raise _Refused(
                404,
                "not_found",
                f"{method} {path} is not served here; this port serves "
                f"POST {', '.join(sorted(FORWARDED))} and GET /v1/models",
            )
        if method != "POST":
            raise _Refused(405, "method_not_allowed", f"{path} takes POST")
        self._authorize(headers)
        if "chunked" in headers.get("transfer-encoding", "").lower():
            raise _Refused(
                411,
                "length_required",
                "a chunked request body is not accepted while the agent restarts; send the body with a Content-Length",
            )
        try:
            length = int(headers.get("content-length", ""))
            if length < 0:
                raise ValueError
        except ValueError:
            raise _Refused(
                411, "length_required", "the request needs a Content-Length header with the body's size in bytes"
            ) from None
        if length > self.max_body:
            raise _Refused(413, "payload_too_large", f"the body is over {self.max_body} bytes")
        return path, headers, await reader.readexactly(length)

    def _authorize(self, headers: dict[str, str]) -> None:
        if not self.token:
            return
        scheme, _, value = headers.get("authorization", "").partition(" ")
        if not (scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.token.encode())):
            raise _Refused(401, "unauthorized", "missing or wrong bearer token (HARU_SERVING_TOKEN)")

    def _identities(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        with contextlib.suppress(OSError):
            for f in sorted((self.state_dir / "runtimes").glob("*.json")):
                with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                    doc = json.loads(f.read_bytes())
                    out[str(doc["model"])] = {"port": int(doc["port"])}
        return out

    def _route(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int | None, str]:
        if path == "/v1/models":
            return None, ""
        name = model_of(body)
        if isinstance(name, BadBody):
            raise _Refused(400, "invalid_request", name.message, name.param)
        ident = self._identities().get(name)
        if ident is None:
            raise _Refused(
                503,
                "agent_restarting",
                f"the model `{name}` has no runtime this port can reach while "
                f"the domain's agent is restarting; retry shortly or on another domain",
                "model",
            )
        return ident["port"], name

    def _models(self) -> bytes:
        created = int(time.time())
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "haru", "residency": "restarting"}
            for name in self._identities()
        ]
        return msgspec.json.encode({"object": "list", "data": data})

    async def _forward(
        self,
        client: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        port: int,
        name: str,
        path: str,
        headers: dict[str, str],
        body: bytes,
    ) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port, limit=MAX_HEAD)
        except OSError as exc:
            self.stats["bridge_refused"] += 1
            writer.write(
                _response(
                    503,
                    error_body(
                        503,
                        "agent_restarting",
                        f"the runtime of the model `{name}` "
                        f"(127.0.0.1:{port}) refused the connection while the domain's "
                        f"agent is restarting: {exc.strerror or exc}; retry shortly "
                        f"or on another domain",
                    ),
                )
            )
            await writer.drain()
            return
        self.stats["bridged"] += 1  # from here on the request may reach the runtime: never sent again
        watch = asyncio.ensure_future(client.read(1))  # b"": the client went away, the runtime's request ends
        try:
            passed = "".join(f"{k}: {v}\r\n" for k, v in headers.items() if k in _PASS_REQUEST)
            up_writer.write(
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n"
                f"Content-Length: {len(body)}\r\n{passed}\r\n".encode()
                + body
            )
            pipe = asyncio.ensure_future(self._pipe(up_reader, up_writer, writer))
            done, _ = await asyncio.wait({pipe, watch}, return_when=asyncio.FIRST_COMPLETED)
            if pipe not in done and not watch.exception() and watch.result():
                await asyncio.wait({pipe})  # bytes after the request (pipelined): not a hang-up
                done = {pipe}
            if pipe not in done:
                pipe.cancel()  # the client hung up: the runtime's connection closes, so does its request
                return
            answered = pipe.result()
            if not answered:  # the runtime closed without a byte of answer: not resent
                writer.write(
                    _response(
                        502,
                        error_body(
                            502,
                            "upstream_unreachable",
                            f"the runtime of the model "
                            f"`{name}` (127.0.0.1:{port}) closed the connection "
                            f"without an answer",
                        ),
                    )
                )
                await writer.drain()
        finally:
            watch.cancel()
            up_writer.close()

    @staticmethod
    async def _pipe(up: asyncio.StreamReader, up_writer: asyncio.StreamWriter, writer: asyncio.StreamWriter) -> bool:
        """The runtime's answer to the client: its head with `Connection: close`, then every byte until it
        closes. False when it closed before a whole head."""
        await up_writer.drain()
        try:
            head = await up.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            return False
        lines = [
            ln
            for ln in head[:-4].split(b"\r\n")
            if ln.split(b":", 1)[0].strip().lower() not in (b"connection", b"keep-alive")
        ]
        writer.write(b"\r\n".join(lines) + b"\r\nConnection: close\r\n\r\n")
        while chunk := await up.read(65536):
            writer.write(chunk)
            await writer.drain()
        await writer.drain()
        return True


async def _main(path: Path, listener: socket.socket, answer: dict, control: socket.socket, env: ServingEnv) -> int:
    listener.setblocking(False)
    control.setblocking(False)
    holder = Holder(path, listener, answer, env)
    served = asyncio.get_running_loop().create_task(holder.control(control))
    await holder.done.wait()
    served.cancel()
    return 0


def main(argv: list[str]) -> int:
    path, host, port = Path(argv[0]), argv[1], int(argv[2])
    try:
        env = ServingEnv.from_env(os.environ)  # this process's environment (the agent's), read once here
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the agent is not for the port
    try:
        listener = socket.create_server((host, port), backlog=BACKLOG)
    except OSError as exc:
        print(exc.strerror or str(exc), file=sys.stderr)
        return 1
    bound = listener.getsockname()[1]
    control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = path.with_name(path.name + f".{os.getpid()}")
    with _short(tmp) as addr:
        control.bind(addr)
    control.listen(64)
    os.replace(tmp, path)  # appears only once it answers
    return asyncio.run(_main(path, listener, {"host": host, "port": bound, "pid": os.getpid()}, control, env))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
