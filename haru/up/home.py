"""A `haru up`'s home ($HARU_HOME, default ~/.haru): one `haru up` per home, what a dead one left, `--fresh`.

HomeLock(home)                      an flock on `$HARU_HOME/up.lock` (the OS releases it when the holder
                                    dies, however it dies) and `up.json` saying who holds it
stop_leftovers(home, embedded=...)  stop what a `haru up` that died on this home left alive (the
                                    children's `run/*.pid` records, nats-server's in its store)
fresh_start(home)                   `haru up --demo --fresh`: the last demo's state moved aside, never deleted
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from datetime import UTC, datetime
from pathlib import Path

import structlog

from haru.core.errors import AlreadyRunning, StoreBusy
from haru.host import children, natsd

log = structlog.get_logger("haru.up.home")

NATS_URL_FILE = "nats.url"  # `haru status` and friends read it when no --nats-url is given
LOCK_FILE = "up.lock"
STATE_FILE = "up.json"
RUN_DIR = "run"  # the children's pid records
LEFTOVER_STOP_S = 10.0


def haru_home(explicit: str | None = None) -> Path:
    return Path(os.path.expanduser(explicit or os.environ.get("HARU_HOME") or "~/.haru"))


class HomeLock:
    """One `haru up` per home: an flock on `$HARU_HOME/up.lock`, and `up.json` saying who holds it."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.fd: int | None = None

    @property
    def state_file(self) -> Path:
        return self.home / STATE_FILE

    def acquire(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.home / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AlreadyRunning(self._refusal()) from None
        self.fd = fd
        self.publish()

    def _refusal(self) -> str:
        try:
            doc = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            doc = {}
        pid = doc.get("pid", "?")
        urls = [f"NATS {redact(doc['nats_url'])}"] if doc.get("nats_url") else []
        urls += [f"gateway {doc['gateway_url']}"] if doc.get("gateway_url") else []
        running = f"pid {pid}" + (f", {', '.join(urls)}" if urls else ", still starting")
        return (
            f"haru up is already running on {self.home} ({running}): use that one (`haru status`), "
            f"stop it first (kill {pid}), or give this one another home (--home DIR or HARU_HOME)"
        )

    def publish(self, **info: object) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "home": str(self.home), **info}))
        os.replace(tmp, self.state_file)

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                self.state_file.unlink()
            os.close(fd)


def stop_leftovers(home: Path, *, embedded: bool) -> list[dict]:
    """Stop what a `haru up` that died on this home left alive: agents and services first, nats-server
    last. Only processes whose parent is gone are stopped; a live server on our store whose parent
    lives (another tool started it) is refused with StoreBusy."""
    files = sorted((home / RUN_DIR).glob("*.pid"))
    if embedded:
        files.append(home / "nats" / natsd.PID_FILE)
    stopped = []
    for f in files:
        doc = children.holder(f)
        if doc is not None and not children.orphaned(doc):
            if f.name == natsd.PID_FILE:
                raise StoreBusy(
                    f"the NATS store {f.parent} is held by nats-server pid {doc['pid']} (started by live pid "
                    f"{doc.get('parent')}, not a `haru up`): stop it first (kill {doc['pid']}) or use another home"
                )
            continue
        ended = children.stop_leftover(f, LEFTOVER_STOP_S)
        if ended is not None:
            log.warning(
                "up.leftover_stopped",
                what=ended.get("what"),
                pid=ended["pid"],
                ended=ended["ended"],
                why="a previous haru up on this home died and left it running",
            )
            stopped.append(ended)
    return stopped


FRESH_PARTS = ("nats", "sim", "demo")  # what `haru up --demo` keeps between runs under $HARU_HOME


def fresh_start(home: Path, now: datetime | None = None) -> Path | None:
    """`haru up --demo --fresh`: move the state a previous demo left (its event log, simulated GPUs, agents)
    to `$HARU_HOME/previous/<UTC time>/`, never deleting it. None when there was nothing to move.
    Raises AlreadyRunning (a ConfigError) when a `haru up` holds this home."""
    lock = HomeLock(home)
    lock.acquire()  # the same lock `haru up` holds: never move a live store away
    try:
        parts = [home / p for p in FRESH_PARTS if (home / p).exists()]
        if not parts:
            return None
        stamp = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")
        dest = home / "previous" / stamp
        dest.mkdir(parents=True, exist_ok=True)
        for p in parts:
            os.replace(p, dest / p.name)
        return dest
    finally:
        lock.release()


def redact(urls: str) -> str:
    """NATS URLs without their passwords, for printing."""
    import re

    return re.sub(r"//([^:/@,]+):[^@/,]*@", r"//\1:***@", urls)
