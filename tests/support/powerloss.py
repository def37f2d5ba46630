"""Jepsen's faults on the shipped three-node cluster: each node's store on a lazy filesystem, its routes
through a TCP proxy that can cut them, and a load that keeps appending through the faults.

    async with FaultCluster(tmp_path) as fc:          # three nodes from deploy/nats, R3 streams made
        async with fc.log("admin") as log:
            load = Load(log, FLEET)                    # writers + a promotion in flight, forever
            await load.until(200)                      # 200 acknowledged appends
            fc.power_loss(2)                           # node 2: SIGKILL, then its unsynced writes dropped
            fc.partition(1, 3)                         # the routes between nodes 1 and 3 stop
            fc.restart(2)
            fc.heal(1, 3)
            await load.stop()
            lost = await load.lost()                   # acknowledged events the log no longer holds

The cluster is `tests.support.cluster.Cluster` (the shipped node configs, generated secrets), except that
node A reaches node B's route port through the proxy (`tests.support.delay_proxy`, pair `A-B`), so a
partition is a cut on the proxy: the bytes are held, nothing is closed, as on a downed link. Clients
connect to the nodes directly. bench/powerloss.py runs the same faults as rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

from haru.core import events as ev
from haru.core import subjects
from haru.core.errors import Conflict, LogError
from haru.core.receipts import Regression
from haru.log.eventlog import EventLog
from haru.log.receipts import check
from tests.support.cluster import REPO, Cluster
from tests.support.lazyfs import LazyFS
from tests.support.ports import lasting_port

WRITERS = 4


class FaultCluster:
    """The shipped cluster with lazy stores and cuttable routes (see the module docstring)."""

    def __init__(self, root: Path, *, sync_always: bool = True) -> None:
        self.root = root
        self.cluster = Cluster(root)
        self.nodes = self.cluster.nodes
        if not sync_always:  # nats-server's default fsync interval, for the side-by-side rows
            default_fsync(self.cluster)
        self.disks: list[LazyFS] = []
        self.proxy: subprocess.Popen[str] | None = None
        self.proxy_ports = {(a.index, b.index): lasting_port() for a in self.nodes for b in self.nodes if a is not b}
        self.envs: dict[int, dict[str, str]] = {}

    # ------------------------------------------------------------------------------ set-up

    def start(self) -> None:
        for node in self.nodes:
            disk = LazyFS(node.dir / "js")
            disk.mount()
            self.disks.append(disk)
        self._start_proxy()
        pw = self.cluster.passwords["HARU_NATS_ROUTE_PASSWORD"]
        base = dict(os.environ, **self.cluster.passwords)
        for a in self.nodes:
            env = dict(base)
            for b in self.nodes:
                port = b.cluster_port if a is b else self.proxy_ports[(a.index, b.index)]
                env[f"HARU_NATS_ROUTE_{b.index}"] = f"nats-route://route:{pw}@127.0.0.1:{port}"
            self.envs[a.index] = env
            a.start(env)
        deadline = time.monotonic() + 20
        for node in self.nodes:
            node.wait_ready(deadline)
        self.wait_routed(deadline)

    def wait_routed(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if all(n.monitor("/routez")["num_routes"] >= 2 for n in self.nodes if n.alive):
                    return
            time.sleep(0.05)
        raise AssertionError("the nodes did not route to each other in time")

    def healthz(self, n: int) -> str:
        """What node n's /healthz says now, status and body (a node that is not current answers 503)."""
        return healthz(self.nodes[n - 1].http_port)

    def _start_proxy(self) -> None:
        pairs = [
            f"{a}-{b}={port}:127.0.0.1:{self.nodes[b - 1].cluster_port}" for (a, b), port in self.proxy_ports.items()
        ]
        with open(self.root / "route-proxy.log", "ab") as log:
            self.proxy = subprocess.Popen(
                [sys.executable, "-m", "tests.support.delay_proxy", "127.0.0.1", *pairs],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=str(REPO),
                start_new_session=True,
            )
        assert self.proxy.stdout is not None
        if self.proxy.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the route proxy did not start: {(self.root / 'route-proxy.log').read_text()[-2000:]}")

    def close(self) -> None:
        for node in self.nodes:
            node.kill()
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.kill()
            self.proxy.wait(10)
        for disk in self.disks:
            disk.unmount()

    async def __aenter__(self) -> FaultCluster:
        try:
            await asyncio.to_thread(self.start)
            await self.ensure()
        except BaseException:
            self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)

    async def ensure(self, timeout: float = 30.0) -> None:
        """The R3 streams, made as deploy/nats/ensure_streams.py makes them, then written back to the
        disks (nats-server writes a stream's definition without fsync; a real disk has it ~30 s later)."""
        deadline = time.monotonic() + timeout
        async with self.cluster.log("admin") as log:
            while True:
                try:
                    await log.ensure(replicas=3)
                    break
                except LogError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.25)
        for disk in self.disks:
            disk.writeback()

    def log(self, user: str, writer: str | None = None) -> contextlib.AbstractAsyncContextManager[EventLog]:
        return EventLog.connect(self.all_urls(user), writer=writer or user, timeout=2.0)

    def all_urls(self, user: str) -> list[str]:
        return self.cluster.all_urls(user)

    # ------------------------------------------------------------------------------ faults

    def power_loss(self, index: int) -> dict[str, Any]:
        """Node `index` loses power: the process dies, then what its disk was never told to keep."""
        self.nodes[index - 1].kill()
        return self.disks[index - 1].power_loss()

    def restart(self, index: int) -> None:
        node = self.nodes[index - 1]
        node.start(self.envs[index])
        node.wait_ready(time.monotonic() + 20)

    def restart_all(self) -> None:
        for node in self.nodes:
            node.start(self.envs[node.index])
        deadline = time.monotonic() + 20
        for node in self.nodes:
            node.wait_ready(deadline)
        self.wait_routed(deadline)

    def partition(self, a: int, b: int) -> None:
        """The routes between nodes a and b stop (held, not closed)."""
        self._proxy(f"cut {a} {b}")

    def heal(self, a: int, b: int) -> None:
        self._proxy(f"heal {a} {b}")

    def isolate(self, index: int) -> None:
        for other in self.nodes:
            if other.index != index:
                self.partition(index, other.index)

    def rejoin(self, index: int) -> None:
        for other in self.nodes:
            if other.index != index:
                self.heal(index, other.index)

    def _proxy(self, line: str) -> None:
        assert self.proxy is not None and self.proxy.stdin is not None and self.proxy.stdout is not None
        self.proxy.stdin.write(line + "\n")
        self.proxy.stdin.flush()
        if (answer := self.proxy.stdout.readline().strip()) != "ok":
            raise RuntimeError(f"the route proxy did not take {line!r}: {answer!r}")

    # ------------------------------------------------------------------------------ what the nodes hold

    def block_files(self, index: int, stream: str = subjects.EVENTS_STREAM) -> list[str]:
        """The message block files of `stream` on node `index`, relative to its lazy mount."""
        mount = self.disks[index - 1].mountpoint
        return sorted(str(p.relative_to(mount)) for p in mount.glob(f"**/streams/{stream}/msgs/*.blk"))

    def replica_states(self, stream: str = subjects.EVENTS_STREAM) -> dict[int, tuple[int, int] | None]:
        """Per live node, (messages, last sequence) of its own replica of `stream`, from its /jsz."""
        out: dict[int, tuple[int, int] | None] = {}
        for node in self.nodes:
            if not node.alive:
                continue
            try:
                jsz = node.monitor("/jsz?accounts=true&streams=true")
            except OSError:
                out[node.index] = None
                continue
            out[node.index] = None
            for account in jsz.get("account_details") or []:
                for detail in account.get("stream_detail") or []:
                    if detail.get("name") == stream:
                        state = detail.get("state") or {}
                        out[node.index] = (state.get("messages", 0), state.get("last_seq", 0))
        return out

    async def converged(
        self, timeout: float, stream: str = subjects.EVENTS_STREAM
    ) -> dict[int, tuple[int, int] | None]:
        """Wait (bounded) until every node's replica holds the same messages up to the same sequence;
        returns the states last seen either way (the caller asserts on them)."""
        deadline = time.monotonic() + timeout
        while True:
            states = await asyncio.to_thread(self.replica_states, stream)
            values = set(states.values())
            if len(states) == len(self.nodes) and len(values) == 1 and None not in values:
                return states
            if time.monotonic() > deadline:
                return states
            await asyncio.sleep(0.25)

    async def stream_leader(self, log: EventLog, stream: str = subjects.EVENTS_STREAM) -> int | None:
        """The index of the node leading `stream` now, or None while it has none."""
        with contextlib.suppress(Exception):
            info = await log.js.stream_info(stream)
            if info.cluster is not None and info.cluster.leader:
                return int(info.cluster.leader.rsplit("-", 1)[1])
        return None


def default_fsync(cluster: Cluster) -> Cluster:
    """Make `cluster`'s nodes start with nats-server's default fsync interval instead of the shipped
    `sync_interval: always` (the baseline of the side-by-side rows)."""
    for node in cluster.nodes:
        node.config = _without_sync(node.config)  # type: ignore[method-assign]
    return cluster


def _without_sync(config: Any) -> Any:
    def config_default() -> Path:
        path: Path = config()
        text = path.read_text()
        assert text.count("sync_interval: always") == 1, "the shipped node config no longer sets sync_interval"
        path.write_text(text.replace("sync_interval: always", ""))
        return path

    return config_default


# ---------------------------------------------------------------------------------------- load


@dataclass
class Acked:
    subject: str
    seq: int
    kind: str
    at: datetime


@dataclass
class Load:
    """Writers appending sequence-checked events through every fault, and a promotion in flight: a
    promoter-like writer requesting an operation, recording its steps, moving the route and completing,
    over and over. Only acknowledged appends are kept (`acked`); an append that failed or timed out is
    not counted (its fate is unknown), and a conflict after one adopts the subject's current sequence."""

    log: EventLog
    fleet: str
    writers: int = WRITERS
    acked: list[Acked] = field(default_factory=list)
    errors: int = 0
    flips: int = 0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._tasks = [asyncio.create_task(self._models(w)) for w in range(self.writers)]
        self._tasks.append(asyncio.create_task(self._promotions()))

    async def until(self, count: int, timeout: float = 60.0) -> None:
        async with asyncio.timeout(timeout):
            while len(self.acked) < count:
                await asyncio.sleep(0.01)

    async def more(self, count: int, timeout: float = 60.0) -> None:
        """Wait until `count` more appends were acknowledged than now."""
        await self.until(len(self.acked) + count, timeout)

    async def stop(self) -> None:
        self._stop.set()
        async with asyncio.timeout(30):
            await asyncio.gather(*self._tasks)

    async def _append(self, subject: str, event: ev.Event, seq: int) -> int:
        """One append; returns the subject's sequence to expect next."""
        try:
            got = await self.log.append(subject, event, expect=seq)
        except Conflict as exc:
            self.errors += 1
            return exc.current if exc.current is not None else seq
        except LogError:
            self.errors += 1
            await asyncio.sleep(0.05)
            return seq
        self.acked.append(Acked(subject, got, event.__struct_config__.tag, event.at))  # type: ignore[arg-type]
        return got

    async def _models(self, w: int) -> None:
        subject = subjects.model(self.fleet, "a", f"m{w}")
        seq, i = 0, 0
        while not self._stop.is_set():
            event = ev.ModelResident(
                at=datetime.now(UTC), domain="a", model=f"m{w}", endpoint="127.0.0.1:1", warmup_ms=i
            )
            seq = await self._append(subject, event, seq)
            i += 1

    async def _promotions(self) -> None:
        op, route = subjects.op(self.fleet), subjects.route(self.fleet)
        op_seq = route_seq = 0
        active, k = "a", 0
        while not self._stop.is_set():
            target, op_id = ("b" if active == "a" else "a"), f"op-{k}"
            now = datetime.now
            steps: list[ev.Event] = [ev.PromotionRequested(at=now(UTC), op_id=op_id, target=target, source=active)]
            for step in ("stop_training", "verify_gpu", "wake", "probe"):
                steps.append(ev.StepStarted(at=now(UTC), op_id=op_id, step=step))  # type: ignore[arg-type]
                steps.append(ev.StepCompleted(at=now(UTC), op_id=op_id, step=step))  # type: ignore[arg-type]
            for event in steps:
                if self._stop.is_set():
                    return
                op_seq = await self._append(op, event, op_seq)
            before = len(self.acked)
            route_seq = await self._append(
                route, ev.RouteMoved(at=now(UTC), active=target, previous=active, op_id=op_id), route_seq
            )
            if len(self.acked) > before:
                active, self.flips = target, self.flips + 1
            op_seq = await self._append(op, ev.OperationCompleted(at=now(UTC), op_id=op_id), op_seq)
            k += 1

    async def lost(self, log: EventLog, timeout: float = 45.0) -> list[Acked]:
        """The acknowledged events `log` no longer holds (by sequence, subject, type and time), read
        once the stream answers again (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                out = []
                for a in self.acked:
                    rec = await log.read_seq(a.seq)
                    event = rec.event if rec is not None and rec.subject == a.subject else None
                    if event is None or event.__struct_config__.tag != a.kind or event.at != a.at:
                        out.append(a)
                return out
            except LogError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.25)


async def haru_said(log: EventLog, timeout: float = 30.0) -> list[Regression]:
    """What Haru said about the log: every regression of this writer's receipts, from its own guard
    (after reconnects and conflicts) and from a check now, read once the stream answers (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            now = await check(log, log.receipts())
            break
        except LogError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.25)
    seen = {(r.subject, r.acknowledged): r for r in [*log.receipt_guard.found, *now]}
    return sorted(seen.values(), key=lambda r: (r.subject, r.acknowledged))


def covered(lost: list[Acked], regressions: list[Regression]) -> list[Acked]:
    """The lost events no regression names: on a subject with none, or outside every range it gives."""
    out = []
    for a in lost:
        ranges = [r for r in regressions if r.subject == a.subject and r.held < a.seq <= r.acknowledged]
        if not ranges:
            out.append(a)
    return out


# ------------------------------------------------------------------------------ the documented recovery


def healthz(http_port: int) -> str:
    """What a node's /healthz says now, status and body (a node that is not current answers 503)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=2) as r:
            return f"{r.status} {r.read().decode(errors='replace')[:500]}"
    except urllib.error.HTTPError as exc:
        return f"{exc.code} {exc.read().decode(errors='replace')[:500]}"
    except OSError as exc:
        return f"unanswered ({exc})"


OPERATIONS = REPO / "docs" / "operations.md"


def documented(heading: str) -> list[str]:
    """The command lines of the first ```sh block under the `### <heading>` of docs/operations.md."""
    text = OPERATIONS.read_text()
    start = text.index(f"\n### {heading}\n")
    block = text.index("```sh\n", start) + len("```sh\n")
    return text[block : text.index("```", block)].splitlines()


def _env(urls: list[str]) -> dict[str, str]:
    """The environment a documented line runs in: HARU_NATS_URL set, this venv's `haru` first on PATH."""
    return dict(os.environ, HARU_NATS_URL=",".join(urls), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")


def _commands(lines: list[str]) -> Iterator[str]:
    """A documented block's commands: each line without its trailing comment; blank and comment lines skipped."""
    for line in lines:
        command = line.split("    #", 1)[0].strip()
        if command and not command.startswith("#"):
            yield command


def run_documented(
    fc: FaultCluster | Cluster, lines: list[str], n: int, user: str = "admin", wait_s: float = 90
) -> list[str]:
    """Run a documented recovery on node `n` as written: `N=...` takes the node the test chose,
    `systemctl start|stop nats-server@N` starts or stops that node (start on a running node does
    nothing, as systemd), the store path and `localhost:8222` become node n's, and every other line runs
    as is in bash with HARU_NATS_URL set to the cluster (bounded: a line still running after `wait_s`
    raises subprocess.TimeoutExpired). Returns what the lines printed."""
    node = fc.nodes[n - 1]
    env = _env(fc.all_urls(user))
    out = []
    for command in _commands(lines):
        if re.fullmatch(r"N=\d+", command):
            continue
        command = command.replace("$N", str(n))
        if m := re.fullmatch(r"systemctl (start|stop) ((?:nats-server@\d+ ?)+)", command):
            for unit in m.group(2).split():
                target = fc.nodes[int(unit.split("@")[1]) - 1]
                if m.group(1) == "stop":
                    target.stop()
                elif not target.alive:
                    target.start(fc.envs[target.index])
                    target.wait_ready(time.monotonic() + 20)
            continue
        assert "systemctl" not in command, f"a documented command the test cannot run: {command}"
        command = command.replace("/var/lib/nats/jetstream", str(node.dir / "js"))
        command = command.replace("localhost:8222", f"127.0.0.1:{node.http_port}")
        done = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=wait_s)
        assert done.returncode == 0, (
            f"{command!r} failed ({done.returncode}): {done.stdout[-2000:]} {done.stderr[-2000:]}"
        )
        out.append(done.stdout)
    return out


def run_documented_on(url: str, lines: list[str], **fill: str) -> list[subprocess.CompletedProcess[str]]:
    """A single node's documented recovery: every command line as written, in bash with HARU_NATS_URL set
    to `url` and each `<key>` put by `fill`'s value (`fleet="pl"` for `<fleet>`). What each line did is
    returned, not asserted: `haru verify` exits 11 where the log forgot, as documented."""
    env = _env([url])
    done = []
    for command in _commands(lines):
        for key, value in fill.items():
            command = command.replace(f"<{key}>", value)
        assert "<" not in command, f"a documented placeholder the test did not fill: {command}"
        done.append(subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=60))
    return done


def run_documented_everywhere(
    cluster: Cluster, lines: list[str], damaged: list[str], user: str = "admin", wait_s: float = 15
) -> list[str]:
    """A whole cluster's documented recovery (after b): `systemctl start` of nodes the test already started
    is checked, not repeated; a line for `localhost:8222` runs on each node ("on each host") with that
    node's port, and a node whose wait there does not end within `wait_s` is recovered as a damaged disk,
    as the docs then say (the block `damaged`, on that node alone), its /healthz first printed; every other
    line runs once, in bash with HARU_NATS_URL set to the cluster. Each must succeed; returns what they
    printed."""
    env = _env(cluster.urls(user))
    out = []
    for command in _commands(lines):
        if m := re.fullmatch(r"systemctl start ((?:nats-server@\d+ ?)+)", command):
            for unit in m.group(1).split():
                assert cluster.nodes[int(unit.split("@")[1]) - 1].alive, f"{unit} is not running"
            continue
        assert "systemctl" not in command, f"a documented command the test cannot run: {command}"
        for node in cluster.nodes if "localhost:8222" in command else cluster.nodes[:1]:
            here = command.replace("localhost:8222", f"127.0.0.1:{node.http_port}")
            done = _run_watching(here, env, node.http_port, wait_s)
            if done is None:
                print(f"node {node.index}'s /healthz: {healthz(node.http_port)}: recovered as a damaged disk")
                out += run_documented(cluster, damaged, node.index, user)
                continue
            assert done.returncode == 0, (
                f"{command!r} failed ({done.returncode}): {done.stdout[-2000:]} {done.stderr[-2000:]}"
            )
            out.append(done.stdout)
    return out


def _run_watching(command: str, env: dict[str, str], http_port: int, wait_s: float) -> CompletedProcess | None:
    """Run `command`; None when it is still running after `wait_s`, or sooner when the node's /healthz keeps
    naming a corrupt Raft snapshot for 3 s (it stays so: the docs' cue for 'After d')."""
    proc = subprocess.Popen(
        ["bash", "-c", command],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline, corrupt_since = time.monotonic() + wait_s, 0.0
    while proc.poll() is None and time.monotonic() < deadline:
        corrupt = "snapshot corrupt" in healthz(http_port)
        corrupt_since = (corrupt_since or time.monotonic()) if corrupt else 0.0
        if corrupt_since and time.monotonic() - corrupt_since >= 3:
            break
        time.sleep(0.5)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    stdout, stderr = proc.communicate()
    return CompletedProcess(proc.args, proc.returncode, stdout, stderr)
