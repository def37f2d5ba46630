"""The one seam between Haru and the `sky` CLI: run an argv with a bound, get its status and output.

`SubprocessExec` is the real adapter: the command runs in its own process group, and past its
timeout the whole group gets SIGTERM, then SIGKILL after a grace, so a hung `sky launch` leaves no
child behind. Tests hand the drivers the same adapter pointed at a fake `sky` script, or any callable
that satisfies `Exec`.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

import msgspec

from haru.provision.errors import SkyTimeout, SkyUnavailable

__all__ = ["Exec", "ExecResult", "SubprocessExec"]

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class ExecResult(msgspec.Struct, frozen=True, kw_only=True):
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    duration_s: float

    @property
    def output(self) -> str:
        return self.stdout + ("\n" if self.stdout and self.stderr else "") + self.stderr

    def summary(self, what: str) -> str:
        """One line for an error: what ran, its status, and the last lines it printed (colours stripped)."""
        tail = _ANSI.sub("", self.output).strip().splitlines()[-3:]
        return f"{what} exited {self.returncode}: {' | '.join(tail) or 'no output'}"


class Exec(Protocol):
    async def __call__(
        self, argv: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None
    ) -> ExecResult:
        """Run argv to completion within timeout_s (raise SkyTimeout past it). `env` is added to the
        process's inherited environment."""
        ...


class SubprocessExec:
    """Run commands as child processes, each in its own process group."""

    def __init__(self, *, kill_grace_s: float = 5.0) -> None:
        self.kill_grace_s = kill_grace_s

    async def __call__(
        self, argv: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None
    ) -> ExecResult:
        argv = list(argv)
        child_env = dict(os.environ)
        child_env.update(env or {})
        started = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=child_env,
                start_new_session=True,
            )
        except FileNotFoundError:
            raise SkyUnavailable(
                f"cannot run {argv[0]!r}: not found; install SkyPilot (pip install skypilot) "
                "or pass the path of `sky` (--sky / HARU_SKY)"
            ) from None
        except PermissionError:
            raise SkyUnavailable(f"cannot run {argv[0]!r}: permission denied; make it executable") from None
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            await self._kill(proc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise SkyTimeout(argv, timeout_s) from None
        return ExecResult(
            argv=argv,
            returncode=proc.returncode if proc.returncode is not None else -1,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            duration_s=time.monotonic() - started,
        )

    async def _kill(self, proc: asyncio.subprocess.Process) -> None:
        for sig, wait in ((signal.SIGTERM, self.kill_grace_s), (signal.SIGKILL, self.kill_grace_s)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                await asyncio.wait_for(proc.wait(), wait)
                break
            except TimeoutError:
                continue
        # the group may outlive its leader: make sure nothing of it is left
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
