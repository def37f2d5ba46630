"""What Linux's /proc says about a process: one reader of `/proc/<pid>/stat` for the whole tree.

    st = stat(pid)          # Stat(pid, state, ppid, pgrp, start, flags) or None when it is gone
    gone(pid)               # no such process, or a zombie (its memory is already released)
    dying(pid)              # gone, or already carrying out its exit (a SIGKILL being torn down)
    for st in every():      # every process the OS lists

`start` is the process's start time in clock ticks since boot (field 22): with the pid, it names
one process for good, so a pid the kernel reused for something else is never taken for the one a
pid file or an identity file recorded. The command name (field 2) is in parentheses and may hold
spaces or parentheses itself, so the fields are read after the last ')'.

Off Linux there is no /proc: `stat` answers None and `every` nothing, and callers say so.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Stat", "dying", "every", "gone", "parse", "pid_alive", "stat"]

PF_EXITING = 0x4  # the kernel's flag for a task inside do_exit (field 9 of /proc/<pid>/stat)


@dataclass(frozen=True, slots=True)
class Stat:
    pid: int
    state: str  # R, S, D, Z, X, ...
    ppid: int
    pgrp: int
    start: int  # clock ticks since boot
    flags: int = 0  # the kernel's per-task flags (field 9)

    @property
    def zombie(self) -> bool:
        return self.state in ("Z", "X")

    @property
    def exiting(self) -> bool:
        """A zombie, or a task already inside its exit. A big process killed with SIGKILL takes the kernel
        tens to hundreds of ms to tear down; its sockets are closed (a client reads a reset) before it is
        a zombie, and all that while this flag is set."""
        return self.zombie or bool(self.flags & PF_EXITING)


def parse(pid: int, raw: str) -> Stat | None:
    """A `/proc/<pid>/stat` line, or None when it is not one."""
    rest = raw[raw.rfind(")") + 2 :].split()
    try:
        return Stat(
            pid=pid, state=rest[0], ppid=int(rest[1]), pgrp=int(rest[2]), start=int(rest[19]), flags=int(rest[6])
        )
    except (IndexError, ValueError):
        return None


def stat(pid: int) -> Stat | None:
    """The process `pid` as /proc has it now; None when it is gone (or there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    return parse(pid, raw)


def dying(pid: int) -> bool:
    """Gone, a zombie, or inside its exit (see `Stat.exiting`). Without /proc: `gone`."""
    st = stat(pid)
    if st is not None:
        return st.exiting
    return gone(pid)


def gone(pid: int) -> bool:
    """No such process, or a zombie. Without /proc, asks the kernel whether the pid exists."""
    st = stat(pid)
    if st is not None:
        return st.zombie
    if os.path.isdir("/proc"):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def pid_alive(pid: int) -> bool:
    """True while `pid` runs. A zombie (exited, not yet reaped) counts as dead: its memory is gone."""
    return pid > 0 and not gone(pid)


def every() -> Iterator[Stat]:
    """Every process /proc lists (those that exit while it is read are left out)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    for entry in entries:
        if entry.isdigit() and (st := stat(int(entry))) is not None:
            yield st
