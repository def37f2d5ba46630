"""A fake `sky` executable the provisioning tests write and run as a real child process.

It is a small stateful cloud: `sky launch` creates a cluster (UP, in the region of the YAML it was
given), `sky status -o json` lists it the way SkyPilot 0.14 does, `sky down` removes it; `sky serve
up / status / down` do the same for services and print SkyServe's table. A service is READY only once its
replica answers SkyServe's readiness probe with a 200 (the probe `sky serve status` runs, without a header,
on the host's `ready_url`), and a replica never ready past the probe's initial delay is torn down. What the next
launches, downs and serve-ups do is scripted in its state file:

    "ok"        succeed
    "capacity"  fail as SkyPilot does when a region has no capacity (ResourcesUnavailableError)
    "hang"      leave an INIT cluster, start a grandchild `sleep`, and hang (the caller's timeout kills it)
    "fail"      fail with some other error (a bad argument)
    "slow"      succeed, but only exit after `slow_s` seconds (the cluster is UP meanwhile)

A launched cluster can be a host: when the state's "hosts" has an entry for the cluster's domain (keyed by
the domain's base cluster name), a successful launch marks that host's simulated GPU present (a new
machine) and starts its command (a real `haru agent` on the simulator) in its own session; `sky down`
stops it (SIGINT, then SIGKILL) as the cloud would take the machine away.

Every invocation is appended to calls.jsonl: its argv, and which of the watched environment variables
it saw (names only, and a hash of the value, never the value).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import time
from pathlib import Path

SCRIPT = r"""#!{python}
import hashlib, json, os, re, subprocess, sys, time
from pathlib import Path
HOME = Path({home!r})
state_path = HOME / "state.json"
state = json.loads(state_path.read_text())
argv = sys.argv[1:]
with open(HOME / "calls.jsonl", "a") as fh:
    watched = [k for k in state.get("watch_env", []) if k in os.environ]
    seen = {{k: hashlib.sha256(os.environ[k].encode()).hexdigest()[:12] for k in watched}}
    fh.write(json.dumps({{"argv": argv, "env": seen, "at": time.time()}}) + "\n")

def save():
    tmp = state_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, state_path)

def next_outcome(key):
    script = state.get(key, [])
    outcome = script.pop(0) if script else "ok"
    save()
    return outcome

def opt(name):
    return argv[argv.index(name) + 1] if name in argv else None

def secrets_present():
    for i, a in enumerate(argv):
        if a == "--secret" and "=" not in argv[i + 1] and argv[i + 1] not in os.environ:
            print(f"click.exceptions.BadParameter: {{argv[i + 1]}} is not set in local environment.", file=sys.stderr)
            sys.exit(2)

def region_of(text):
    m = re.search(r'^\s*region:\s*"?([A-Za-z0-9_.-]+)"?\s*$', text, re.M)
    return m.group(1) if m else ""

def host_for(name):
    for base, host in state.get("hosts", {{}}).items():
        if name == base or re.fullmatch(re.escape(base) + r"-r[0-9a-f]{{6}}", name):
            return host
    return None

def start_host(name):
    host = host_for(name)
    if host is None:
        return 0
    if host.get("sim_dir"):
        from haru.agents.sim.gpu_state import SimGpuState
        SimGpuState(host["sim_dir"], 0).set_present(True)
    out = open(host["log"], "ab")
    proc = subprocess.Popen(host["argv"], env={{**os.environ, **host.get("env", {{}})}}, cwd=host.get("cwd"),
                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    return proc.pid

def alive(pid):
    try:
        with open(f"/proc/{{pid}}/stat") as fh:
            return fh.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return False

def stop_host(pid):
    if not pid:
        return
    import signal
    for sig, wait in ((signal.SIGINT, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + wait
        while time.time() < deadline and alive(pid):
            time.sleep(0.05)
        if not alive(pid):
            return

def probe_replica(name, svc):
    # SkyServe's readiness probe, as sky/serve/replica_managers.py does it: GET the service's
    # readiness_probe path on the replica, no header; ready only on a 200. A replica never ready past
    # initial_delay_seconds is terminated (FAILED_INITIAL_DELAY); one ready before and failing since is
    # NOT_READY (the service has no ready replica).
    if svc["status"] in ("SHUTTING_DOWN", "FAILED", "NO_REPLICA_FAILED") or "up_at" not in svc:
        return
    import urllib.request, yaml
    spec = (yaml.safe_load(svc["yaml"]) or {{}}).get("service", {{}})
    probe = spec.get("readiness_probe", {{}})
    path = probe if isinstance(probe, str) else probe.get("path", "/")
    delay = probe.get("initial_delay_seconds", 1200) if isinstance(probe, dict) else 1200
    host = host_for(name) or {{}}
    ok = False
    if host.get("ready_url"):
        try:
            with urllib.request.urlopen(host["ready_url"].rstrip("/") + path, timeout=2) as r:
                ok = r.status == 200
        except Exception:
            ok = False
    svc.setdefault("probes", []).append([path, ok])
    if ok:
        svc["status"], svc["first_ready"] = "READY", svc.get("first_ready") or time.time()
    elif svc.get("first_ready"):
        svc["status"] = "NO_REPLICA"
    elif time.time() - svc["up_at"] > delay:
        svc["status"] = "NO_REPLICA_FAILED"  # the replica was FAILED_INITIAL_DELAY and torn down
        stop_host(svc.get("pid", 0))
        svc["pid"] = 0

def hang(name, kind):
    state[kind][name] = {{"status": "INIT", "region": "", "yaml": ""}}
    save()
    child = subprocess.Popen(["sleep", "3600"])
    (HOME / "hang.pid").write_text(str(child.pid))
    time.sleep(3600)

cmd = argv[0] if argv else ""
if cmd == "status":
    names = [a for a in argv[1:] if not a.startswith("-") and a != "json"]
    out = []
    for name, c in state["clusters"].items():
        if names and name not in names:
            continue
        if c["status"] == "INIT" and c.get("up_at") and time.time() >= c["up_at"]:
            c["status"] = "UP"
            save()
        out.append({{"name": name, "status": c["status"], "launched_at": 1764547200, "last_creation_yaml": c["yaml"],
                     "resources_str": "1x AWS(g6.xlarge, {{'L4': 1}})", "autostop": -1, "to_down": False,
                     "cluster_hash": "h", "cluster_ever_up": True, "user_hash": "u", "user_name": "haru",
                     "workspace": "default", "is_managed": False, "nodes": 1}})
    print(json.dumps(out, indent=2))
elif cmd == "launch":
    name = opt("--cluster")
    path = argv[-1]
    secrets_present()
    outcome = next_outcome("launch_script")
    text = Path(path).read_text()
    region = region_of(text)
    if outcome == "capacity":
        print(f"Launching on AWS {{region}}", flush=True)
        print("sky.exceptions.ResourcesUnavailableError: Failed to provision all possible launchable resources. "
              f"Relax the task's resource requirements: 1x AWS([Spot], {{{{'L4': 1}}}}, region={{region}})",
              file=sys.stderr)
        sys.exit(1)
    if outcome == "hang":
        hang(name, "clusters")
    if outcome == "fail":
        print("ValueError: Invalid accelerator for this cloud", file=sys.stderr)
        sys.exit(1)
    state["clusters"][name] = {{"status": "UP", "region": region, "yaml": text, "pid": start_host(name)}}
    state.setdefault("launched", []).append({{"cluster": name, "region": region, "yaml": text}})
    save()
    if outcome == "slow":
        time.sleep(state.get("slow_s", 5))
    print(f"Cluster {{name}} launched in {{region}}.")
elif cmd == "down":
    name = argv[-1]
    outcome = next_outcome("down_script")
    if outcome != "ok":
        print(f"sky.exceptions.ClusterStatusFetchingError: failed to terminate {{name}}: cloud API error",
              file=sys.stderr)
        sys.exit(1)
    gone = state["clusters"].pop(name, None)
    save()
    stop_host((gone or {{}}).get("pid", 0))
    state.setdefault("downed", []).append(name)
    save()
    print(f"Terminating cluster {{name}}...done.")
elif cmd == "cost-report":
    print(json.dumps([{{"name": n, "total_cost": state.get("cost_per_cluster", 1.25), "status": c["status"],
                        "duration": state.get("duration_per_cluster", 3600)}}
                      for n, c in state["clusters"].items()]))
elif cmd == "serve":
    sub = argv[1]
    if sub == "status":
        names = [a for a in argv[2:] if not a.startswith("-")]
        rows = [(n, s) for n, s in state["services"].items() if not names or n in names]
        for n, s in rows:
            probe_replica(n, s)
        save()
        if not rows:
            print("Services\nNo existing services.")
        else:
            print("\x1b[1mServices\x1b[0m")
            print("NAME            VERSION  UPTIME  STATUS        REPLICAS  ENDPOINT")
            for n, s in rows:
                ep = s.get("endpoint") or "-"
                print(f"{{n:<16}}{{1:<9}}{{'5m':<8}}\x1b[32m{{s['status']:<14}}\x1b[0m{{'1/1':<10}}{{ep}}")
            print("")
            print("Service Replicas")
            print("SERVICE_NAME    ID  VERSION  ENDPOINT  LAUNCHED  INFRA  RESOURCES  STATUS")
    elif sub == "up":
        name = opt("--service-name")
        secrets_present()
        outcome = next_outcome("serve_script")
        if outcome == "hang":
            hang(name, "services")
        if outcome != "ok":
            print("sky.exceptions.ResourcesUnavailableError: no capacity for the service", file=sys.stderr)
            sys.exit(1)
        state["services"][name] = {{"status": "REPLICA_INIT", "endpoint": "34.1.2.3:30001",
                                   "yaml": Path(argv[-1]).read_text(), "pid": start_host(name),
                                   "up_at": time.time(), "first_ready": None}}
        state.setdefault("launched", []).append({{"service": name}})
        save()
        print(f"Service {{name!r}} is spinning up.")
    elif sub == "down":
        name = argv[-1]
        outcome = next_outcome("down_script")
        if outcome != "ok":
            print("failed to tear down the service", file=sys.stderr)
            sys.exit(1)
        gone = state["services"].pop(name, None)
        save()
        stop_host((gone or {{}}).get("pid", 0))
        state.setdefault("downed", []).append(name)
        save()
        print(f"Service {{name!r}} is scheduled to be terminated.")
else:
    print(f"fake sky: unknown command {{argv}}", file=sys.stderr)
    sys.exit(2)
"""


class FakeSky:
    """The fake `sky` in `home`: its path, its state and the calls it recorded."""

    def __init__(self, home: Path, *, watch_env: tuple[str, ...] = ()) -> None:
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.path = self.home / "sky"
        self.path.write_text(SCRIPT.format(python=sys.executable, home=str(self.home)))
        self.path.chmod(self.path.stat().st_mode | stat.S_IXUSR)
        self.write_state(
            {
                "clusters": {},
                "services": {},
                "launch_script": [],
                "down_script": [],
                "serve_script": [],
                "watch_env": list(watch_env),
            }
        )

    def state(self) -> dict:
        return json.loads((self.home / "state.json").read_text())

    def write_state(self, state: dict) -> None:
        (self.home / "state.json").write_text(json.dumps(state))

    def script(self, **scripts: list[str]) -> None:
        state = self.state()
        state.update(scripts)
        self.write_state(state)

    def add_cluster(self, name: str, status: str = "UP", region: str = "us-east-1", *, up_after_s: float = 0) -> None:
        """A cluster SkyPilot knows; an INIT one with `up_after_s` turns UP that long from now (a launch
        still running elsewhere)."""
        state = self.state()
        state["clusters"][name] = {"status": status, "region": region, "yaml": f'resources:\n  region: "{region}"\n'}
        if up_after_s:
            state["clusters"][name]["up_at"] = time.time() + up_after_s
        self.write_state(state)

    def calls(self) -> list[dict]:
        path = self.home / "calls.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def commands(self) -> list[str]:
        """Each call as its command words: "status", "launch", "down", "serve up", ..."""
        out = []
        for c in self.calls():
            argv = c["argv"]
            out.append(" ".join(argv[:2]) if argv and argv[0] == "serve" else (argv[0] if argv else ""))
        return out

    def add_host(
        self,
        base: str,
        argv: list[str],
        log: Path,
        *,
        env: dict | None = None,
        cwd: str | None = None,
        sim_dir: str = "",
        ready_url: str = "",
    ) -> None:
        """A launch of `base` (or a replacement of it) starts `argv` as the launched host. `ready_url`: where
        SkyServe reaches the replica's port for its readiness probe (a service is READY only after a 200)."""
        state = self.state()
        state.setdefault("hosts", {})[base] = {
            "argv": argv,
            "log": str(log),
            "env": env or {},
            "cwd": cwd,
            "sim_dir": sim_dir,
            "ready_url": ready_url,
        }
        self.write_state(state)

    def launched(self) -> list[dict]:
        return self.state().get("launched", [])

    def host_pids(self) -> list[int]:
        state = self.state()
        return [c.get("pid", 0) for c in [*state["clusters"].values(), *state["services"].values()] if c.get("pid")]

    def kill_hosts(self, state_root: Path | None = None) -> None:
        """Every host a launch started and no down stopped (the tests' clean-up); with `state_root`, also
        the runtimes and serving-port holders the hosts' agents left in its per-domain state dirs (they
        outlive their agent by design)."""
        import signal

        from tests.support.agent_harness import kill_runtimes

        for pid in self.host_pids():
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if state_root is not None and state_root.is_dir():
            for state_dir in state_root.iterdir():
                if state_dir.is_dir():
                    kill_runtimes(state_dir)

    def hang_pid(self) -> int | None:
        path = self.home / "hang.pid"
        return int(path.read_text()) if path.exists() else None


def sha12(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:12]
