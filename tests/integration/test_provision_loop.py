"""The whole provisioning loop with simulated hosts: the fake `sky` starts a real `haru agent` on the
simulator when it launches a cluster and stops it when it takes one down.

provision a and b through the promoter -> first route -> detach the active's GPU -> failover to b ->
auto-replace of a (policy): down the failed host, launch a new one in the next region, its agent
joins, models load, it goes to sleep with training running -> a is the standby again. The promoter
is SIGKILLed while the replacement's `sky launch` runs; the restarted one finds the cluster with
`sky status` and does not launch it again. `haru op` tells the story.
"""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from haru.agents.sim.gpu_state import SimGpuState
from haru.core.events import OperationCompleted, ReplaceRequested, StepCompleted, StepStarted
from haru.core.layout import load_layout
from haru.core.residency import Sleeping
from haru.log.apply import apply
from haru.log.requests import request_operation
from haru.provision.execs import SubprocessExec
from haru.provision.skyserve import SkyServe
from tests.support import haru
from tests.support.agent_harness import REPO, write_config, write_layout
from tests.support.clock import now
from tests.support.fake_sky import FakeSky
from tests.support.ports import lasting_port
from tests.support.promoter import PromoterProcess, op_events, view_of, wait_op_end, wait_view
from tests.support.wait import wait_until

F = "f"


def cloud_layout(tmp, url: str, *, auto_replace: bool):
    path = write_layout(
        tmp / "layout.json",
        tmp,
        fleet=F,
        training={"vram": "4GiB"},
        policy={"auto_replace": auto_replace, "max_launches_per_hour": 5, "degraded_grace_ms": 3000},
    )
    doc = json.loads(path.read_text())
    for d in doc["domains"]:
        d["provider"] = "skypilot"
        d["region"] = "r1"
        d["provision"] = {
            "cloud": "aws",
            "regions": ["r1", "r2"],
            "accelerators": "L4:1",
            "use_spot": True,
            "nats_url": url,
            "secrets": ["HARU_SERVING_TOKEN"],  # the launched agent serves beyond loopback
            "launch_timeout_s": 60,
            "status_timeout_s": 30,
            "down_timeout_s": 60,
        }
    path.write_text(json.dumps(doc))
    return path


async def _serve_ready(sky, name: str) -> bool:
    status = await sky.status(name)
    return status is not None and status.status == "READY"


@pytest.mark.timeout(300)
async def test_failover_then_auto_replace_with_a_promoter_killed_mid_launch(tmp_path, nats_server, event_log):
    url = nats_server.url
    layout = load_layout(cloud_layout(tmp_path, url, auto_replace=False))
    await apply(event_log, layout, now())
    fake = FakeSky(tmp_path / "sky")
    for d in ("a", "b"):
        config = write_config(tmp_path / f"agent-{d}.json", url, tmp_path, domain=d, fleet=F)
        fake.add_host(
            f"haru-{F}-{d}",
            [sys.executable, "-m", "haru.cli", "agent", "--config", str(config), "--log-format", "json"],
            tmp_path / f"host-{d}.log",
            env={"PYTHONPATH": str(REPO), "HARU_NO_UVLOOP": "1"},
            cwd=str(REPO),
            sim_dir=str(tmp_path / "sim" / d),
        )
    env = {"HARU_SKY": str(fake.path), "HARU_SERVING_TOKEN": "serving-token"}
    promoter = PromoterProcess(url, "promoter:p1", env=env, log_path=tmp_path / "promoter.log")
    promoter.start()
    try:
        # provision both domains through the promoter: launched, joined; a gets the first route, b is the
        # standby, asleep with training
        for d in ("a", "b"):
            await wait_view(
                event_log, lambda v: v.operation is None, timeout=90, what="no operation in flight", fleet=F
            )
            result = await request_operation(event_log, F, "provision", d, by="test", now=now())
            assert result.status == "accepted", result.message
            assert isinstance(await wait_op_end(event_log, result.op_id, timeout=90, fleet=F), OperationCompleted), (
                tmp_path / "promoter.log"
            ).read_text()[-3000:]
        await wait_view(
            event_log,
            lambda v: (
                v.active == "a"
                and v.operation is None
                and v.domains["b"].eligible
                and all(t.running for t in v.domains["b"].training.values())
            ),
            timeout=90,
            what="a active, b the standby with training",
            fleet=F,
        )
        assert [x["cluster"] for x in fake.launched()] == [f"haru-{F}-a", f"haru-{F}-b"]
        # now the fleet's policy asks for replacements (off by default)
        await apply(event_log, load_layout(cloud_layout(tmp_path, url, auto_replace=True)), now())

        # the replacement's launch is slow: the promoter is killed while it runs
        fake.script(launch_script=["slow"], slow_s=6)
        SimGpuState(tmp_path / "sim" / "a", 0).set_present(False)  # the provider takes a's GPU

        async def replace_launch_started():
            events = await op_events(event_log, F)
            replace = [e for e in events if isinstance(e, ReplaceRequested)]
            if replace and any(
                isinstance(e, StepStarted) and e.op_id == replace[0].op_id and e.step == "launch" for e in events
            ):
                return replace[0]
            return None

        replace = await wait_until(replace_launch_started, 90, what="the replace's launch step")
        assert replace.target == "a" and replace.reason == "auto_replace"
        await wait_until(lambda: _async(len(fake.launched()) == 3), 30, what="the replacement's sky launch")
        promoter.kill()  # mid-launch: its `sky launch` child runs on (its own session), the cluster is UP
        promoter = PromoterProcess(url, "promoter:p1", env=env, log_path=tmp_path / "promoter.log")
        promoter.start()
        done = await wait_op_end(event_log, replace.op_id, timeout=120, fleet=F)
        assert isinstance(done, OperationCompleted), (tmp_path / "promoter.log").read_text()[-3000:]

        launched = fake.launched()
        gen = launched[2]["cluster"]
        assert [x["cluster"] for x in launched] == [f"haru-{F}-a", f"haru-{F}-b", gen]  # no second launch
        assert gen.startswith(f"haru-{F}-a-r") and launched[2]["region"] == "r2"  # the failed region last
        assert fake.state()["downed"] == [f"haru-{F}-a"]
        steps = [
            (e.step, type(e).__name__)
            for e in await op_events(event_log, F, replace.op_id)
            if isinstance(e, (StepStarted, StepCompleted))
        ]
        assert steps.count(("launch", "StepStarted")) == 2  # re-started after the kill ...
        launch_done = [
            e
            for e in await op_events(event_log, F, replace.op_id)
            if isinstance(e, StepCompleted) and e.step == "launch"
        ]
        assert len(launch_done) == 1 and "found already UP (not launched again)" in launch_done[0].detail
        assert [s for s, kind in steps if kind == "StepCompleted"] == ["down", "launch", "join", "settle"]

        view = await view_of(event_log, F)
        a = view.domains["a"]
        assert view.active == "b" and a.eligible
        assert all(isinstance(m.residency, Sleeping) for m in a.models.values())
        assert all(t.running for t in a.training.values())

        shown = haru("op", replace.op_id, "--fleet", F, nats_url=url, check=True).stdout
        assert "replace of a" in shown and "auto_replace" in shown
        for step in ("down", "launch", "join", "settle"):
            assert step in shown
        # `haru why` follows the causes: the GPU reading, the failover, the replace it led to, its steps
        why = haru("why", "m1", "--domain", "a", "--fleet", F, nats_url=url, check=True).stdout
        chain = [
            "gpu_observed",
            "promotion_requested",
            "skipped: GPU 0 of a is gone (the reason for this operation)",
            "replace_requested",
            "step_completed:down",
            "step_completed:launch",
            "step_completed:join",
            "step_completed:settle ",
        ]  # not settle_old_active
        positions = [why.index(word) for word in chain]
        assert positions == sorted(positions), why
        assert "found already UP (not launched again)" in why
        assert "step_failed:settle_old_active" not in why  # skipped, with why: not a failure
    finally:
        promoter.stop()
        fake.kill_hosts(tmp_path / "state")


async def _async(value):
    return value


@pytest.mark.timeout(180)
async def test_a_skyserve_domain_provisioned_and_torn_down_through_the_promoter(tmp_path, nats_server, event_log):
    from haru.core.saga import TORN_DOWN
    from haru.host.procfs import pid_alive

    url = nats_server.url
    path = cloud_layout(tmp_path, url, auto_replace=True)
    doc = json.loads(path.read_text())
    b = doc["domains"][1]
    b["provider"] = "skyserve"
    b["provision"]["service"] = {"replicas": 1, "readiness_path": "/ready", "initial_delay_s": 600}
    path.write_text(json.dumps(doc))
    await apply(event_log, load_layout(path), now())
    fake = FakeSky(tmp_path / "sky")
    port = lasting_port()
    config = write_config(
        tmp_path / "agent-b.json", url, tmp_path, domain="b", fleet=F, serving={"host": "127.0.0.1", "port": port}
    )
    fake.add_host(
        f"haru-{F}-b",
        [sys.executable, "-m", "haru.cli", "agent", "--config", str(config), "--log-format", "json"],
        tmp_path / "host-b.log",
        env={"PYTHONPATH": str(REPO), "HARU_NO_UVLOOP": "1", "HARU_SERVING_TOKEN": "serving-token"},
        cwd=str(REPO),
        sim_dir=str(tmp_path / "sim" / "b"),
        ready_url=f"http://127.0.0.1:{port}",  # where SkyServe's readiness probe reaches the replica
    )
    promoter = PromoterProcess(
        url,
        "promoter:p1",
        env={"HARU_SKY": str(fake.path), "HARU_SERVING_TOKEN": "serving-token"},
        log_path=tmp_path / "promoter.log",
    )
    promoter.start()
    try:
        result = await request_operation(event_log, F, "provision", "b", by="test", now=now())
        assert result.status == "accepted", result.message
        assert isinstance(await wait_op_end(event_log, result.op_id, timeout=90, fleet=F), OperationCompleted), (
            tmp_path / "promoter.log"
        ).read_text()[-3000:]
        launch = [e for e in await op_events(event_log, F, result.op_id) if isinstance(e, StepCompleted)]
        assert "service haru-f-b submitted (sky serve up); endpoint 34.1.2.3:30001" in launch[0].detail
        assert set(fake.state()["services"]) == {f"haru-{F}-b"}
        (pid,) = fake.host_pids()
        view = await view_of(event_log, F)
        assert view.domains["b"].agent.running and view.domains["b"].reachable is True

        await wait_view(event_log, lambda v: v.operation is None, timeout=30, what="no operation in flight", fleet=F)
        # SkyServe reads the replica as ready (a fit standby, asleep, answers /ready without the token), so it
        # neither withholds it nor tears it down after initial_delay_s
        sky = SkyServe(SubprocessExec(), sky=str(fake.path), environ={})
        await wait_until(lambda: _serve_ready(sky, f"haru-{F}-b"), 30, interval_s=0.5, what="SkyServe READY")
        assert fake.state()["services"][f"haru-{F}-b"]["probes"][-1] == ["/ready", True]
        result = await request_operation(event_log, F, "teardown", "b", by="test", now=now())
        assert result.status == "accepted", result.message
        assert isinstance(await wait_op_end(event_log, result.op_id, timeout=60, fleet=F), OperationCompleted)
        assert fake.state()["services"] == {} and fake.state()["downed"] == [f"haru-{F}-b"]
        assert not pid_alive(pid)
        view = await wait_view(
            event_log, lambda v: not v.domains["b"].eligible, timeout=30, what="b not eligible", fleet=F
        )
        assert view.domains["b"].ineligible_why == TORN_DOWN
        # torn down on purpose: auto_replace (on in this fleet) leaves it alone, round after round
        await asyncio.sleep(2)
        assert not [e for e in await op_events(event_log, F) if isinstance(e, ReplaceRequested)]
    finally:
        promoter.stop()
        fake.kill_hosts(tmp_path / "state")
