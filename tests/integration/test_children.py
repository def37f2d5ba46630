"""Children that die with their parent, pid files that tell a live child from a reused pid, and one
nats-server per store. Real processes throughout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from haru.core.errors import StoreBusy
from haru.host import children
from haru.host.natsd import LOCK_FILE, NatsServer
from tests.support.wait import wait_until_sync

pytestmark = pytest.mark.timeout(60)


def wait_gone(pid: int, start: int | None, timeout: float = 10.0) -> None:
    wait_until_sync(lambda: not children.alive(pid, start), timeout, what=f"process {pid} to be gone")


PARENT = """
import sys, time
from pathlib import Path
from haru.host import children
proc = children.spawn([sys.executable, "-c", "import time; time.sleep(60)"], pidfile=Path(sys.argv[1]), what="sleeper",
                      death_signal=int(sys.argv[2]) or None)
print(proc.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("death_signal", [signal.SIGTERM, 0], ids=["with-death-signal", "without"])
def test_a_child_dies_with_its_sigkilled_parent_or_is_found_by_its_pid_file(tmp_path, death_signal):
    pidfile = tmp_path / "run" / "sleeper.pid"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(pidfile), str(int(death_signal))], stdout=subprocess.PIPE, text=True
    )
    child = int(parent.stdout.readline())
    record = json.loads(pidfile.read_text())
    assert record["pid"] == child and record["start"] == children.start_time(child)
    assert children.holder(pidfile) is not None and not children.orphaned(record)  # its parent lives
    parent.kill()
    parent.wait()
    if death_signal:
        wait_gone(child, record["start"])  # else the child outlived its SIGKILLed parent
        assert children.holder(pidfile) is None
        return
    try:
        time.sleep(0.5)
        assert children.alive(child, record["start"])  # a real orphan
        assert children.orphaned(children.holder(pidfile))
        stopped = children.stop_leftover(pidfile, timeout=5)
        assert stopped is not None and stopped["ended"] == "terminated"
        assert not children.alive(child, record["start"]) and not pidfile.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def test_a_pid_file_naming_a_reused_pid_names_nobody(tmp_path):
    pidfile = tmp_path / "x.pid"
    pidfile.write_text(json.dumps({"pid": 1, "start": -5, "what": "impostor"}))  # pid 1 lives, but not since then
    assert children.holder(pidfile) is None
    assert children.stop_leftover(pidfile) is None and not pidfile.exists()


def test_a_second_nats_server_on_a_held_store_is_refused_naming_the_holder(tmp_path):
    first = NatsServer(tmp_path / "store")
    first.start_sync()
    try:
        second = NatsServer(tmp_path / "store")
        with pytest.raises(StoreBusy) as err:
            second.start_sync()
        message = str(err.value)
        assert f"nats-server pid {first.proc.pid}" in message and f"kill {first.proc.pid}" in message, message
        assert second.proc is None
        # the lock lives as long as the server: once it is gone (even by SIGKILL) the store is free
        first.kill()
        second.start_sync()
        second.stop_sync()
    finally:
        first.stop_sync()


def test_a_store_lock_held_by_no_recorded_server_is_waited_for_then_refused(tmp_path):
    """A server just stopped may hold the store's lock for a moment while its threads exit, with its pid
    record already gone: the next server waits for the lock (up to LOCK_WAIT_S) instead of refusing at
    once, and refuses, naming no pid, if it is still held after that."""
    store = tmp_path / "store"
    store.mkdir()
    holder = [
        sys.executable,
        "-c",
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(float(sys.argv[2]))",
    ]
    brief = subprocess.Popen([*holder, str(store / LOCK_FILE), "0.6"], stdout=subprocess.PIPE, text=True)
    assert brief.stdout.readline().strip() == "held"
    server = NatsServer(store)
    try:
        started = time.monotonic()
        server.start_sync()  # waits for the brief holder to let go
        assert time.monotonic() - started >= 0.3
    finally:
        server.stop_sync()
        brief.wait()
    stubborn = subprocess.Popen([*holder, str(store / LOCK_FILE), "30"], stdout=subprocess.PIPE, text=True)
    try:
        assert stubborn.stdout.readline().strip() == "held"
        late = NatsServer(store)
        late.LOCK_WAIT_S = 0.5
        with pytest.raises(StoreBusy) as err:
            late.start_sync()
        assert "is held by another process" in str(err.value) and late.proc is None
    finally:
        stubborn.kill()
        stubborn.wait()
