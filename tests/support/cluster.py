"""A three-node nats-server cluster started from the shipped deploy/nats files, with the generated secrets and
accounts, and `haru` run against it: the deployment tests and bench/scale.py share it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nats
import nats.errors
import nats.js.errors

from haru.core.errors import LogError, LogUnavailable
from haru.host.natsd import find_binary
from haru.log.eventlog import EventLog
from tests.support.ports import lasting_port

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "nats"


# How the shipped accounts.conf and nats.env.example were generated (their header says so too).
GEN_ARGS = [
    "deploy/examples/demo-fleet.json",
    "deploy/examples/hearth.json",
    "--agent",
    "edge:box-1",
    "--router",
    "default:edge-1",
]


def read_env(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            k, v = line.split("=", 1)
            out[k] = v
    return out


def generated_secrets(root: Path) -> dict[str, str]:
    """Fresh secrets from `gen_users.py --env-secrets`, as an operator makes them."""
    path = root / "nats.env"
    subprocess.run(
        [sys.executable, str(DEPLOY / "gen_users.py"), *GEN_ARGS, "-o", os.devnull, "--env-secrets", str(path)],
        cwd=REPO,
        check=True,
    )
    assert path.stat().st_mode & 0o077 == 0, "the secrets file must be private to its owner"
    env = read_env(path)
    assert env.keys() == read_env(DEPLOY / "nats.env.example").keys()
    return env


def rewrite(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"the shipped node config no longer has exactly one {old!r}; update this test"
    return text.replace(old, new)


class Node:
    def __init__(self, index: int, root: Path) -> None:
        self.index = index
        self.name = f"haru-nats-{index}"
        self.dir = root / f"node-{index}"
        self.port, self.http_port, self.cluster_port = lasting_port(), lasting_port(), lasting_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def config(self) -> Path:
        text = (DEPLOY / f"nats-{self.index}.conf").read_text()
        text = rewrite(text, "listen: 0.0.0.0:4222", f"listen: 127.0.0.1:{self.port}")
        text = rewrite(text, "http: 127.0.0.1:8222", f"http: 127.0.0.1:{self.http_port}")
        text = rewrite(text, "listen: 0.0.0.0:6222", f"listen: 127.0.0.1:{self.cluster_port}")
        text = rewrite(text, "store_dir: /var/lib/nats/jetstream", f"store_dir: {json.dumps(str(self.dir / 'js'))}")
        common = os.path.relpath(DEPLOY / "haru-common.conf", self.dir)
        text = rewrite(text, "include ./haru-common.conf", f"include {json.dumps(common)}")
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "nats.conf"
        path.write_text(text)
        return path

    def start(self, env: dict[str, str]) -> None:
        config = self.config()
        with open(self.dir / "nats-server.log", "ab") as log:
            self.proc = subprocess.Popen(
                [find_binary(), "-c", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited at start: {(self.dir / 'nats-server.log').read_text()[-2000:]}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.settimeout(0.5)
                    if s.recv(4).startswith(b"INFO"):
                        return
            except OSError:
                time.sleep(0.02)
        raise AssertionError(f"{self.name} did not listen in time")

    def monitor(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=2) as r:
            return json.loads(r.read())

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Cluster:
    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.passwords = generated_secrets(root)
        self.nodes = [Node(i, root) for i in (1, 2, 3)]
        self.envs: dict[int, dict[str, str]] = {}  # node index -> the environment it was started with

    def start(self) -> None:
        env = dict(os.environ, **self.passwords)
        for node in self.nodes:  # the routes, as the shipped environment file spells them, on loopback
            env[f"HARU_NATS_ROUTE_{node.index}"] = (
                f"nats-route://route:{self.passwords['HARU_NATS_ROUTE_PASSWORD']}@127.0.0.1:{node.cluster_port}"
            )
        for node in self.nodes:
            self.envs[node.index] = env
            node.start(env)
        deadline = time.monotonic() + 20
        for node in self.nodes:
            node.wait_ready(deadline)
        while time.monotonic() < deadline:  # every node routed to both others
            if all(n.monitor("/routez")["num_routes"] >= 2 for n in self.nodes):
                return
            time.sleep(0.05)
        raise AssertionError("the three nodes did not form a cluster within 20 s")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def password(self, user: str) -> str:
        return self.passwords["HARU_NATS_PASSWORD_" + user.upper().replace(".", "_").replace("-", "_")]

    def urls(self, user: str | None) -> list[str]:
        auth = "" if user is None else f"{user}:{self.password(user)}@"
        return [f"nats://{auth}127.0.0.1:{n.port}" for n in self.nodes if n.alive]

    def all_urls(self, user: str) -> list[str]:
        """Every node's URL, running or not (`urls` gives the running ones)."""
        return [f"nats://{user}:{self.password(user)}@127.0.0.1:{n.port}" for n in self.nodes]

    def log(self, user: str, writer: str | None = None):
        return EventLog.connect(self.urls(user), writer=writer or user)

    async def raw(self, user: str | None, errors: list[str] | None = None) -> nats.NATS:
        async def on_error(exc: Exception) -> None:
            if errors is not None:
                errors.append(str(exc))

        return await nats.connect(
            servers=self.urls(user),
            error_cb=on_error,
            connect_timeout=2,
            allow_reconnect=False,
            name=user or "anonymous",
        )


def start_cluster(root: Path, attempts: int = 3) -> Cluster:
    """Three nodes on free loopback ports. `lasting_port` only says a port was free a moment ago: when
    another process took one before the node bound it ("address already in use"), start again on
    fresh ports (bounded); any other failure is the test's."""
    for attempt in range(1, attempts + 1):
        cluster = Cluster(root / f"try-{attempt}" if attempt > 1 else root)
        try:
            cluster.start()
            return cluster
        except AssertionError as exc:
            cluster.stop()
            if "address already in use" not in str(exc) or attempt == attempts:
                raise
        except BaseException:
            cluster.stop()
            raise
    raise AssertionError("unreachable")


async def ensure_r3(c: Cluster) -> None:
    """Create the R3 streams as admin, waiting (bounded) for JetStream's meta leader on a fresh cluster."""
    deadline = time.monotonic() + 30
    async with c.log("admin") as log:
        while True:
            try:
                await log.ensure(replicas=3)
                return
            except (LogUnavailable, LogError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.25)


def haru_cli(args: list[str], env: dict[str, str], **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "haru.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        **kwargs,
    )
