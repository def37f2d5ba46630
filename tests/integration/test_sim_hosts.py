"""The many-hosts harness (agents/sim/hosts.py) against the real control plane, at small N, so that
`bench/scale.py` cannot rot: a real nats-server, `haru projector`, `haru promoter` and `haru gateway` as
child processes, three fleets of two simulated hosts speaking the agents' protocol (events with
expected sequences, heartbeats, the `nats.micro` command service, serving ports).

What a user would see: every fleet gets its first route (the standby put to sleep by the promoter's
commands), chat through the gateway reaches the active host, a detached GPU fails its fleet over
(and chat follows), and a killed agent is found silent and heard again. No speed is asserted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from haru.agents.sim.hosts import SimHosts
from haru.core import subjects
from haru.core.events import DomainReachable, DomainUnreachable
from haru.core.views import FleetView, view_decoder
from haru.log.eventlog import EventLog
from tests.support.ports import lasting_port
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(120)


def spawn(args: list[str], url: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "HARU_NATS_URL": url, "HARU_NO_UVLOOP": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "haru.cli", *args, "--log-format", "json"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(log, "wb"),
        start_new_session=True,
    )


async def views(log: EventLog) -> dict[str, FleetView]:
    return {k.removeprefix("fleet."): view_decoder.decode(v) for k, v in (await log.views()).items()}


async def chat(session: aiohttp.ClientSession, port: int, fleet: str) -> tuple[int, str]:
    async with session.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        headers={"X-Haru-Fleet": fleet},
        json={"model": "chat-8b", "messages": [{"role": "user", "content": "hi"}]},
    ) as r:
        body = await r.json()
        return r.status, body.get("system_fingerprint", "")


async def test_three_fleets_first_route_failover_and_silence(nats_server, tmp_path):
    port = lasting_port()
    kids = []
    async with EventLog.connect([nats_server.url], writer="sim:hosts") as log:
        await log.ensure()
        try:
            async with SimHosts(log, heartbeat_ms=500, heartbeat_timeout_ms=1500, load_ms=100, wake_ms=50) as hosts:
                await hosts.grow(3)
                kids = [
                    spawn(["projector"], nats_server.url, tmp_path / "projector.log"),
                    spawn(["promoter", "--id", "promoter:test"], nats_server.url, tmp_path / "promoter.log"),
                    spawn(["gateway", "--port", str(port)], nats_server.url, tmp_path / "gateway.log"),
                ]

                async def all_steady():
                    return not hosts.steady(await views(log))

                await wait_until(all_steady, 60, interval_s=0.1, what="every fleet's first route, its standby asleep")
                got = await views(log)
                assert {v.active for v in got.values()} == {"a"}

                async with aiohttp.ClientSession() as session:

                    async def answers(fleet: str, domain: str):
                        try:
                            status, who = await chat(session, port, fleet)
                        except aiohttp.ClientError:
                            return False
                        return status == 200 and who == f"{fleet}/{domain}"

                    for f in hosts.fleets:
                        await wait_until(
                            lambda f=f: answers(f, "a"), 20, interval_s=0.1, what=f"chat through the gateway to {f}/a"
                        )

                    # The provider takes f001's active GPU: the promoter fails over to b (wake, probe, flip).
                    await hosts.host("f001", "a").detach_gpu()
                    await wait_until(
                        lambda: answers("f001", "b"), 30, interval_s=0.1, what="chat to follow f001's failover to b"
                    )

                    # the gateway follows the route subject itself, so it may serve b before the projector's view
                    # of f001 says so: wait for that view too
                    async def f001_on_b():
                        return (await views(log))["f001"].active == "b"

                    await wait_until(f001_on_b, 10, interval_s=0.1, what="f001's view to say b is active")
                    assert (await views(log))["f000"].active == "a"  # the others are untouched

                # f002's standby agent is SIGKILLed and comes back: silent, then heard again.
                start = await log.last_seq()
                await hosts.host("f002", "b").restart(down_s=2.5)
                liveness = subjects.liveness("f002", "b")

                async def found_silent_and_back():
                    recs = await log.history(liveness, from_seq=start + 1)
                    kinds = [type(r.event) for r in recs]
                    return DomainUnreachable in kinds and kinds[-1] is DomainReachable

                await wait_until(
                    found_silent_and_back, 30, interval_s=0.1, what="f002/b to be found unreachable, then reachable"
                )
                assert hosts.host("f002", "b").heartbeats_sent > 0
        finally:
            for k in kids:
                k.terminate()
            for k in kids:
                try:
                    k.wait(10)
                except subprocess.TimeoutExpired:
                    k.kill()
                    k.wait()
