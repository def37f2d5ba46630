"""The deploy cluster: three nats-servers on loopback, configured by the SHIPPED deploy/nats files.

Each node runs its own `deploy/nats/nats-N.conf`, rewritten only where a laptop must differ from production (loopback
ports instead of :4222/:6222/:8222, a temporary store directory, and the path of the `include ./haru-common.conf` line,
which in turn includes the shipped `accounts.conf` unchanged). Every rewrite must match exactly once, so a change to the
shipped files fails here instead of silently testing something else. Passwords are random per run and, with the route
URLs, reach nats-server through the environment variables the shipped files reference.

What is asserted is what an operator relies on: the cluster forms; `EventLog.ensure(replicas=3)`
makes R3 streams; an agent's credentials cannot write another domain's (or the promoter's) events
nor delete, purge or update anything, yet can do its own job; a router's credentials can only read
route intents; killing the stream leader keeps sequence-checked appends working.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.micro import add_service

from haru.core import subjects
from haru.core.commands import reply_decoder
from haru.core.errors import Conflict, LogUnavailable
from haru.core.events import AgentStarted, AgentStopping, FleetDeclared, ModelLoading, PromotionRequested, RouteMoved
from haru.core.specs import Policy
from haru.core.views import RouteIntent, Target, view_encoder
from haru.host.natsd import find_binary
from haru.host.tasks import cancel_and_wait
from haru.log.eventlog import EventLog
from tests.support.clock import now
from tests.support.cluster import (
    DEPLOY,
    GEN_ARGS,
    REPO,
    Cluster,
    Node,
    ensure_r3,
    haru_cli,
    read_env,
    rewrite,
    start_cluster,
)
from tests.support.ports import lasting_port

pytestmark = pytest.mark.timeout(90)

FLEET = "default"
STREAMS = (subjects.EVENTS_STREAM, subjects.ROUTE_STREAM, "KV_" + subjects.VIEWS_BUCKET)
DENIED = "permissions violation"  # nats-py lowercases the whole -ERR text, subject included


@pytest.fixture
async def admin(cluster):
    await ensure_r3(cluster)
    async with cluster.log("admin") as log:
        yield log


async def violation(errors: list[str], what: str, *, within: float = 3.0) -> str:
    """Wait for the server's permissions violation naming `what` (asynchronous -ERR), return it."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for e in errors:
            if DENIED in e.lower() and what.lower() in e.lower():
                return e
        await asyncio.sleep(0.02)
    raise AssertionError(f"no permissions violation for {what!r}; errors seen: {errors}")


async def request_until(nc: nats.NATS, subject: str, data: bytes, *, within: float = 5.0):
    """A request, retried while nobody answers yet: in a cluster a new subscription's interest reaches
    the other nodes a moment after the subscriber's flush."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await nc.request(subject, data, timeout=2)
        except nats.errors.NoRespondersError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def stored_on(js, stream: str, subject: str) -> int:
    """The last sequence stored on `subject` (0 when none), read with admin rights."""
    try:
        return (await js.get_msg(stream, subject=subject)).seq
    except nats.js.errors.NotFoundError:
        return 0


# ------------------------------------------------------------------------------- the shipped files


def test_shipped_node_configs_are_valid_with_the_example_environment():
    env = dict(os.environ, **read_env(DEPLOY / "nats.env.example"))
    for i in (1, 2, 3):
        done = subprocess.run(
            [find_binary(), "-t", "-c", str(DEPLOY / f"nats-{i}.conf")], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr
    # A missing secret is fatal: nats-server refuses to start rather than run with an empty password.
    env.pop("HARU_NATS_PASSWORD_ROUTER")
    done = subprocess.run(
        [find_binary(), "-t", "-c", str(DEPLOY / "nats-1.conf")], env=env, capture_output=True, text=True
    )
    assert done.returncode != 0 and "HARU_NATS_PASSWORD_ROUTER" in done.stdout + done.stderr


def test_accounts_file_is_what_gen_users_writes_for_the_example_fleet(tmp_path):
    out = tmp_path / "accounts.conf"
    env_out = tmp_path / "nats.env.example"
    subprocess.run(
        [sys.executable, str(DEPLOY / "gen_users.py"), *GEN_ARGS, "-o", str(out), "--env-example", str(env_out)],
        cwd=REPO,
        check=True,
    )
    assert out.read_text() == (DEPLOY / "accounts.conf").read_text(), (
        "regenerate deploy/nats/accounts.conf with gen_users.py"
    )
    assert env_out.read_text() == (DEPLOY / "nats.env.example").read_text()
    # A new domain gets its own user with its own subjects only.
    more = subprocess.run(
        [sys.executable, str(DEPLOY / "gen_users.py"), "--agent", "lab:gpu-9"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert '"agent.lab.gpu-9"' in more and "$HARU_NATS_PASSWORD_AGENT_LAB_GPU_9" in more
    assert '"haru.evt.lab.gpu-9.model.*"' in more and '"haru.cmd.lab.gpu-9.>"' in more


async def test_the_root_single_node_config_runs_haru(tmp_path):
    """nats.conf at the repository root, for `haru up --nats-url` users: loopback, JetStream, R1 log."""
    port, http_port = lasting_port(), lasting_port()
    text = (REPO / "nats.conf").read_text()
    text = rewrite(text, "listen: 127.0.0.1:4222", f"listen: 127.0.0.1:{port}")
    text = rewrite(text, "http: 127.0.0.1:8222", f"http: 127.0.0.1:{http_port}")
    text = rewrite(text, 'store_dir: "./.haru-nats"', f"store_dir: {json.dumps(str(tmp_path / 'js'))}")
    (tmp_path / "nats.conf").write_text(text)
    with open(tmp_path / "log", "wb") as log:
        proc = subprocess.Popen(
            [find_binary(), "-c", str(tmp_path / "nats.conf")], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        node = Node(0, tmp_path)
        node.port, node.proc = port, proc
        node.wait_ready(time.monotonic() + 15)
        node.http_port = http_port
        assert node.monitor("/varz")["jetstream"]["config"].get("sync_always") is True  # fsync per write
        async with EventLog.connect([f"nats://127.0.0.1:{port}"], writer="test") as log:
            await log.ensure()
            subject = subjects.agent(FLEET, "a")
            assert await log.append(subject, AgentStarted(at=now(), domain="a"), expect=0) == 1
            assert (await log.js.stream_info(subjects.EVENTS_STREAM)).config.num_replicas == 1
            assert log.nc.max_payload == 4 * 1024 * 1024
    finally:
        proc.terminate()
        proc.wait(10)


def test_example_agent_configs_load_and_have_their_nats_users():
    from haru.agents.config import load_config, slots_from_host_entry

    accounts = (DEPLOY / "accounts.conf").read_text()
    configs = sorted((REPO / "deploy" / "agents").glob("*.json"))
    assert {p.name for p in configs} >= {"vllm-host.json", "llama-server-host.json"}
    for path in configs:
        config = load_config(path)
        user = f"agent.{config.fleet}.{config.domain}"
        assert f'user: "{user}"' in accounts, f"{path.name}: no NATS user {user}; add it with gen_users.py"
        assert all(url.startswith(f"nats://{user}:") for url in config.servers()), path.name
        if config.host is not None:
            slots = slots_from_host_entry(config.fleet, config.domain, config.host, config.policy)
            assert slots.admitted_models and not slots.not_admitted, (path.name, slots.not_admitted)
    runtimes = {
        m["runtime"]
        for m in json.loads((REPO / "deploy/agents/llama-server-host.json").read_text())["host"]["slots"][0]["models"]
    }
    assert runtimes == {"llama_server"}


def test_systemd_units_verify_and_point_at_shipped_examples():
    units = sorted((REPO / "deploy" / "systemd").glob("*.service"))
    names = {u.name for u in units}
    assert {"haru-agent.service", "haru-control-plane.service", "nats-server@.service"} <= names
    for unit in units:
        text = unit.read_text()
        lines = [line.strip() for line in text.splitlines()]
        assert "NoNewPrivileges=yes" in lines and "ProtectSystem=strict" in lines, unit.name
        for line in lines:
            if line.startswith("EnvironmentFile=/etc/haru/"):
                name = line.rsplit("/", 1)[1]
                shipped = [
                    REPO / "deploy/systemd" / f"{Path(name).stem}.env.example",
                    DEPLOY / f"{Path(name).stem}.env.example",
                ]
                assert any(p.exists() for p in shipped), f"{unit.name}: no example for {name}"
    agent = (REPO / "deploy/systemd/haru-agent.service").read_text().splitlines()
    # stop = SIGINT (unload, recorded); reload = SIGTERM to the agent alone, which leaves its runtimes
    # serving for the next agent (issue 14) that Restart=always starts (tests/integration/test_agent_systemd.py)
    assert "KillMode=process" in agent and "KillSignal=SIGINT" in agent and "Restart=always" in agent
    assert "ExecReload=/bin/kill -TERM $MAINPID" in agent
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", *map(str, units)], capture_output=True, text=True)
    problems = [
        line
        for line in (done.stdout + done.stderr).splitlines()
        if line.strip() and "is not executable" not in line and "No such file" not in line
    ]
    assert not problems, problems


# --------------------------------------------------------------------------- cluster and streams


async def test_three_nodes_form_a_cluster_and_the_streams_are_r3(cluster, admin):
    names = {n.name for n in cluster.nodes}
    for node in cluster.nodes:
        routed = {r.get("remote_name") or r.get("remote_id") for r in node.monitor("/routez")["routes"]}
        assert names - {node.name} <= routed, (node.name, routed)
        # every write fsynced before it is acknowledged: nats-server's default (2 min) loses acknowledged
        # events when all three nodes lose power (tests/integration/test_power_loss.py)
        assert node.monitor("/varz")["jetstream"]["config"].get("sync_always") is True, node.name
    deadline = time.monotonic() + 15
    for stream in STREAMS:
        while True:
            info = await admin.js.stream_info(stream)
            peers = info.cluster.replicas or []
            if info.cluster.leader and len(peers) == 2 and all(p.current for p in peers):
                break
            assert time.monotonic() < deadline, f"{stream} replicas never caught up: {info.cluster}"
            await asyncio.sleep(0.1)
        assert info.config.num_replicas == 3
        assert {info.cluster.leader, *(p.name for p in peers)} == names
    events = await admin.js.stream_info(subjects.EVENTS_STREAM)
    assert events.config.deny_delete and events.config.deny_purge


async def test_no_anonymous_or_wrong_password_clients(cluster):
    with pytest.raises((nats.errors.Error, OSError)):
        nc = await cluster.raw(None)
        await nc.close()
    bad = [u.replace(cluster.password("admin"), "wrong") for u in cluster.urls("admin")]
    with pytest.raises((nats.errors.Error, OSError)):
        nc = await nats.connect(servers=bad, connect_timeout=2, allow_reconnect=False)
        await nc.close()


# --------------------------------------------------------------------------------------- agents


async def test_an_agent_writes_only_its_own_domain(cluster, admin):
    decl = subjects.decl(FLEET)
    await admin.append(
        decl, FleetDeclared(at=now(), fleet=FLEET, policy=Policy()), expect=await admin.last_seq_of(decl)
    )

    # What an agent needs works: read the fleet's declarations, append its own events with expected sequences.
    async with cluster.log("agent.default.a", "agent:default/a") as agent:
        assert [r.subject for r in await agent.history(decl)][-1] == decl
        assert (await agent.last(decl)) is not None
        own = subjects.agent(FLEET, "a")
        seq = await agent.append(own, AgentStarted(at=now(), domain="a"), expect=await agent.last_seq_of(own))
        model = subjects.model(FLEET, "a", "qwen3.6:27b")
        await agent.append(
            model, ModelLoading(at=now(), domain="a", model="qwen3.6:27b"), expect=await agent.last_seq_of(model)
        )
        assert (await agent.last(own)).seq == seq
        # A stale expectation is a Conflict, not a permission problem.
        with pytest.raises(Conflict):
            await agent.append(own, AgentStarted(at=now(), domain="a"), expect=0)

    # Another domain's events through JetStream: the server drops the publish (no ack ever comes).
    errors: list[str] = []
    nc = await cluster.raw("agent.default.a", errors)
    try:
        other = subjects.model(FLEET, "b", "x")
        js = nc.jetstream(timeout=1.0)
        with pytest.raises(nats.errors.TimeoutError):
            await js.publish(other, b"{}", headers={"Nats-Expected-Last-Subject-Sequence": "0"})
        await violation(errors, f'"{other}"')
        assert await stored_on(admin.js, subjects.EVENTS_STREAM, other) == 0

        # Nor the promoter's subjects (even its own domain's liveness), the fleet's, or another fleet's.
        forbidden = [
            subjects.agent(FLEET, "b"),
            subjects.liveness(FLEET, "a"),
            subjects.route(FLEET),
            subjects.op(FLEET),
            subjects.decl(FLEET),
            subjects.agent("other", "a"),
            subjects.heartbeat(FLEET, "b"),
            subjects.intent(FLEET),
            "$KV.haru_views.fleet.default",
        ]
        before = {
            s: await stored_on(admin.js, subjects.EVENTS_STREAM, s) for s in forbidden if s.startswith("haru.evt.")
        }
        for subject in forbidden:
            await nc.publish(subject, b"{}")
        await nc.flush()
        for subject in forbidden:
            await violation(errors, f'"{subject}"')
        after = {s: await stored_on(admin.js, subjects.EVENTS_STREAM, s) for s in before}
        assert after == before
        # The servers name the user and the subject in their log (what an operator greps for).
        assert any(other in line for line in server_violations(cluster, "agent.default.a"))

        # The duplicate-agent check at start is allowed: ask its own status (nobody answers here: "no
        # responders", where a refused publish would time out) and hear its own heartbeat.
        with pytest.raises(nats.errors.NoRespondersError):
            await nc.request(subjects.command(FLEET, "a", "status"), b"{}", timeout=2)
        hb = await nc.subscribe(subjects.heartbeat(FLEET, "a"))
        await nc.publish(subjects.heartbeat(FLEET, "a"), b'{"pid": 1}')
        assert (await hb.next_msg(timeout=2)).data == b'{"pid": 1}'
        own = ("haru.cmd.default.a", 'haru.hb.default.a"')
        assert not [e for e in errors if any(o in e for o in own)], errors
    finally:
        await nc.close()


async def test_every_reader_of_the_log_can_follow_it(cluster, admin):
    """Every role that reads the event log may create the ordered consumer a follower reads it with
    (haru/log/js_replay.py), and gets each record once, in order."""
    own = subjects.agent(FLEET, "a")
    for _ in range(3):
        await admin.append(own, AgentStarted(at=now(), domain="a"), expect=await admin.last_seq_of(own))
    last = await admin.last_seq()
    for user in ("agent.default.a", "promoter", "projector", "gateway", "control", "operator", "sink"):
        async with cluster.log(user) as log:
            seen: list[int] = []
            follower = asyncio.create_task(log.replay(lambda rec, seen=seen: seen.append(rec.seq), follow=True))
            try:
                async with asyncio.timeout(20):
                    while len(seen) < last:
                        await asyncio.sleep(0.02)
            finally:
                follower.cancel()
                await asyncio.gather(follower, return_exceptions=True)
            assert seen == list(range(1, last + 1)), user


async def test_an_agent_cannot_delete_purge_or_update_the_log(cluster, admin):
    own = subjects.agent(FLEET, "b")
    await admin.append(own, AgentStarted(at=now(), domain="b"), expect=await admin.last_seq_of(own))
    before = {s: (await admin.js.stream_info(s)).state.messages for s in STREAMS}

    config = (await admin.js.stream_info(subjects.EVENTS_STREAM)).config

    async def try_everything(user: str) -> None:
        errors: list[str] = []
        nc = await cluster.raw(user, errors)
        try:
            js = nc.jetstream(timeout=1.0)
            attempts = {
                "$JS.API.STREAM.DELETE.HARU_EVENTS": js.delete_stream(subjects.EVENTS_STREAM),
                "$JS.API.STREAM.PURGE.HARU_EVENTS": js.purge_stream(subjects.EVENTS_STREAM),
                "$JS.API.STREAM.MSG.DELETE.HARU_EVENTS": js.delete_msg(subjects.EVENTS_STREAM, 1),
                "$JS.API.STREAM.UPDATE.HARU_EVENTS": js.update_stream(config),
                "$JS.API.STREAM.DELETE.HARU_ROUTE": js.delete_stream(subjects.ROUTE_STREAM),
                "$JS.API.STREAM.PURGE.KV_haru_views": js.purge_stream("KV_" + subjects.VIEWS_BUCKET),
                "$JS.API.CONSUMER.DELETE.HARU_EVENTS": js.delete_consumer(subjects.EVENTS_STREAM, "anyone"),
            }
            outcomes = await asyncio.gather(*attempts.values(), return_exceptions=True)
            for api_subject, outcome in zip(attempts, outcomes, strict=True):
                assert isinstance(outcome, nats.errors.TimeoutError), (user, api_subject, outcome)
                await violation(errors, api_subject)
        finally:
            await nc.close()

    await asyncio.gather(
        *(
            try_everything(u)
            for u in ("agent.default.a", "router", "promoter", "projector", "gateway", "control", "operator")
        )
    )

    after = {s: (await admin.js.stream_info(s)).state.messages for s in STREAMS}
    assert after == before and await stored_on(admin.js, subjects.EVENTS_STREAM, own) > 0
    # Contrast: the same request from admin reaches JetStream and gets an answer (refused by the stream's
    # own deny_purge), so the silence above was the permissions, not a dead server.
    with pytest.raises(nats.js.errors.APIError):
        await admin.js.purge_stream(subjects.EVENTS_STREAM)


async def test_an_agent_reads_its_fleets_view_as_the_adapter_watcher_does_but_cannot_write_it(cluster, admin):
    """The adapter watcher (agents/adapters.py) follows its fleet's view in haru_views: an agent user may
    watch and get it (a view of its own fleet, edge, no other test writes) and put, delete or purge nothing."""
    key = subjects.view_key("edge")
    current = await admin.get_view(key)
    first = await admin.put_view(key, b"view 1", last=0 if current is None else current[1])

    async with cluster.log("agent.edge.box-1") as agent:
        assert await agent.get_view(key) == (b"view 1", first)
        seen: list[tuple[bytes | None, int]] = []

        async def watch() -> None:
            async for got_key, value, rev in agent.watch_views(key):
                assert got_key == key
                seen.append((value, rev))

        task = asyncio.create_task(watch())
        try:
            deadline = time.monotonic() + 10
            while seen != [(b"view 1", first)]:
                assert time.monotonic() < deadline, seen
                await asyncio.sleep(0.05)
            second = await admin.put_view(key, b"view 2", last=first)
            while seen[-1:] != [(b"view 2", second)]:  # every change, as it happens
                assert time.monotonic() < deadline, seen
                await asyncio.sleep(0.05)
        finally:
            await cancel_and_wait(task)

    errors: list[str] = []
    nc = await cluster.raw("agent.edge.box-1", errors)
    try:
        kv = await nc.jetstream(timeout=1.0).key_value(subjects.VIEWS_BUCKET)
        attempts = {
            "put": kv.put("fleet.edge", b"forged"),
            "update": kv.update("fleet.edge", b"forged", last=second),
            "delete": kv.delete("fleet.edge"),
            "purge": kv.purge("fleet.edge"),
            "another key": kv.create("fleet.mine", b"forged"),
        }
        outcomes = await asyncio.gather(*attempts.values(), return_exceptions=True)
        for what, outcome in zip(attempts, outcomes, strict=True):
            assert isinstance(outcome, nats.errors.TimeoutError), (what, outcome)
        await violation(errors, "$KV.haru_views.fleet.edge")
        await violation(errors, "$KV.haru_views.fleet.mine")
    finally:
        await nc.close()
    assert await admin.get_view(key) == (b"view 2", second)
    assert await admin.get_view("fleet.mine") is None


async def test_an_agent_answers_only_its_own_commands(cluster, admin):
    errors_a: list[str] = []
    agent_a = await cluster.raw("agent.default.a", errors_a)
    promoter = await cluster.raw("promoter")
    try:

        async def status(req) -> None:
            await req.respond(b'{"ok": true, "detail": "a"}')

        svc = await add_service(agent_a, name="haru-agent", version="0.0.0", description="default/a")
        await svc.add_endpoint(name="status", subject=subjects.command(FLEET, "a", "status"), handler=status)
        reply = await request_until(promoter, subjects.command(FLEET, "a", "status"), b"{}")
        assert json.loads(reply.data) == {"ok": True, "detail": "a"}
        # nats.micro discovery works across the cluster with these permissions.
        ping = await request_until(promoter, "$SRV.PING.haru-agent", b"")
        assert json.loads(ping.data)["name"] == "haru-agent"

        # Domain b's commands: the subscription is refused, so nobody answers them.
        await agent_a.subscribe(subjects.commands(FLEET, "b") + ".>", cb=status)
        await agent_a.flush()
        await violation(errors_a, "haru.cmd.default.b.>")
        with pytest.raises(nats.errors.NoRespondersError):
            await promoter.request(subjects.command(FLEET, "b", "status"), b"{}", timeout=2)
        # Nor may an agent send commands.
        await agent_a.publish(subjects.command(FLEET, "b", "sleep"), b"{}")
        await violation(errors_a, "haru.cmd.default.b.sleep")
        await svc.stop()
    finally:
        await agent_a.close()
        await promoter.close()


# ------------------------------------------------------------------------------ the control plane


@pytest.mark.parametrize("shape", ["together", "apart"])
async def test_the_control_plane_and_the_cli_run_under_their_own_users(cluster, admin, tmp_path, shape):
    """The control plane as haru-control-plane.service runs it (`haru up --nats-url` as `control`) or as
    the three separate units (`haru projector`, `haru promoter`, `haru gateway`, each as its own user),
    with `haru apply` and `haru status` as `operator`: the view and the route intent appear and the
    servers log no permissions violation for any of these users."""
    fleet = f"ctl-{shape}"
    layout = json.loads((REPO / "deploy/examples/demo-fleet.json").read_text())
    layout["fleet"] = fleet
    (tmp_path / "layout.json").write_text(json.dumps(layout))
    base = {k: v for k, v in os.environ.items() if k not in ("HARU_API_TOKEN", "HARU_NATS_URL")}
    base["HARU_HOME"] = str(tmp_path / "home")

    def as_user(user: str) -> dict[str, str]:
        return dict(base, HARU_NATS_URL=",".join(cluster.urls(user)))

    mark = log_marks(cluster)  # other tests provoke violations on purpose in this cluster
    port = lasting_port()
    if shape == "together":
        commands = {
            "control": [
                "up",
                "--nats-url",
                as_user("control")["HARU_NATS_URL"],
                "--port",
                str(port),
                "--log-level",
                "info",
            ]
        }
    else:
        commands = {"projector": ["projector"], "promoter": ["promoter"], "gateway": ["gateway", "--port", str(port)]}
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def logs() -> str:
        return "\n".join(f"--- {u}\n" + (tmp_path / f"{u}.log").read_text(errors="replace")[-2000:] for u in procs)

    try:
        for user, args in commands.items():
            with open(tmp_path / f"{user}.log", "wb") as out:
                procs[user] = subprocess.Popen(
                    [sys.executable, "-m", "haru.cli", *args],
                    cwd=REPO,
                    env=as_user(user),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        deadline = time.monotonic() + 40

        async def gateway_shows(path: str, needle: str) -> None:
            while True:
                for user, proc in procs.items():
                    assert proc.poll() is None, f"{user} exited\n" + logs()
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                        if needle in r.read().decode():
                            return
                except OSError:
                    pass
                assert time.monotonic() < deadline, f"the gateway never showed {needle!r} at {path}\n" + logs()
                await asyncio.sleep(0.2)

        await gateway_shows("/healthz", "")
        done = await asyncio.to_thread(haru_cli, ["apply", "-f", str(tmp_path / "layout.json")], as_user("operator"))
        assert done.returncode == 0, done.stdout + done.stderr

        # The projector wrote the view and the route intent; the gateway serves the view.
        async with cluster.log("router", "router:test") as router:
            while (await router.last_intent(fleet)) is None:
                assert time.monotonic() < deadline, "no route intent\n" + logs()
                await asyncio.sleep(0.2)
        await gateway_shows("/v1/fleets", f'"{fleet}"')
        status = await asyncio.to_thread(haru_cli, ["status", "--fleet", fleet, "--json"], as_user("operator"))
        assert status.returncode == 0 and f'"{fleet}"' in status.stdout, status.stdout + status.stderr
        for user in [*commands, "operator"]:
            assert server_violations(cluster, user, mark) == [], user
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()


def log_marks(c: Cluster) -> dict[int, int]:
    """How far each node's log goes now: pass to `server_violations` to see only what follows."""
    return {n.index: (n.dir / "nats-server.log").stat().st_size for n in c.nodes}


def server_violations(c: Cluster, user: str, since: dict[int, int] | None = None) -> list[str]:
    """What the nodes logged about `user`'s refused publishes and subscriptions (after `since`)."""
    out = []
    for node in c.nodes:
        with open(node.dir / "nats-server.log", "rb") as f:
            f.seek((since or {}).get(node.index, 0))
            text = f.read().decode(errors="replace")
        out += [line for line in text.splitlines() if "Violation" in line and f'user:{user}"' in line]
    return out


async def test_a_real_agent_runs_under_its_domain_user(tmp_path):
    """`haru agent` (sim GPU, sim vLLM) as agent.default.b on a fresh cluster: it claims its domain,
    heartbeats, reports GPU and residency, answers the promoter's commands, stops cleanly, and the
    servers log not one permissions violation for its user."""
    from haru.agents.sim.gpu_state import SimGpuState

    c = start_cluster(tmp_path / "agent-cluster")
    agent_proc: subprocess.Popen[bytes] | None = None
    try:
        await ensure_r3(c)
        # The demo layout, runnable here (this interpreter, free ports), applied as `operator`.
        doc = json.loads((REPO / "deploy/examples/demo-fleet.json").read_text())
        for domain in doc["domains"]:
            domain["serving_url"] = f"http://127.0.0.1:{lasting_port()}"
            for slot in domain["slots"]:
                if slot.get("kind") == "training":
                    slot["command"] = [sys.executable, *slot["command"][1:]]
                    slot["checkpoint_dir"] = str(tmp_path / "ckpt" / domain["name"])
                for model in slot.get("models", []):
                    model["binary"] = [sys.executable, *model["binary"][1:]]
                    model["port"] = lasting_port()
        (tmp_path / "layout.json").write_text(json.dumps(doc))
        operator = dict(os.environ, HARU_NATS_URL=",".join(c.urls("operator")))
        done = await asyncio.to_thread(haru_cli, ["apply", "-f", str(tmp_path / "layout.json")], operator)
        assert done.returncode == 0, done.stdout + done.stderr

        sim_dir = tmp_path / "sim" / "b"
        sim_dir.mkdir(parents=True)
        gpu = next(d for d in doc["domains"] if d["name"] == "b")["gpus"][0]
        state = SimGpuState(sim_dir, 0)
        state.ensure(24 * 1024**3, gpu["name"])
        state.set_present(True)
        config = {
            "fleet": FLEET,
            "domain": "b",
            "nats_url": c.urls("agent.default.b"),
            "gpus": "sim",
            "sim_dir": str(sim_dir),
            "state_dir": str(tmp_path / "state-b"),
            "serving": {"host": "127.0.0.1", "port": lasting_port()},
        }
        (tmp_path / "agent.json").write_text(json.dumps(config))
        env = dict(os.environ, HARU_SIM_DIR=str(sim_dir), HARU_SIM_DOMAIN="b", HARU_SIM_LOAD_MS="200")
        with open(tmp_path / "agent.log", "wb") as out:
            agent_proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "haru.cli",
                    "agent",
                    "--config",
                    str(tmp_path / "agent.json"),
                    "--log-format",
                    "json",
                ],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

        def agent_log() -> str:
            return (tmp_path / "agent.log").read_text(errors="replace")[-3000:]

        async with c.log("admin") as admin:
            promoter = await c.raw("promoter")
            try:
                beats = await promoter.subscribe(subjects.heartbeats(FLEET))
                deadline = time.monotonic() + 40
                # It claims its domain (agent_started, an append with an expected sequence) ...
                while (await keep_trying(lambda: admin.last(subjects.agent(FLEET, "b")))) is None:
                    assert agent_proc.poll() is None, agent_log()
                    assert time.monotonic() < deadline, "no agent_started: " + agent_log()
                    await asyncio.sleep(0.2)
                # ... heartbeats on its own subject ...
                beat = await beats.next_msg(timeout=10)
                assert beat.subject == subjects.heartbeat(FLEET, "b")
                # ... answers the promoter's commands ...
                reply = reply_decoder.decode(
                    (await request_until(promoter, subjects.command(FLEET, "b", "status"), b"{}")).data
                )
                assert reply.ok, reply
                # ... and reports its GPU and its models' residency.
                model = subjects.model(FLEET, "b", "qwen3-0.6b")
                while (await admin.last(subjects.gpu(FLEET, "b", 0))) is None or (await admin.last(model)) is None:
                    assert agent_proc.poll() is None, agent_log()
                    assert time.monotonic() < deadline, "no gpu/model events: " + agent_log()
                    await asyncio.sleep(0.2)
            finally:
                await promoter.close()

            agent_proc.send_signal(signal.SIGINT)  # stopping for good: it unloads (SIGTERM would keep its runtimes)
            assert await asyncio.to_thread(agent_proc.wait, 60) == 0, agent_log()
            last = await admin.last(subjects.agent(FLEET, "b"))
            assert last is not None and isinstance(last.event, AgentStopping), last
        assert server_violations(c, "agent.default.b") == []
    finally:
        if agent_proc is not None and agent_proc.poll() is None:
            os.killpg(agent_proc.pid, 9)
            agent_proc.wait()
        c.stop()


# --------------------------------------------------------------------------------------- routers


def intent_body(revision: int, active: str) -> bytes:
    return view_encoder.encode(RouteIntent(fleet=FLEET, revision=revision, active=Target(domain=active)))


async def test_a_router_can_only_read_route_intents(cluster, admin):
    async with cluster.log("projector", "projector:test") as projector:
        last = await projector.last_intent(FLEET)
        first_seq = await projector.publish_intent(FLEET, intent_body(1, "a"), expect=0 if last is None else last[1])

    errors: list[str] = []
    router = await cluster.raw("router", errors)
    try:
        live = asyncio.Queue()

        async def on_intent(msg) -> None:
            live.put_nowait(msg.data)

        await router.subscribe(subjects.intent(FLEET), cb=on_intent)
        await router.subscribe("haru.evt.>", cb=on_intent)  # refused
        await router.flush()
        await violation(errors, '"haru.evt.>"')

        # Live intents. The router's interest reaches the projector's node a moment after its flush, so
        # publish until one arrives (bounded); it must be the last one published, and nothing else.
        second_seq, second, received = first_seq, b"", None
        async with cluster.log("projector", "projector:test") as projector:
            for n in range(2, 30):
                second = intent_body(n, "b")
                second_seq = await projector.publish_intent(FLEET, second, expect=second_seq)
                try:
                    received = await asyncio.wait_for(live.get(), 0.3)
                    break
                except TimeoutError:
                    continue
        assert received == second
        # By now the router's interest is known cluster-wide: an event must still not reach it.
        op = subjects.op(FLEET)
        request = PromotionRequested(at=now(), op_id="op-router-test", target="b")
        await admin.append(op, request, expect=await admin.last_seq_of(op))
        await asyncio.sleep(0.3)
        assert live.empty(), "a router received something besides route intents"

        # The last intent on start, through JetStream, with the router's own credentials.
        async with cluster.log("router", "router:test") as log:
            assert await log.last_intent(FLEET) == (second, second_seq)
            watch = log.watch_intents(FLEET)
            assert await asyncio.wait_for(anext(watch), 5) == (FLEET, second, second_seq)
            await watch.aclose()

        # Haru's own router tool works with these credentials.
        env = dict(os.environ, HARU_NATS_URL=",".join(cluster.urls("router")))
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "haru.cli", "route", "--fleet", FLEET, "--json"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        shown = json.loads(done.stdout)
        assert shown["active"]["domain"] == "b" and shown["revision"] == json.loads(second)["revision"]

        # Nothing else: no publishing (core or JetStream), no events, no views.
        js = router.jetstream(timeout=0.5)
        with pytest.raises(nats.errors.TimeoutError):
            await js.publish(subjects.intent(FLEET), b'{"active": "evil"}')
        await violation(errors, f'"{subjects.intent(FLEET)}"')
        for subject in (
            subjects.op(FLEET),
            subjects.route(FLEET),
            subjects.command(FLEET, "a", "sleep"),
            "haru.hb.default.a",
        ):
            await router.publish(subject, b"{}")
        await router.flush()
        for subject in (subjects.op(FLEET), subjects.route(FLEET), "haru.cmd.default.a.sleep", "haru.hb.default.a"):
            await violation(errors, f'"{subject}"')
        with pytest.raises(nats.errors.TimeoutError):
            await js.get_msg(subjects.EVENTS_STREAM, subject=op)
        await violation(errors, "$JS.API.STREAM.MSG.GET.HARU_EVENTS")
        # One event it may read: its fleet's last route_moved, by a direct get naming that subject (a watcher
        # checks an intent against it after a lost link); the same get of any other subject is refused.
        route = subjects.route(FLEET)
        await admin.append(route, RouteMoved(at=now(), active="b"), expect=await admin.last_seq_of(route))
        tip = await js.get_msg(subjects.EVENTS_STREAM, subject=subjects.route(FLEET), direct=True)
        assert tip.subject == subjects.route(FLEET) and tip.seq == await admin.last_seq_of(subjects.route(FLEET))
        with pytest.raises(nats.errors.TimeoutError):
            await js.get_msg(subjects.EVENTS_STREAM, subject=op, direct=True)
        await violation(errors, f"$JS.API.DIRECT.GET.HARU_EVENTS.{op}")
        with pytest.raises(nats.errors.TimeoutError):
            await js.key_value(subjects.VIEWS_BUCKET)
        await violation(errors, "$JS.API.STREAM.INFO.KV_haru_views")
        assert (await admin.js.get_msg(subjects.ROUTE_STREAM, subject=subjects.intent(FLEET))).seq == second_seq
    finally:
        await router.close()


async def test_a_route_follower_reads_its_fleets_route_and_reports_only_as_itself(cluster, admin):
    from haru.core.router_acks import report_decoder
    from haru.routers import Command, Follower

    async with cluster.log("projector", "projector:test") as projector:
        last = await projector.last_intent(FLEET)
        await projector.publish_intent(FLEET, intent_body(7, "a"), expect=0 if last is None else last[1])
    errors: list[str] = []
    promoter = await cluster.raw("promoter")
    follower_nc = await cluster.raw("router.default.edge-1", errors)
    try:
        heard: asyncio.Queue = asyncio.Queue()

        async def on_report(msg) -> None:
            heard.put_nowait((msg.subject, msg.data))

        await promoter.subscribe("haru.router.>", cb=on_report)
        await promoter.flush()
        # The follower, with its own user: it follows the route and its reports reach the promoter.
        async with cluster.log("router.default.edge-1", "router:edge-1") as log:
            task = asyncio.create_task(Follower(log, FLEET, "edge-1", Command("true"), interval_s=0.2).run())
            try:
                while True:
                    subject, data = await asyncio.wait_for(heard.get(), 10)
                    report = report_decoder.decode(data)
                    if report.revision == 7:
                        break
                assert subject == subjects.router_report(FLEET, "edge-1")
            finally:
                await cancel_and_wait(task)
        # It cannot report for another router, nor for another fleet, nor read another fleet's route.
        for subject in ("haru.router.default.edge-2", "haru.router.edge.edge-1", subjects.route(FLEET)):
            await follower_nc.publish(subject, b"{}")
        await follower_nc.subscribe("haru.route.edge", cb=on_report)
        await follower_nc.flush()
        for what in ('"haru.router.default.edge-2"', '"haru.router.edge.edge-1"', '"haru.route.edge"'):
            await violation(errors, what)
    finally:
        await follower_nc.close()
        await promoter.close()


# ------------------------------------------------------------------------------ losing a node


async def keep_trying(call, *, within: float = 40.0, retry: tuple[type[Exception], ...] = (LogUnavailable,)):
    """What a promoter or projector does with LogUnavailable: try again, bounded. EventLog.append
    already retries 503s for up to 10 s; when the killed node led both the JetStream meta group and
    the stream, electing both can take longer on a loaded 2-core machine. Retrying is safe: the
    retried append carries the same Nats-Msg-Id and expected sequence."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await call()
        except retry:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.25)


async def test_the_promoter_keeps_the_streams_leaders_on_the_named_server(cluster, admin):
    """`haru promoter --stream-leaders` under the promoter's own user: each failover stream's leader is
    handed to the named server by a planned step-down, then left there; a name that is no replica moves
    nothing."""
    from haru.log.leaders import STREAMS, LeaderKeeper

    async with cluster.log("promoter", "promoter:test") as log:

        async def leaders() -> dict[str, str]:
            out = {}
            for stream in STREAMS:
                info = await log.js.stream_info(stream)
                out[stream] = info.cluster.leader if info.cluster else ""
            return out

        before = await leaders()
        target = next(n for n in ("haru-nats-1", "haru-nats-2", "haru-nats-3") if n != before[subjects.EVENTS_STREAM])
        keeper = LeaderKeeper(log.nc, [target], interval_s=0.5)
        deadline = time.monotonic() + 45
        while (now_leaders := await leaders()) != dict.fromkeys(STREAMS, target):
            assert time.monotonic() < deadline, f"leaders still {now_leaders} (wanted {target}); before {before}"
            await keeper.check()  # a replica not caught up yet is not handed the lead: the next pass
            await asyncio.sleep(0.5)
        assert keeper.moves >= 1
        assert await keeper.check() == []  # in place: nothing to do
        assert await LeaderKeeper(log.nc, ["no-such-server"]).check() == []
        assert await leaders() == dict.fromkeys(STREAMS, target)


async def test_killing_the_stream_leader_keeps_appends_and_failover_working(tmp_path):
    c = start_cluster(tmp_path / "kill")
    try:
        await ensure_r3(c)
        route = subjects.route(FLEET)
        async with (
            c.log("admin") as admin,
            c.log("promoter", "promoter:1") as promoter,
            c.log("agent.default.b", "agent:default/b") as agent,
            c.log("projector", "projector:1") as projector,
        ):
            first = await promoter.append(route, RouteMoved(at=now(), active="a"), expect=0)
            rev = await projector.put_view(subjects.view_key(FLEET), b'{"active": "a"}', last=0)
            leader = (await admin.js.stream_info(subjects.EVENTS_STREAM)).cluster.leader
            victim = next(n for n in c.nodes if n.name == leader)
            victim.kill()

            # The promoter flips the pointer with an expected sequence: JetStream answers 503 while it
            # elects a new leader (docs/design.md: 3-6 s).
            flip = RouteMoved(at=now(), active="b", previous="a", op_id="op-1")
            second = await keep_trying(lambda: promoter.append(route, flip, expect=first))
            assert second > first
            # A second promoter deciding from the old pointer still loses the race after the failover.
            with pytest.raises(Conflict) as lost:
                await keep_trying(lambda: promoter.append(route, RouteMoved(at=now(), active="a"), expect=first))
            assert lost.value.current == second
            # Agents and projectors keep writing too (put_view does not retry 503s itself; the KV
            # stream is its own raft group and may still be electing).
            model = subjects.model(FLEET, "b", "qwen3.6:27b")
            loading = ModelLoading(at=now(), domain="b", model="qwen3.6:27b")
            await keep_trying(lambda: agent.append(model, loading, expect=0))
            await keep_trying(lambda: projector.put_view(subjects.view_key(FLEET), b'{"active": "b"}', last=rev))

            history = [r.event for r in await keep_trying(lambda: admin.history(route))]
            assert [e.active for e in history] == ["a", "b"]
            # (test instrumentation, raw nats-py: the meta group may still be electing too)
            info = await keep_trying(lambda: admin.js.stream_info(subjects.EVENTS_STREAM), retry=(nats.errors.Error,))
            assert info.cluster.leader and info.cluster.leader != leader
            assert info.config.num_replicas == 3
    finally:
        c.stop()
