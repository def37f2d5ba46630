"""`--exec CMD`: the operator's own command applies the route, with the intent as JSON on its stdin.

The command runs once per new route intent (and again on every resync), with the intent on stdin and
HARU_FLEET, HARU_ROUTE_REVISION, HARU_ACTIVE_DOMAIN and HARU_ACTIVE_URL in its environment. Exit 0 is
applied; any other exit status, or running past the timeout, is not applied: the follower reports it
with the command's last line of output and tries again with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal

from haru.core.router_plans import Plan
from haru.routers.errors import NotApplied

__all__ = ["Command"]


class Command:
    kind = "exec"

    def __init__(self, command: str, *, timeout: float = 30.0) -> None:
        self.argv = shlex.split(command)
        if not self.argv:
            raise ValueError("--exec needs a command")
        self.timeout = timeout

    def describe(self) -> str:
        return f"the command {shlex.join(self.argv)!r}"

    async def apply(self, plan: Plan, intent: bytes, *, again: bool) -> None:
        active = next((u for u in plan.upstreams if u.domain == plan.active), None)
        env = {
            **os.environ,
            "HARU_FLEET": plan.fleet,
            "HARU_ROUTE_REVISION": str(plan.revision),
            "HARU_ACTIVE_DOMAIN": plan.active,
            "HARU_ACTIVE_URL": f"http://{active.host}:{active.port}" if active else "",
        }
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            raise NotApplied(f"cannot run {self.argv[0]!r}: {exc}") from exc
        try:
            async with asyncio.timeout(self.timeout):
                out, _ = await proc.communicate(intent)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: whatever it started goes too
            await proc.wait()
            raise NotApplied(f"{self.describe()} ran past {self.timeout:g} s and was killed") from None
        if proc.returncode != 0:
            said = out.decode(errors="replace").strip().splitlines()
            tail = f": {said[-1]}" if said else ""
            raise NotApplied(f"{self.describe()} exited {proc.returncode}{tail}")
