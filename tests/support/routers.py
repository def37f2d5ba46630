"""Real HAProxy and nginx as child processes on free loopback ports, each with a generated configuration
whose upstream a route follower owns (haru.routers), and a small upstream that says which domain it is.

    async with haproxy(tmp) as hp:       # hp.url (the frontend), hp.socket (runtime API), hp.follower_target()
    async with nginx(tmp) as ng:         # ng.url, ng.file (the upstream include), ng.follower_target()

Both are Debian's packages (/usr/sbin/haproxy, /usr/sbin/nginx). `need(name)` skips a test when one is
missing, unless HARU_REQUIRE_ROUTERS=1 (CI), where it fails: CI installs both.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.ports import lasting_port

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
SLOTS = ("haru1", "haru2", "haru3", "haru4")


def need(binary: str) -> None:
    if os.path.exists(binary):
        return
    why = f"{binary} is not installed (apt-get install {Path(binary).name})"
    if os.environ.get("HARU_REQUIRE_ROUTERS") == "1":
        pytest.fail(why + " and HARU_REQUIRE_ROUTERS=1")
    pytest.skip(why)


async def _wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None and proc.returncode != 0:
            raise AssertionError(f"{proc.args[0]} exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise AssertionError(f"{proc.args[0]} did not listen on {port}: {log.read_text()[-2000:]}")


class HAProxyProc:
    def __init__(self, tmp: Path, backend: str) -> None:
        self.port = lasting_port()
        self.admin_port = lasting_port()
        self.backend = backend
        self.socket = f"127.0.0.1:{self.admin_port}"
        self.url = f"http://127.0.0.1:{self.port}"
        self.cfg = tmp / "haproxy.cfg"
        self.log = tmp / "haproxy.log"
        self.cfg.write_text(
            f"""global
    stats socket ipv4@127.0.0.1:{self.admin_port} level admin
    stats timeout 10s
defaults
    mode http
    timeout connect 2s
    timeout client 30s
    timeout server 30s
    option http-server-close
frontend web
    bind 127.0.0.1:{self.port}
    default_backend {backend}
backend {backend}
    balance roundrobin
    retry-on conn-failure empty-response
    retries 2
    server-template haru 1-{len(SLOTS)} 127.0.0.1:9 disabled
"""
        )
        self.proc: subprocess.Popen | None = None

    async def start(self) -> HAProxyProc:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [HAPROXY, "-db", "-f", str(self.cfg)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        await _wait_port(self.port, self.proc, self.log)
        await _wait_port(self.admin_port, self.proc, self.log)
        return self

    def target(self):
        from haru.routers import HAProxy

        return HAProxy(self.socket, self.backend, SLOTS)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class NginxProc:
    def __init__(self, tmp: Path, upstream: str, keepalive: str = "0") -> None:
        self.port = lasting_port()
        self.upstream = upstream
        self.prefix = tmp / "nginx"
        (self.prefix / "logs").mkdir(parents=True, exist_ok=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.file = self.prefix / "haru-upstream.conf"
        self.file.write_text(f"upstream {upstream} {{ server 127.0.0.1:9 down; }}\n")
        self.cfg = self.prefix / "nginx.conf"
        self.pid_file = self.prefix / "nginx.pid"
        self.log = self.prefix / "logs" / "error.log"
        user = "user root;\n" if os.geteuid() == 0 else ""
        self.cfg.write_text(
            f"""{user}daemon off;
worker_processes 1;
pid {self.pid_file};
error_log {self.log} info;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {self.prefix}/body;
    proxy_temp_path {self.prefix}/proxy;
    fastcgi_temp_path {self.prefix}/fastcgi;
    uwsgi_temp_path {self.prefix}/uwsgi;
    scgi_temp_path {self.prefix}/scgi;
    include {self.file};
    # A graceful reload closes the old workers' idle client keep-alive connections: a client sending on
    # one at that instant sees it closed before any byte of an answer. Off here, so a reload costs nothing.
    keepalive_timeout {keepalive};
    server {{
        listen 127.0.0.1:{self.port};
        location / {{
            proxy_pass http://{upstream};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 60s;
            proxy_next_upstream error timeout;
        }}
    }}
}}
"""
        )
        self.proc: subprocess.Popen | None = None

    def reload_command(self) -> list[str]:
        return [NGINX, "-p", str(self.prefix), "-c", str(self.cfg), "-s", "reload"]

    async def start(self) -> NginxProc:
        with open(self.prefix / "stdout.log", "wb") as out:
            self.proc = subprocess.Popen(
                [NGINX, "-p", str(self.prefix), "-c", str(self.cfg)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        await _wait_port(self.port, self.proc, self.log)
        return self

    def target(self):
        from haru.routers import Nginx

        return Nginx(self.file, self.upstream, self.reload_command(), pid_file=self.pid_file)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@contextlib.asynccontextmanager
async def haproxy(tmp: Path, backend: str = "haru_default"):
    need(HAPROXY)
    hp = HAProxyProc(tmp, backend)
    try:
        yield await hp.start()
    finally:
        hp.stop()


@contextlib.asynccontextmanager
async def nginx(tmp: Path, upstream: str = "haru_default", keepalive: str = "0"):
    need(NGINX)
    ng = NginxProc(tmp, upstream, keepalive)
    try:
        yield await ng.start()
    finally:
        ng.stop()
