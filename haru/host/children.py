"""Child processes that die with their parent, and the pid files that find them when they did not.

    proc = spawn(argv, ..., pidfile=home / "run" / "nats-server.pid", what="nats-server")
    stop_leftover(home / "run" / "nats-server.pid")   # after a crash: stop what the last run left

Every child runs in a session of its own (`start_new_session`): a Ctrl-C in the terminal reaches
only the parent, which stops its children in order, and the parent can signal a child's whole
process group (the child and whatever it started) with one `killpg`. Being in its own session, a
child no longer hears the terminal's signals, so on Linux it also asks the kernel for a
parent-death signal (`prctl(PR_SET_PDEATHSIG)`) before it execs: when the parent dies, even by
SIGKILL, the child gets `signal` at once.

The parent-death signal fires when the *thread* that forked the child exits, not the process: spawn
from the thread that lives as long as the parent (the event loop's), never from a worker thread.

Where the signal cannot help (not Linux, a child that ignores it, a parent killed before the child
set it) the pid file does: it holds the child's pid and its start time from /proc/<pid>/stat, so a
pid reused by an unrelated process is never taken for the child.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from haru.host import procfs

_PR_SET_PDEATHSIG = 1


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, haru.host.procfs); None if gone."""
    st = procfs.stat(pid)
    return st.start if st is not None else None


def alive(pid: int, start: int | None) -> bool:
    """Whether `pid` is still the process that was started at `start` (and not a zombie)."""
    if pid <= 1 or start is None:
        return False
    st = procfs.stat(pid)
    return st is not None and st.start == start and not st.zombie


def die_with_parent(sig: int) -> Any:
    """A preexec_fn: ask for `sig` when the parent dies; if it already died, die now."""
    parent = os.getpid()

    def preexec() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, sig)
        except (OSError, AttributeError):  # not Linux: the pid file sweep covers it
            return
        if os.getppid() != parent:  # the parent died between fork and prctl
            os.kill(os.getpid(), sig)

    return preexec


def spawn(
    argv: list[str],
    *,
    pidfile: Path | None = None,
    what: str = "",
    death_signal: int | None = signal.SIGTERM,
    **popen: Any,
) -> subprocess.Popen[Any]:
    """Popen in a new session, with a parent-death signal (None: none), recorded in `pidfile`."""
    if death_signal is not None:
        popen["preexec_fn"] = die_with_parent(death_signal)
    proc = subprocess.Popen(argv, start_new_session=True, **popen)
    if pidfile is not None:
        write_pidfile(pidfile, proc.pid, what or Path(argv[0]).name)
    return proc


def write_pidfile(path: Path, pid: int, what: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    me = os.getpid()
    tmp.write_text(
        json.dumps({"pid": pid, "start": start_time(pid), "what": what, "parent": me, "parent_start": start_time(me)})
    )
    os.replace(tmp, path)


def read_pidfile(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("pid"), int) else None


def holder(path: Path) -> dict[str, Any] | None:
    """The live process a pid file names (its record), or None if it is gone or was never written."""
    doc = read_pidfile(path)
    if doc is None or not alive(doc["pid"], doc.get("start")):
        return None
    return doc


def orphaned(doc: dict[str, Any]) -> bool:
    """Whether the process a pid file names outlived the process that started it."""
    return not alive(int(doc.get("parent") or 0), doc.get("parent_start"))


def stop_group(pid: int, start: int | None, timeout: float) -> str:
    """SIGTERM the process group led by `pid` (or the process, if it leads none), SIGKILL after
    `timeout`. Returns how it ended: "gone", "terminated" or "killed"."""
    if not alive(pid, start):
        return "gone"

    def signal_it(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)

    signal_it(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid, start):
            return "terminated"
        time.sleep(0.05)
    signal_it(signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while alive(pid, start) and time.monotonic() < deadline:
        time.sleep(0.05)
    return "killed"


def stop_leftover(path: Path, timeout: float = 10.0) -> dict[str, Any] | None:
    """Stop the live process a pid file names (and its group); remove the file. Returns its record
    with `"ended"` set, or None when there was nothing alive to stop."""
    doc = holder(path)
    out = None
    if doc is not None:
        doc["ended"] = stop_group(doc["pid"], doc.get("start"), timeout)
        out = doc
    with contextlib.suppress(OSError):
        path.unlink()
    return out
