"""nginx by an upstream include file and a graceful reload.

nginx's `http` block includes the file the follower owns, and a server proxies to its upstream:

    http {
        include /etc/nginx/haru/default.conf;          # upstream haru_default { ... }, written by the follower
        server { listen 8080; location / { proxy_pass http://haru_default; proxy_http_version 1.1;
                 proxy_set_header Connection ""; } }
    }

On a route change the follower writes the file by rename and runs the reload command (`nginx -s reload`
by default): nginx reads the new configuration, starts new workers with it and lets the old workers
finish the requests they hold. A reload whose configuration nginx refuses leaves the old workers serving
the old upstream, and `nginx -s reload` still exits 0; so, given nginx's pid file, the follower checks
that the master started new workers and that every old worker has stopped accepting (nginx retitles it
"worker process is shutting down"), and reports the plan not applied when it did not within
`settle_s` (nginx's error log says why). Without a pid file the reload command's exit status is all it knows.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from haru.core.router_plans import Plan, nginx_upstream
from haru.routers.errors import NotApplied
from haru.routers.files import replace_atomically

__all__ = ["Nginx"]


def workers_of(pid_file: Path) -> set[int]:
    """The nginx master's children (its workers), from /proc; empty when it cannot be read."""
    try:
        master = int(pid_file.read_text().split()[0])
        text = Path(f"/proc/{master}/task/{master}/children").read_text()
    except (OSError, ValueError, IndexError):
        return set()
    return {int(p) for p in text.split()}


def shutting_down(pid: int) -> bool:
    """An old worker that has stopped accepting: nginx retitles it "worker process is shutting down" (or it
    is gone)."""
    try:
        return b"shutting down" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True


def reloaded(before: set[int], now: set[int]) -> bool:
    """New workers run and every worker from before the reload has stopped accepting."""
    return bool(now - before) and all(shutting_down(p) for p in before & now)


class Nginx:
    kind = "nginx"

    def __init__(
        self,
        path: Path,
        upstream: str,
        reload: list[str],
        *,
        pid_file: Path | None = None,
        timeout: float = 10.0,
        settle_s: float = 5.0,
    ) -> None:
        self.path = path
        self.upstream = upstream
        self.reload = reload
        self.pid_file = pid_file
        self.timeout = timeout
        self.settle_s = settle_s

    def describe(self) -> str:
        return f"nginx upstream {self.upstream} (file {self.path}, reload `{' '.join(self.reload)}`)"

    async def apply(self, plan: Plan, intent: bytes, *, again: bool) -> None:
        before = workers_of(self.pid_file) if self.pid_file else set()
        if not replace_atomically(self.path, nginx_upstream(plan, self.upstream)) and again:
            return  # the file already says this, and it was reloaded when it was written
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.reload,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
        except OSError as exc:
            raise NotApplied(f"cannot run the reload command {' '.join(self.reload)!r}: {exc}") from exc
        try:
            async with asyncio.timeout(self.timeout):
                out, _ = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise NotApplied(
                f"the reload command {' '.join(self.reload)!r} did not finish in {self.timeout:g} s"
            ) from None
        if proc.returncode != 0:
            said = out.decode(errors="replace").strip().splitlines()
            raise NotApplied(
                f"the reload command {' '.join(self.reload)!r} exited {proc.returncode}: {said[-1] if said else ''}"
            )
        if self.pid_file is None or not before:
            return
        deadline = time.monotonic() + self.settle_s
        while time.monotonic() < deadline:
            if reloaded(before, workers_of(self.pid_file)):
                return
            await asyncio.sleep(0.01)
        raise NotApplied(
            f"nginx started no new workers within {self.settle_s:g} s of the reload: it refused the configuration "
            f"(its error log says why) and still serves the previous upstream"
        )
