"""`haru route follow` driving a real HAProxy and a real nginx (Debian's packages, children on free ports)
from route intents published into a real nats-server, and `--exec` with a command that fails: each follows
the route, and reports on haru.router.<fleet>.<router> the revision it applied."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from datetime import UTC, datetime

import aiohttp
import msgspec
import pytest

from haru.core import subjects
from haru.core.events import RouteMoved
from haru.core.residency import Answer
from haru.core.router_acks import report_decoder
from haru.core.views import RouteIntent, Target, Weighted, view_encoder
from haru.host.tasks import cancel_and_wait
from haru.routers import Command, Follower
from tests.support.gateway import Upstream
from tests.support.routers import haproxy, nginx
from tests.support.wait import wait_until

FLEET = "default"


def intent(active: str, url: str, revision: int, **kw) -> RouteIntent:
    return RouteIntent(
        fleet=FLEET,
        revision=revision,
        active=Target(domain=active, serving_url=url, reachable=True),
        answers={"m": Answer(answer="ready")},
        **kw,
    )


class Reports:
    def __init__(self) -> None:
        self.got: list = []

    async def listen(self, log) -> None:
        def on(msg) -> None:
            self.got.append((msg.subject, report_decoder.decode(msg.data)))

        await log.bus.subscribe(subjects.router_report(FLEET), on)

    def last(self, router: str):
        mine = [r for s, r in self.got if s == subjects.router_report(FLEET, router)]
        return mine[-1] if mine else None


@contextlib.asynccontextmanager
async def following(event_log, router: str, target, interval_s: float = 0.2, **kw):
    f = Follower(event_log, FLEET, router, target, interval_s=interval_s, backoff_s=0.1, **kw)
    task = asyncio.create_task(f.run())
    try:
        yield f
    finally:
        await cancel_and_wait(task)


async def served_by(url: str) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json={"model": "m", "messages": []}) as r:
            return r.headers.get("X-Domain", f"status {r.status}")


class Named(Upstream):
    async def handle(self, request):
        from aiohttp import web

        await request.read()
        return web.Response(text=self.domain, headers={"X-Domain": self.domain})


@pytest.fixture
async def two():
    a, b = await Named("a").start(), await Named("b").start()
    try:
        yield a, b
    finally:
        await a.stop()
        await b.stop()


async def publish(event_log, ri: RouteIntent, expect: int) -> int:
    return await event_log.publish_intent(FLEET, view_encoder.encode(ri), expect=expect)


@pytest.mark.parametrize("router", ["haproxy", "nginx"])
async def test_a_router_follows_a_flip_and_reports_the_revision_it_applied(tmp_path, event_log, two, router):
    a, b = two
    reports = Reports()
    await reports.listen(event_log)
    seq = await publish(event_log, intent("a", a.url, 5), 0)
    start = haproxy if router == "haproxy" else nginx
    async with start(tmp_path) as proc, following(event_log, "edge", proc.target()):
        await wait_until(lambda: (r := reports.last("edge")) is not None and r.revision == 5, 10, what="revision 5")
        assert await served_by(proc.url) == "a"
        await publish(event_log, intent("b", b.url, 9), seq)
        await wait_until(lambda: (r := reports.last("edge")) is not None and r.revision == 9, 10, what="revision 9")
        # applied means applied: every request from now on goes to b
        assert [await served_by(proc.url) for _ in range(6)] == ["b"] * 6
        r = reports.last("edge")
        assert r.kind == router and r.active == "b" and r.wanted == 9 and r.error == ""


async def test_haproxy_takes_a_split_as_weights_and_says_what_it_cannot_follow(tmp_path, event_log, two):
    a, b = two
    reports = Reports()
    await reports.listen(event_log)
    ri = intent(
        "a",
        a.url,
        3,
        weights={"b": 25},
        model_weights={"m": {"b": 50}},
        weighted={
            "b": Weighted(
                target=Target(domain="b", serving_url=b.url, reachable=True), answers={"m": Answer(answer="ready")}
            )
        },
    )
    await publish(event_log, ri, 0)
    async with haproxy(tmp_path) as hp, following(event_log, "edge", hp.target()) as f:
        await wait_until(lambda: (r := reports.last("edge")) is not None and r.revision == 3, 10)
        weights = [await f.target.command(f"get weight haru_default/{s}") for s in ("haru1", "haru2")]
        assert [w.split()[0] for w in weights] == ["75", "25"]
        seen = [await served_by(hp.url) for _ in range(40)]
        assert seen.count("b") == 10 and seen.count("a") == 30
        assert any("model m has its own split" in n for n in reports.last("edge").notes)


async def test_an_exec_command_that_fails_is_reported_and_tried_again(tmp_path, event_log):
    reports = Reports()
    await reports.listen(event_log)
    got = tmp_path / "got.json"
    allow = tmp_path / "allow"
    script = tmp_path / "apply.py"
    script.write_text(
        "import os, sys\n"
        f"data = sys.stdin.read()\n"
        f"if not os.path.exists({str(allow)!r}):\n"
        "    print('the router said no'); sys.exit(3)\n"
        f"open({str(got)!r}, 'w').write(os.environ['HARU_ROUTE_REVISION'] + ' ' + data)\n"
    )
    await publish(event_log, intent("a", "http://127.0.0.1:8001", 4), 0)
    async with following(event_log, "script", Command(f"{sys.executable} {script}")) as f:
        await wait_until(lambda: (r := reports.last("script")) is not None and r.error, 10)
        r = reports.last("script")
        assert r.revision == 0 and r.wanted == 4 and "exited 3: the router said no" in r.error
        allow.touch()
        await wait_until(lambda: (r := reports.last("script")) is not None and r.revision == 4 and not r.error, 10)
        assert f.failures >= 1
    revision, body = got.read_text().split(" ", 1)
    assert revision == "4" and msgspec.json.decode(body)["active"]["domain"] == "a"


async def test_an_intent_published_while_the_router_applies_the_last_one_is_applied_next(tmp_path, event_log):
    reports = Reports()
    await reports.listen(event_log)
    started = tmp_path / "started"
    script = tmp_path / "slow.sh"
    script.write_text(f"#!/bin/sh\ncat > /dev/null\ntouch {started}\nsleep 0.5\n")
    script.chmod(0o755)
    seq = await publish(event_log, intent("a", "http://127.0.0.1:8001", 1), 0)
    async with following(event_log, "slow", Command(str(script))) as f:
        await wait_until(started.exists, 10, what="the first apply under way")
        await publish(event_log, intent("b", "http://127.0.0.1:8002", 2), seq)  # while it applies revision 1
        await wait_until(lambda: f.applied is not None and f.applied.revision == 2, 10, what=f.state)


async def test_haru_status_says_which_routers_are_behind_and_by_how_much(tmp_path, nats_server, event_log):
    from haru.core.views import FleetView
    from tests.support import haru

    await event_log.put_view(
        subjects.view_key(FLEET), view_encoder.encode(FleetView(fleet=FLEET, active="b", route_revision=9)), last=0
    )
    seq = await publish(event_log, intent("a", "http://127.0.0.1:8001", 5), 0)
    no = tmp_path / "no.sh"
    no.write_text('#!/bin/sh\ncat > /dev/null\n[ "$HARU_ROUTE_REVISION" = 5 ] || { echo refused; exit 1; }\n')
    no.chmod(0o755)
    # interval 60 s: what `haru status` shows is what it asked for, not a periodic report
    async with (
        following(event_log, "good", Command("cat"), interval_s=60) as good,
        following(event_log, "stuck", Command(str(no)), interval_s=60) as stuck,
    ):
        await wait_until(lambda: good.applied is not None and stuck.applied is not None, 10)
        await publish(event_log, intent("b", "http://127.0.0.1:8002", 9), seq)
        await wait_until(lambda: good.applied.revision == 9 and stuck.error, 10)
        await asyncio.sleep(0.5)
        done = await asyncio.to_thread(haru, "status", "--fleet", FLEET, nats_url=nats_server.url)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "routers following the route (haru route follow): 2, 1 not on revision 9" in out, out
    assert "good (exec): applied revision 9 → b" in out, out
    assert "stuck (exec): BEHIND: holds revision 5 → a, the route is at 9 → b" in out, out
    assert "not applied: the command" in out and "exited 1: refused" in out, out


async def test_the_console_lists_the_routers_and_which_are_behind(event_log):
    from tests.support.gateway import Fleet, running_gateway

    async with running_gateway(event_log) as gw:
        fleet = Fleet(event_log, gw)
        await fleet.publish(intent("a", "http://127.0.0.1:8001", 5))
        async with following(event_log, "edge", Command("cat")) as f:
            await wait_until(lambda: f.applied is not None, 10)

            async def rows():
                async with aiohttp.ClientSession() as s:
                    async with s.get(gw.url + "/ui/api/routers?fleet=default") as r:
                        assert r.status == 200
                        return (await r.json())["routers"]

            got = await wait_until(rows, 10, what="the router in the console")
            assert [(r["router"], r["kind"], r["state"], r["revision"], r["active"]) for r in got] == [
                ("edge", "exec", "applied", 5, "a")
            ]


async def test_the_follower_applies_again_and_catches_up_after_a_nats_outage(tmp_path, nats_server, event_log):
    from haru.log.eventlog import EventLog

    got = tmp_path / "revisions"
    seq = await publish(event_log, intent("a", "http://127.0.0.1:8001", 1), 0)
    async with EventLog.connect([nats_server.url], writer="router:edge") as own:
        cmd = Command(f"sh -c 'cat > /dev/null; echo $HARU_ROUTE_REVISION >> {got}'")
        async with following(own, "edge", cmd, resync_s=120) as f:  # no periodic resync within the test
            await wait_until(lambda: f.applied is not None and f.applied.revision == 1, 10)
            applies = f.applies
            await asyncio.to_thread(nats_server.stop_sync)
            await asyncio.sleep(0.5)
            await asyncio.to_thread(nats_server.start_sync)
            # NATS is back: the follower applies the route it holds again (a router may have restarted too)
            await wait_until(lambda: f.applies > applies, 30, what=f.state)

            async def moved():  # after an outage a router follows an intent only if the log holds its move
                try:
                    return await event_log.append(
                        subjects.route(FLEET), RouteMoved(at=datetime.now(UTC), active="b"), expect=0
                    )
                except Exception:
                    return None

            revision = await wait_until(moved, 30, interval_s=0.25, what="appending after the restart")

            async def published():
                try:
                    return await publish(event_log, intent("b", "http://127.0.0.1:8002", revision), seq)
                except Exception:
                    return None

            await wait_until(published, 30, interval_s=0.25, what="publishing after the restart")
            await wait_until(lambda: f.applied.revision == revision, 30, what=f.state)
    assert got.read_text().split()[-1] == str(revision)


async def test_haru_route_follow_as_a_command_drives_haproxy_and_stops_on_sigint(tmp_path, nats_server, event_log, two):
    import os
    import signal
    import subprocess

    from tests.support import haru

    bad = await asyncio.to_thread(haru, "route", "follow", "haproxy", nats_url=nats_server.url)
    assert bad.returncode == 2 and "haproxy needs --socket" in bad.stderr
    bad = await asyncio.to_thread(haru, "route", "follow", "traefik", nats_url=nats_server.url)
    assert bad.returncode == 2 and "one of haproxy, nginx, envoy or --exec CMD" in bad.stderr
    a, _ = two
    reports = Reports()
    await reports.listen(event_log)
    await publish(event_log, intent("a", a.url, 3), 0)
    async with haproxy(tmp_path) as hp:
        argv = [sys.executable, "-m", "haru.cli", "route", "follow", "haproxy", "--socket", hp.socket]
        argv += ["--name", "cli-edge", "--nats-url", nats_server.url]
        env = {**os.environ, "HARU_NO_UVLOOP": "1"}
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        try:
            await wait_until(lambda: (r := reports.last("cli-edge")) is not None and r.revision == 3, 20)
            assert await served_by(hp.url) == "a"
        finally:
            proc.send_signal(signal.SIGINT)
            out, _ = await asyncio.to_thread(proc.communicate, timeout=20)
        assert b"following fleet default's route as router cli-edge: HAProxy backend haru_default" in out, out
        assert proc.returncode == 130, (proc.returncode, out[-2000:])
