"""The CLI under faults: a refused NATS connection is reported at once; a watch says when the
control plane went away and when it came back (a real nats-server stopped and restarted)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime

import pytest

from haru.core import subjects
from haru.core.errors import LogUnavailable
from haru.core.events import RouteMoved
from haru.core.views import RouteIntent, Target, view_encoder
from haru.host.natsd import NatsServer
from haru.log.eventlog import EventLog
from tests.support import haru
from tests.support.ports import lasting_port


async def test_a_refused_connection_fails_before_the_connect_timeout():
    url = f"nats://127.0.0.1:{lasting_port()}"  # nothing listens there
    # connect_timeout is 30 s: the old client retried the refused server until it ran out.
    async with asyncio.timeout(10):
        with pytest.raises(LogUnavailable) as caught:
            await EventLog.open([url], writer="test", connect_timeout=30)
    assert url in str(caught.value) and "connection refused" in str(caught.value)
    assert "--nats-url" in str(caught.value)


def test_every_cli_command_says_nats_is_refused_in_one_line():
    url = f"nats://127.0.0.1:{lasting_port()}"
    for argv in (("history",), ("verify",), ("status",), ("route",)):
        out = haru(*argv, nats_url=url, timeout=30)
        assert out.returncode == 6, (argv, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and url in lines[0] and "connection refused" in lines[0], (argv, out.stderr)


class Lines:
    """A child's stderr, read line by line on a thread, waited for with a bound."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._cv:
                self.lines.append(line.rstrip("\n"))
                self._cv.notify_all()

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for line in self.lines:
                    if text in line:
                        return line
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no line with {text!r} within {timeout} s; got {self.lines}")
                self._cv.wait(left)


@pytest.mark.timeout(120)
async def test_route_watch_says_when_the_control_plane_went_away_and_came_back(nats_server, event_log):
    intent = RouteIntent(fleet="default", revision=7, active=Target(domain="a", serving_url="http://a:9000"))
    await event_log.publish_intent("default", view_encoder.encode(intent), expect=0)
    proc = subprocess.Popen(
        [sys.executable, "-m", "haru.cli", "route", "--watch", "--nats-url", nats_server.url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HARU_NO_UVLOOP": "1"},
    )
    try:
        out, err = Lines(proc.stdout), Lines(proc.stderr)
        await asyncio.to_thread(out.wait_for, "route revision 7", 30)
        await event_log.close()
        port, store = nats_server.port, nats_server.store_dir
        await asyncio.to_thread(nats_server.stop_sync)
        away = await asyncio.to_thread(err.wait_for, "control plane unreachable since", 30)
        assert nats_server.url in away and "may be stale" in away
        again = NatsServer(store, port=port)
        await asyncio.to_thread(again.start_sync)
        try:
            back = await asyncio.to_thread(err.wait_for, "control plane reachable again", 30)
            assert "away " in back
            # And it is live again: a new intent is printed (after an outage a watcher follows an intent only
            # if the log holds its route move, so the move is appended first and the intent names it).
            async with EventLog.connect([again.url], writer="test") as log:
                revision = await log.append(
                    subjects.route("default"), RouteMoved(at=datetime.now(UTC), active="b"), expect=0
                )
                nxt = RouteIntent(
                    fleet="default", revision=revision, active=Target(domain="b", serving_url="http://b:9000")
                )
                await log.publish_intent(
                    "default", view_encoder.encode(nxt), expect=(await log.last_intent("default"))[1]
                )
            await asyncio.to_thread(out.wait_for, f"route revision {revision}", 30)
        finally:
            await asyncio.to_thread(again.stop_sync)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
