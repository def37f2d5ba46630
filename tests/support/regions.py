"""Three regions on one machine: network namespaces, a bridge, veth pairs, a delay proxy, a NATS cluster.

Layout of one harness (`Regions`), all names unique to the run (the pid and a free /24):

    root namespace ──veth── hub namespace (bridge br0, 10.77.S.1, the delay proxy) ──veth── region rN
    (the test: 10.77.S.250)                                                                 (10.77.S.1N)

Each region is a namespace of its own with one veth to the hub's bridge; everything placed in a region
(its nats-server, agents, promoter, projector, gateway) runs there through `ip netns exec`, so the
region's processes see each other on 127.0.0.1 and the others only across the bridge. The NATS routes
between regions, and a client's connection to another region's node, go through the delay proxy in the
hub, so a one-way delay d there is an inter-region round trip of 2d. Faults:

- `partition(r)`: region r's link to the hub goes down (`ip link set ... down`): r is cut from the
  other regions and from the test, and nothing is closed; whoever waits for an answer notices.
- `cut(a, b)` / `heal(a, b)`: only the NATS paths between two regions stop (the proxy holds their bytes);
  chat traffic and the other paths stay up.
- `isolate_node(r)` / `rejoin_node(r)`: only region r's NATS node loses its routes to the others
  (`cut_routes`); every client, r's own included, still reaches every node.
- `kill_region(r)`: SIGKILL of every process started in r (their process groups) and its link down.

Nothing leaves these namespaces: no forwarding, no NAT, no route to the outside; the root namespace
gets one /24 route to its veth. `close()` removes every namespace and link it made, also after a failed
test, and a run's names carry its pid so a crashed run's leftovers never collide with the next.

Needs root (CAP_NET_ADMIN) and iproute2. Without them the module's tests skip, except with
HARU_REQUIRE_NETNS=1 (CI, `.ci/run`), where they fail.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from haru.host.natsd import find_binary

REPO = Path(__file__).resolve().parents[2]
NATS_PORT, CLUSTER_PORT, HTTP_PORT = 4222, 6222, 8222
# The proxy's ports in the hub: routes from region a to b on ROUTE_BASE + 10a + b, clients on CLIENT_BASE + ...
ROUTE_BASE, CLIENT_BASE = 16000, 17000
SETUP_LOCK = "/run/haru-regions.lock"
PING_INTERVAL = "1s"  # nats-server pings routes and clients this often; ping_max 3 (~3 s to call a peer gone)


def netns_problem() -> str | None:
    """Why this machine cannot make the harness's namespaces, or None when it can."""
    if os.geteuid() != 0:
        return "the region harness needs root (network namespaces and veth pairs)"
    if subprocess.run(["ip", "-V"], capture_output=True).returncode != 0:
        return "the region harness needs iproute2 (`ip`)"
    probe = f"haru-probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def require_netns() -> None:
    """Skip saying why when namespaces cannot be made; with HARU_REQUIRE_NETNS=1 (CI) fail instead."""
    why = netns_problem()
    if why is None:
        return
    if os.environ.get("HARU_REQUIRE_NETNS") == "1":
        pytest.fail(why + " [HARU_REQUIRE_NETNS=1]")
    pytest.skip(why + " (run as root; CI sets HARU_REQUIRE_NETNS=1 and fails instead)")


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def remove_namespace(ns: str) -> None:
    """SIGKILL whatever still runs in `ns` (what an agent leaves behind on purpose, its runtimes and
    serving port holder, included), then delete it with its veth ends."""
    for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    sh("ip", "netns", "del", ns, check=False)


def reap_stale() -> None:
    """Remove what a killed run left (its namespaces and its root-side link): names hr<pid>... whose
    pid is gone. A run that dies before its `close()` (SIGKILL, a CI timeout) is cleaned up by the next."""
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        m = re.match(r"(hr[a-z]?(\d+))-(hub|r\d+)\b", line)
        if m and not pid_alive(int(m.group(2))):
            remove_namespace(line.split()[0])
    for m in re.finditer(r"^\d+: (hr[a-z]?(\d+)c)[@:]", sh("ip", "-o", "link", check=False).stdout, re.M):
        if not pid_alive(int(m.group(2))):
            sh("ip", "link", "del", m.group(1), check=False)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_subnet() -> int:
    """A third octet S such that 10.77.S.0/24 is routed nowhere in the root namespace yet."""
    used = sh("ip", "-4", "route", "show").stdout
    for s in range(1 + os.getpid() % 200, 255):
        if f"10.77.{s}.0/24" not in used:
            return s
    for s in range(1, 255):
        if f"10.77.{s}.0/24" not in used:
            return s
    raise RuntimeError("no free 10.77.S.0/24 left for the region harness")


@dataclass
class Proc:
    """A process started in a region (its own process group), with its log file."""

    region: int
    name: str
    popen: subprocess.Popen
    log: Path

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        if self.alive:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, timeout: float = 10.0) -> None:
        if self.alive:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def output(self, tail: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-tail:]
        except OSError:
            return ""


@dataclass
class Regions:
    """The namespaces, links and proxy of one run; `nats()` then starts the three-region cluster."""

    root: Path
    n: int = 3
    tag: str = field(default_factory=lambda: f"hr{os.getpid()}")
    procs: list[Proc] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.subnet = 0
        self.proxy: subprocess.Popen | None = None
        self.made_ns: list[str] = []
        self.made_root_link = False
        self.down: set[int] = set()

    # ----------------------------------------------------------------------------- addresses

    @property
    def hub(self) -> str:
        return f"{self.tag}-hub"

    def ns(self, region: int) -> str:
        return f"{self.tag}-r{region}"

    @property
    def hub_ip(self) -> str:
        return f"10.77.{self.subnet}.1"

    @property
    def client_ip(self) -> str:
        return f"10.77.{self.subnet}.250"

    def ip(self, region: int) -> str:
        return f"10.77.{self.subnet}.{10 + region}"

    def regions(self) -> range:
        return range(1, self.n + 1)

    # ------------------------------------------------------------------------------ set-up

    def open(self) -> Regions:
        try:
            # two runs at once (pytest's workers) must not pick the same free /24: set-up is serialised
            with open(SETUP_LOCK, "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                self._make()
        except BaseException:
            self.close()
            raise
        return self

    def _make(self) -> None:
        reap_stale()
        self.subnet = free_subnet()
        prefix = f"/{24}"
        sh("ip", "netns", "add", self.hub)
        self.made_ns.append(self.hub)
        hub = ("ip", "-n", self.hub)
        sh(*hub, "link", "set", "lo", "up")
        sh(*hub, "link", "add", "br0", "type", "bridge", "forward_delay", "0", "stp_state", "0")
        sh(*hub, "addr", "add", self.hub_ip + prefix, "dev", "br0")
        sh(*hub, "link", "set", "br0", "up")
        for r in self.regions():
            ns = self.ns(r)
            sh("ip", "netns", "add", ns)
            self.made_ns.append(ns)
            # the pair is made inside the hub, then one end moves into the region as eth0
            sh(*hub, "link", "add", f"r{r}", "type", "veth", "peer", "name", f"r{r}x")
            sh(*hub, "link", "set", f"r{r}x", "netns", ns)
            sh(*hub, "link", "set", f"r{r}", "master", "br0")
            sh(*hub, "link", "set", f"r{r}", "up")
            inside = ("ip", "-n", ns)
            sh(*inside, "link", "set", f"r{r}x", "name", "eth0")
            sh(*inside, "addr", "add", self.ip(r) + prefix, "dev", "eth0")
            sh(*inside, "link", "set", "eth0", "up")
            sh(*inside, "link", "set", "lo", "up")
        # the test's own leg: a veth from the root namespace to the bridge
        root_end = f"{self.tag}c"
        sh(*hub, "link", "add", "cli", "type", "veth", "peer", "name", root_end)
        sh(*hub, "link", "set", root_end, "netns", "1")
        self.made_root_link = True
        sh(*hub, "link", "set", "cli", "master", "br0")
        sh(*hub, "link", "set", "cli", "up")
        sh("ip", "addr", "add", self.client_ip + prefix, "dev", root_end)
        sh("ip", "link", "set", root_end, "up")
        self._start_proxy()

    def _start_proxy(self) -> None:
        pairs = []
        for a in self.regions():
            for b in self.regions():
                if a != b:
                    pairs.append(f"{a}-{b}r={self.route_port(a, b)}:{self.ip(b)}:{CLUSTER_PORT}")
                    pairs.append(f"{a}-{b}={self.client_port(a, b)}:{self.ip(b)}:{NATS_PORT}")
        log = open(self.root / "delay-proxy.log", "ab")
        self.proxy = subprocess.Popen(
            ["ip", "netns", "exec", self.hub, sys.executable, "-m", "tests.support.delay_proxy", self.hub_ip, *pairs],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=str(REPO),
            start_new_session=True,
        )
        log.close()
        assert self.proxy.stdout is not None
        line = self.proxy.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"the delay proxy did not start: {(self.root / 'delay-proxy.log').read_text()[-2000:]}")

    def route_port(self, a: int, b: int) -> int:
        return ROUTE_BASE + 10 * a + b

    def client_port(self, a: int, b: int) -> int:
        return CLIENT_BASE + 10 * a + b

    def close(self) -> None:
        for p in reversed(self.procs):
            p.kill()
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.kill()
            self.proxy.wait(10)
        for ns in reversed(self.made_ns):
            remove_namespace(ns)
        if self.made_root_link:
            sh("ip", "link", "del", f"{self.tag}c", check=False)
        self.made_ns.clear()

    def __enter__(self) -> Regions:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ processes

    def spawn(self, region: int, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        """Start argv in region's namespace, in a process group of its own, output to ROOT/logs/NAME.log."""
        logs = self.root / "logs"
        logs.mkdir(exist_ok=True)
        path = logs / f"{name}.log"
        with open(path, "ab") as out:
            popen = subprocess.Popen(
                ["ip", "netns", "exec", self.ns(region), *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env if env is not None else dict(os.environ),
                cwd=str(REPO),
                start_new_session=True,
            )
        proc = Proc(region, name, popen, path)
        self.procs.append(proc)
        return proc

    # ------------------------------------------------------------------------------ faults

    def _proxy(self, line: str) -> None:
        assert self.proxy is not None and self.proxy.stdin is not None and self.proxy.stdout is not None
        self.proxy.stdin.write(line + "\n")
        self.proxy.stdin.flush()
        answer = self.proxy.stdout.readline().strip()
        if answer != "ok":
            raise RuntimeError(f"the delay proxy did not take {line!r}: {answer!r}")

    def set_delay(self, one_way_ms: float) -> None:
        """Every inter-region NATS path (routes, cross-region clients) gets this one-way delay."""
        self._proxy(f"delay {one_way_ms / 1000}")

    def cut(self, a: int, b: int) -> None:
        self._proxy(f"cut {a} {b}")

    def heal(self, a: int, b: int) -> None:
        self._proxy(f"heal {a} {b}")

    def cut_routes(self, a: int, b: int) -> None:
        """Only the NATS routes between a and b stop: the two nodes lose each other, clients reach both."""
        self._proxy(f"cut-routes {a} {b}")

    def heal_routes(self, a: int, b: int) -> None:
        self._proxy(f"heal-routes {a} {b}")

    def isolate_node(self, region: int) -> None:
        """Region's NATS node loses its routes to every other node (scenario d); its clients, in the region
        and elsewhere, still reach every node."""
        for b in self.regions():
            if b != region:
                self.cut_routes(region, b)

    def rejoin_node(self, region: int) -> None:
        for b in self.regions():
            if b != region:
                self.heal_routes(region, b)

    def partition(self, region: int) -> None:
        """Region's only link goes down: cut from the other regions and from the test."""
        sh("ip", "-n", self.hub, "link", "set", f"r{region}", "down")
        self.down.add(region)

    def heal_partition(self, region: int) -> None:
        sh("ip", "-n", self.hub, "link", "set", f"r{region}", "up")
        self.down.discard(region)

    def kill_region(self, region: int) -> list[str]:
        """SIGKILL everything started in region (process groups) and take its link down; returns their names."""
        self.partition(region)
        killed = []
        for p in self.procs:
            if p.region == region and p.alive:
                p.kill()
                killed.append(p.name)
        return killed

    # ------------------------------------------------------------------------------ NATS

    def nats_urls(self, region: int) -> list[str]:
        """For a client in `region`: its own node first (in its namespace), then the others via the proxy."""
        own = [f"nats://127.0.0.1:{NATS_PORT}"]
        return own + [f"nats://{self.hub_ip}:{self.client_port(region, b)}" for b in self.regions() if b != region]

    def test_urls(self) -> list[str]:
        """For the test (root namespace): every node directly across the bridge (no delay)."""
        return [f"nats://{self.ip(r)}:{NATS_PORT}" for r in self.regions() if r not in self.down]

    def nats_config(self, region: int) -> Path:
        """A node of the three-region cluster: tagged region:rN, replicas placed one per region."""
        store = self.root / f"nats-r{region}"
        store.mkdir(exist_ok=True)
        routes = [f"nats-route://{self.hub_ip}:{self.route_port(region, b)}" for b in self.regions() if b != region]
        text = f"""
server_name: haru-nats-r{region}
server_tags: ["region:r{region}"]
listen: 0.0.0.0:{NATS_PORT}
http: 0.0.0.0:{HTTP_PORT}
ping_interval: "{PING_INTERVAL}"
ping_max: 3
max_payload: 4MB
jetstream {{
  store_dir: {json.dumps(str(store / "js"))}
  unique_tag: "region:"
}}
cluster {{
  name: haru
  listen: 0.0.0.0:{CLUSTER_PORT}
  no_advertise: true
  routes: {json.dumps(routes)}
}}
"""
        path = store / "nats.conf"
        path.write_text(text)
        return path

    def start_nats(self, region: int) -> Proc:
        return self.spawn(region, f"nats-r{region}", [find_binary(), "-c", str(self.nats_config(region))])

    def nats(self, timeout: float = 30.0) -> None:
        """Start the three nodes and wait until each routes to both others and JetStream has a meta leader."""
        for r in self.regions():
            self.start_nats(r)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if all(self.monitor(r, "/routez")["num_routes"] >= self.n - 1 for r in self.regions()) and all(
                    self.monitor(r, "/jsz").get("meta_cluster", {}).get("leader") for r in self.regions()
                ):
                    return
            except OSError:
                pass
            for p in self.procs:
                if p.name.startswith("nats-") and not p.alive:
                    raise RuntimeError(f"{p.name} exited: {p.output()}")
            time.sleep(0.1)
        raise RuntimeError("the three-region NATS cluster did not form with a meta leader in time")

    def monitor(self, region: int, path: str) -> dict:
        with urllib.request.urlopen(f"http://{self.ip(region)}:{HTTP_PORT}{path}", timeout=2) as r:
            return json.loads(r.read())

    def meta_leader(self) -> int | None:
        """The region of JetStream's meta leader, as a reachable node sees it."""
        for r in self.regions():
            if r in self.down:
                continue
            try:
                leader = self.monitor(r, "/jsz").get("meta_cluster", {}).get("leader")
            except OSError:
                continue
            if leader:
                return region_of(leader)
        return None

    async def placement(self, js, stream: str) -> tuple[int, list[int]]:
        """(the leader's region, every replica's region) of a stream, as JetStream reports it."""
        info = await js.stream_info(stream)
        assert info.cluster is not None and info.cluster.leader, f"{stream} has no leader"
        names = [info.cluster.leader] + [p.name for p in info.cluster.replicas or []]
        return region_of(info.cluster.leader), sorted(region_of(n) for n in names)


def region_of(server_name: str) -> int:
    """The region of a node named haru-nats-rN."""
    return int(server_name.rsplit("-r", 1)[1])


async def ensure_streams(urls: list[str], timeout: float = 30.0) -> None:
    """`EventLog.ensure(replicas=3)`, as deploy/nats/ensure_streams.py does it: retried while a cluster
    that just formed (or just lost a node) cannot place three replicas yet."""
    import asyncio

    from haru.core.errors import LogError, LogUnavailable
    from haru.log.eventlog import EventLog

    deadline = time.monotonic() + timeout
    async with EventLog.connect(urls, writer="test:ensure") as log:
        while True:
            try:
                await log.ensure(replicas=3)
                return
            except (LogUnavailable, LogError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)


def wait_port(host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listened on {host}:{port} within {timeout}s")
