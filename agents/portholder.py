"""The domain's serving port, held by a tiny process that outlives the agent.

    sock = listening_socket(state_dir, host, port)   # the agent: the listening socket, from the holder
    stop_holder(state_dir)                           # the agent stopping for good: the port closes

`python -m agents.portholder <control socket> <host> <port>` binds the serving port once and never
accepts on it: it hands the listening socket to whichever agent asks (over a unix socket in the agent's
state directory, `SCM_RIGHTS`), and holds it open while no agent does. An agent restarting therefore
never closes the port: connections that arrive while no agent accepts wait in the kernel's accept queue
(the handshake completes; the request's bytes wait in the socket buffer) and the next agent accepts
them. Nothing is read twice and nothing is lost: a byte is read by exactly one agent, or by none.

Why this mechanism (docs/architecture.md, "The serving port across agent restarts"): it needs nothing
from the gateway's hot path, works without systemd (systemd's socket activation is the same idea, and
`deploy/` could use it instead), and the process is ~40 lines that do nothing per request.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from agents.errors import PortHolderError

__all__ = ["listening_socket", "stop_holder", "HOLDER_SOCKET"]

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


def _ask(path: Path, what: bytes, timeout: float = 5.0) -> tuple[dict, list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c, _short(path) as addr:
        c.settimeout(timeout)
        c.connect(addr)
        c.sendall(what)
        msg, fds, _flags, _addr = socket.recv_fds(c, 4096, 1)
    return json.loads(msg or b"{}"), fds


def listening_socket(state_dir: Path, host: str, port: int, *, die_with_agent: bool = False) -> socket.socket:
    """The serving port's listening socket, from the holder (started first if none answers). A holder
    bound elsewhere (the config changed host or port) is stopped and replaced."""
    path = _control_path(state_dir)
    for _ in range(2):
        try:
            doc, fds = _ask(path, b"fd")
        except (OSError, ValueError):
            _spawn(path, host, port, die_with_agent)
            continue
        if not fds:
            raise PortHolderError(f"the serving port holder at {path} answered without a socket: {doc}")
        sock = socket.socket(fileno=fds[0])
        if (port and doc.get("port") != port) or doc.get("host") != host:
            sock.close()
            stop_holder(state_dir)
            _spawn(path, host, port, die_with_agent)
            continue
        sock.setblocking(False)
        return sock
    doc, fds = _ask(path, b"fd")
    sock = socket.socket(fileno=fds[0])
    sock.setblocking(False)
    return sock


def stop_holder(state_dir: Path) -> None:
    """Close the serving port for good (the agent stops and unloads)."""
    with contextlib.suppress(OSError, ValueError):
        _ask(_control_path(state_dir), b"stop", timeout=2.0)


def _die_with_parent() -> None:  # tests before issue 14 only (HARU_RUNTIMES_DIE_WITH_AGENT=1)
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _spawn(path: Path, host: str, port: int, die_with_agent: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agents.portholder", str(path), host, str(port)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True,  # it outlives the agent, like the runtimes
            preexec_fn=_die_with_parent if die_with_agent else None,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                        os.environ.get("PYTHONPATH", "")]))},
        )
    except OSError as exc:
        raise PortHolderError(f"cannot start the serving port holder: {exc}") from exc
    deadline = time.monotonic() + _START_WAIT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
            raise PortHolderError(f"cannot open the serving port {host}:{port}: {err or 'the holder exited'}; free "
                                  f'it or set "serving": {{"port": ...}} in the agent config')
        if path.exists():
            if proc.stderr is not None:
                proc.stderr.close()
            return
        time.sleep(0.01)
    raise PortHolderError(f"the serving port holder did not come up in {_START_WAIT_S:.0f}s")


def main(argv: list[str]) -> int:
    path, host, port = Path(argv[0]), argv[1], int(argv[2])
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
    control.listen(8)
    os.replace(tmp, path)  # appears only once it answers
    answer = json.dumps({"host": host, "port": bound, "pid": os.getpid()}).encode()
    while True:
        conn, _ = control.accept()
        with conn:
            try:
                what = conn.recv(16)
                if what == b"fd":
                    socket.send_fds(conn, [answer], [listener.fileno()])
                else:
                    conn.sendall(answer)
            except OSError:
                continue
        if what == b"stop":
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
