"""The history commands' log: the running control plane's, or a stopped home's, read off its disk.

    async with open_log(args, "why") as log:     # args.nats_url, args.nats_creds (add_nats_options)
        ...

`haru why`, `as-of`, `history`, `verify` and `status` read the event log and the views through NATS.
When the URL is the home's own (no `--nats-url` or `$HARU_NATS_URL` naming another) and no nats-server
runs on the home's store (its lock is free: `haru up` or `haru serve` stopped, or the box was turned off
and on again), the store is copied aside under that lock, a private nats-server is started on the copy
on a free loopback port, and the command reads that, saying on stderr that it reads a stopped home. The
home's own store is never opened for writing: a later `haru up` finds it as it was left.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from haru.cli.common import default_nats_url, nats_servers
from haru.host import natsd
from haru.log.eventlog import EventLog
from haru.up.home import haru_home

__all__ = ["open_log", "stopped_store"]

# What a copy of the store leaves out: the server's own lock, pid record and log.
_NOT_COPIED = (natsd.LOCK_FILE, natsd.PID_FILE, "nats-server.log")


def stopped_store(args: argparse.Namespace) -> Path | None:
    """The home's NATS store when the command reads the home's own URL and no server holds that store."""
    if os.environ.get("HARU_NATS_URL") or args.nats_url != default_nats_url():
        return None  # a server the operator named: never second-guessed
    store = haru_home() / "nats"
    if not (store / "jetstream").is_dir():
        return None
    return store if _lock_is_free(store) else None


def _lock_is_free(store: Path) -> bool:
    try:
        fd = os.open(store / natsd.LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # also drops the shared lock


def _copy_store(store: Path, dest: Path) -> None:
    """Copy the store under its lock (shared: a nats-server starting meanwhile waits, then finds it whole)."""
    fd = os.open(store / natsd.LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        shutil.copytree(store, dest, ignore=shutil.ignore_patterns(*_NOT_COPIED), symlinks=True)
    finally:
        os.close(fd)


@contextlib.asynccontextmanager
async def open_log(
    args: argparse.Namespace, who: str, *, replay_timeout: float | None = None
) -> AsyncIterator[EventLog]:
    kw = {"replay_timeout": replay_timeout} if replay_timeout is not None else {}
    store = stopped_store(args)
    if store is None:
        async with EventLog.connect(
            nats_servers(args.nats_url), writer=f"cli:{who}", creds=args.nats_creds, **kw
        ) as log:
            yield log
        return
    with tempfile.TemporaryDirectory(prefix="haru-stopped-home-") as tmp:
        copy = Path(tmp) / "nats"
        _copy_store(store, copy)
        print(
            f"haru: the control plane of {store.parent} is not running: reading its stored log "
            f"(a private copy of {store}, as it was last written)",
            file=sys.stderr,
        )
        async with natsd.NatsServer(copy) as server:
            async with EventLog.connect([server.url], writer=f"cli:{who}", **kw) as log:
                yield log
