"""The haru gateway side by side with its peers, on one upstream, in one interleaved run (issue 20).

    .venv/bin/python bench/peers.py [--reps 6] [--duration 2] [--vllm-router PATH] [--nginx PATH]

Targets: `direct` (the upstream itself), `haru` (`haru gateway`, as the CLI runs it), and every peer
that is installed: `nginx` (the distribution's binary, run with a config of its own on loopback in a
temporary directory, never the system service) and `vllm-router` (the Rust router from PyPI; found
on PATH, in /tmp/*/bin, or given with --vllm-router). An absent peer is skipped with a line saying so.

The upstream is `bench/gateway.py`'s `fast` one (a minimal uvloop server: a fixed chat completion,
or a 17-chunk SSE stream). Per rep, every target runs every scenario, the targets' order rotating
from rep to rep, so all see the same background load:

- `json x1`: wrk, 1 connection: p50 latency (the figure is p50 added to direct's);
- `json x32`: wrk, 32 connections: requests per second (as a ratio to direct's) and the proxy's CPU
  per request, utime + stime of its processes from /proc over the run divided by requests served;
- `sse ttfb`: a raw keep-alive client, 1 connection, no other load: time to the first body byte
  (p50, added to direct's).

Load: each measurement also reads /proc/stat; CPU that neither the target's processes, the upstream
nor the load generator used is "other". Reps where other processes took more than 0.3 cores in any
measurement are reported apart from the quiet ones; the verdicts use quiet reps (all reps, said so,
when none was quiet). Medians and [min..max] ranges over reps.

`PEERS_DEBUG=1` prints each target's errors per scenario and nginx's error log.

Goals (issue 20), as ratios in one run: added p50 at 1 connection <= vllm-router's; JSON x32 >= 0.8x
direct and >= vllm-router's ratio; CPU per request <= 1.1x vllm-router's; SSE TTFB added <=
vllm-router's.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_spec = importlib.util.spec_from_file_location("bench_gateway", ROOT / "bench" / "gateway.py")
gbench = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(gbench)  # type: ignore[union-attr]

PATH = "/v1/chat/completions"
QUIET_CORES = 0.3
CLK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------ /proc


def _descendants(pid: int) -> list[int]:
    """pid and every process below it (nginx's workers, a CLI's children)."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = Path(stat).read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def proc_cpu(pids: list[int]) -> tuple[float, float]:
    """(user, system) CPU seconds of these processes so far."""
    user = system = 0.0
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        user += int(fields[11]) / CLK
        system += int(fields[12]) / CLK
    return user, system


def machine_busy() -> float:
    """CPU seconds the whole machine has been busy (every core) so far."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / CLK


class Meter:
    """CPU of the target, of everything we run, and of the rest of the machine, over one measurement."""

    def __init__(self, target: list[int], ours: list[int]) -> None:
        self.target, self.ours = target, ours

    def __enter__(self) -> Meter:
        self.t0 = time.monotonic()
        self.busy0 = machine_busy()
        self.target0 = proc_cpu(self.target)
        self.ours0 = sum(proc_cpu(self.ours))
        return self

    def stop(self, extra_pids: list[int], extra_cpu: float) -> None:
        self.seconds = time.monotonic() - self.t0
        u, s = proc_cpu(self.target)
        self.user, self.system = u - self.target0[0], s - self.target0[1]
        ours = sum(proc_cpu(self.ours)) - self.ours0 + extra_cpu
        self.other_cores = max(0.0, (machine_busy() - self.busy0 - ours) / self.seconds)

    def __exit__(self, *exc: object) -> None:
        pass


# ---------------------------------------------------------------------------------- load


def wrk(url: str, conns: int, duration: float, tmp: Path, meter: Meter) -> dict:
    """wrk against url; returns requests/s, p50 (s) and requests. The meter covers wrk's own CPU."""
    script = tmp / "post.lua"
    if not script.exists():
        script.write_text(
            'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
            f"wrk.body = {json.dumps(gbench.CHAT_BODY.decode())}\n"
        )
    with meter:
        proc = subprocess.Popen(
            ["wrk", "-t1", f"-c{conns}", f"-d{max(1, round(duration))}s", "--latency", "-s", str(script), url + PATH],
            stdout=subprocess.PIPE,
            text=True,
        )
        out, _ = proc.communicate()
        # wrk has exited: its CPU is in our children's rusage, not /proc
        wrk_cpu = _child_cpu()
        meter.stop([], wrk_cpu)
    m = re.search(r"(\d+) requests in ([\d.]+)(m?s)", out)
    if not m:
        raise SystemExit(f"wrk said:\n{out}")
    n = int(m.group(1))
    seconds = float(m.group(2)) / (1000 if m.group(3) == "ms" else 1)
    p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)", out)
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0}[p50.group(2)] if p50 else 0
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {
        "rps": n / seconds,
        "n": n,
        "p50": float(p50.group(1)) * scale if p50 else float("nan"),
        "errors": int(errors.group(1)) if errors else 0,
        "wrk_us": wrk_cpu / max(1, n) * 1e6,
    }


_child_seen = [0.0]


def _child_cpu() -> float:
    """CPU of children that exited since the last call (wrk, the raw client)."""
    r = os.times()
    total = r.children_user + r.children_system
    delta, _child_seen[0] = total - _child_seen[0], total
    return delta


def sse_ttfb(url: str, duration: float, meter: Meter) -> dict:
    with meter:
        out = subprocess.run(
            [sys.executable, __file__, "--_sse", url, "--duration", str(duration)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        meter.stop([], _child_cpu())
    return json.loads(out)


def run_sse(url: str, duration: float) -> None:
    import uvloop

    async def main() -> dict:
        r = await gbench.load(url, PATH, gbench.SSE_BODY, 1, duration, 0.2, "raw")
        return {"ttfb": gbench._pct(r["ttfb"], 50), "n": len(r["ttfb"]), "errors": r["errors"]}

    print(json.dumps(uvloop.run(main())))


# --------------------------------------------------------------------------------- targets


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(url: str, proc: subprocess.Popen, what: str, timeout: float = 30) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            req = urllib.request.Request(
                url + PATH, data=gbench.CHAT_BODY, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.HTTPError):
            pass
        time.sleep(0.1)
    raise SystemExit(f"{what} did not serve in {timeout} s")


def start_nginx(binary: str, upstream: str, tmp: Path) -> tuple[subprocess.Popen, str]:
    """nginx as a keep-alive reverse proxy, unbuffered (SSE goes through as it comes), one worker."""
    d = tmp / "nginx"
    d.mkdir()
    port = free_port()
    up = upstream.removeprefix("http://")
    (d / "nginx.conf").write_text(f"""
daemon off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fcgi;
    uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;
    upstream up {{ server {up}; keepalive 64; keepalive_requests 1000000; }}
    server {{
        listen 127.0.0.1:{port};
        keepalive_requests 1000000;  # the default, 1000, closes a client connection every 1000 requests
        location / {{
            proxy_pass http://up;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
""")
    proc = subprocess.Popen(
        [binary, "-c", str(d / "nginx.conf"), "-p", str(d), "-e", str(d / "error.log")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    wait_serving(url, proc, "nginx")
    return proc, url


def start_vllm_router(binary: str, upstream: str, tmp: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(tmp / "vllm-router.log", "wb")
    proc = subprocess.Popen(
        [
            binary,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            upstream,
            "--policy",
            "round_robin",
            "--log-level",
            "warning",
            "--prometheus-port",
            str(free_port()),
        ],
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    wait_serving(url, proc, "vllm-router", timeout=60)
    return proc, url


def find_vllm_router(given: str | None) -> str | None:
    if given:
        return given
    found = shutil.which("vllm-router")
    if found:
        return found
    hits = sorted(glob.glob("/tmp/*/bin/vllm-router"))
    return hits[0] if hits else None


# --------------------------------------------------------------------------------- driver


SCENARIOS = ("json x1", "json x32", "sse ttfb")


def one_rep(targets: dict[str, tuple[str, list[int]]], order: list[str], up_pids: list[int], args, tmp: Path) -> dict:
    rep: dict[str, dict] = {}
    for name in order:
        url, pids = targets[name]
        ours = up_pids + ([] if name == "direct" else pids)
        meter_pids = pids if name != "direct" else up_pids
        r: dict = {}
        m = Meter(meter_pids, ours)
        r["json x1"] = wrk(url, 1, args.duration, tmp, m)
        if os.environ.get("PEERS_DEBUG"):
            print(name, {k: (v["errors"] if isinstance(v, dict) else v) for k, v in r.items()})
        other = [m.other_cores]
        m = Meter(meter_pids, ours)
        j = wrk(url, 32, args.duration, tmp, m)
        j["cpu_us"] = (m.user + m.system) / max(1, j["n"]) * 1e6
        j["user_us"] = m.user / max(1, j["n"]) * 1e6
        j["sys_us"] = m.system / max(1, j["n"]) * 1e6
        r["json x32"] = j
        other.append(m.other_cores)
        m = Meter(meter_pids, ours)
        r["sse ttfb"] = sse_ttfb(url, args.duration, m)
        other.append(m.other_cores)
        r["other_cores"] = max(other)
        rep[name] = r
    return rep


def med(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.3g}"


def report(reps: list[dict], names: list[str], label: str) -> dict:
    """Prints the table over these reps; returns the medians used for the verdicts."""
    print(f"\n{label}: {len(reps)} reps")
    print(
        f"{'target':<13}{'added p50 x1 ms':>22}{'json x32 vs direct':>24}{'CPU us/req (user/sys)':>26}"
        f"{'SSE TTFB added ms':>24}"
    )
    out: dict[str, dict] = {}
    for name in names:
        added, ratio, cpu, user, sys_, ttfb, rps, wrk_us = [], [], [], [], [], [], [], []
        for rep in reps:
            d, t = rep["direct"], rep[name]
            added.append((t["json x1"]["p50"] - d["json x1"]["p50"]) * 1e3)
            ratio.append(t["json x32"]["rps"] / d["json x32"]["rps"])
            cpu.append(t["json x32"]["cpu_us"])
            user.append(t["json x32"]["user_us"])
            sys_.append(t["json x32"]["sys_us"])
            ttfb.append((t["sse ttfb"]["ttfb"] - d["sse ttfb"]["ttfb"]) * 1e3)
            rps.append(t["json x32"]["rps"])
            wrk_us.append(t["json x32"]["wrk_us"])
        out[name] = {
            k: statistics.median(v)
            for k, v in (
                ("added", added),
                ("ratio", ratio),
                ("cpu", cpu),
                ("ttfb", ttfb),
                ("rps", rps),
                ("wrk_us", wrk_us),
            )
        }

        def cell(v: list[float], fmt: str) -> str:
            return f"{statistics.median(v):{fmt}} [{min(v):{fmt}}..{max(v):{fmt}}]"

        if name == "direct":
            print(f"{name:<13}{'(baseline)':>22}{'1.00x':>24}{cell(cpu, '.0f') + ' upstream':>26}{'(baseline)':>24}")
            continue
        print(
            f"{name:<13}{cell(added, '+.3f'):>22}{cell(ratio, '.2f'):>24}"
            f"{f'{statistics.median(cpu):.0f} ({statistics.median(user):.0f}/{statistics.median(sys_):.0f})':>26}"
            f"{cell(ttfb, '+.3f'):>24}"
        )
    return out


def cpu_budget(cores: int, rps: float, upstream_us: float, wrk_us: float) -> float:
    """CPU a request that is left for a proxy when the machine's cores serve `rps` through it, the
    upstream and the load generator taking theirs (loopback's softirq time, counted nowhere, makes the
    true budget smaller still)."""
    return cores * 1e6 / rps - upstream_us - wrk_us


def verdicts(med_: dict) -> None:
    h = med_.get("haru")
    v = med_.get("vllm-router")
    if h is None:
        return
    print("\ngoals (issue 20):")
    print(f"  JSON x32 >= 0.8x direct: {h['ratio']:.2f}x -> {'met' if h['ratio'] >= 0.8 else 'MISSED'}")
    d = med_["direct"]
    budget = cpu_budget(os.cpu_count() or 1, 0.8 * d["rps"], d["cpu"], h["wrk_us"])
    print(
        f"    what 0.8x leaves a proxy here: {budget:.0f} us of CPU a request ({os.cpu_count()} cores / "
        f"(0.8 x direct's {d['rps']:.0f} req/s) - the upstream's {d['cpu']:.0f} us - wrk's {h['wrk_us']:.0f} us); "
        f"the upstream is aiohttp's low-level server answering by itself, so a proxy on aiohttp would have "
        f"{budget - d['cpu']:+.0f} us beyond that for the whole upstream leg; haru takes {h['cpu']:.0f} us"
        + (f", the Rust vllm-router {v['cpu']:.0f} us" if v is not None else "")
    )
    if v is None:
        print("  the vllm-router goals need vllm-router: skipped")
        return
    goals = [
        ("added p50 at 1 connection <= vllm-router's", h["added"], v["added"], h["added"] <= v["added"], "ms"),
        ("JSON x32 ratio >= vllm-router's", h["ratio"], v["ratio"], h["ratio"] >= v["ratio"], "x"),
        ("CPU per request <= 1.1x vllm-router's", h["cpu"], v["cpu"], h["cpu"] <= 1.1 * v["cpu"], "us"),
        ("SSE TTFB added <= vllm-router's", h["ttfb"], v["ttfb"], h["ttfb"] <= v["ttfb"], "ms"),
    ]
    for what, hv, vv, ok, unit in goals:
        print(f"  {what}: haru {hv:.3g} {unit} vs {vv:.3g} {unit} -> {'met' if ok else 'MISSED'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--duration", type=int, default=2, help="seconds per target, scenario and rep")
    p.add_argument(
        "--nginx", default=shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    )
    p.add_argument("--vllm-router", default=None)
    p.add_argument(
        "--haru-tree",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also run `haru gateway` from another source tree (e.g. `git archive` of an older commit) "
        "as target NAME: what a change bought, in the same run",
    )
    p.add_argument(
        "--haru-python",
        action="append",
        default=[],
        metavar="NAME=PYTHON",
        help="also run this tree's `haru gateway` under another interpreter (one with the project's "
        "dependencies installed, e.g. Python 3.12, where aiohttp starts handlers eagerly) as NAME",
    )
    p.add_argument("--only", default="", help="comma-separated targets to run besides direct (default: all)")
    p.add_argument("--_sse", metavar="URL", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._sse:
        return run_sse(args._sse, args.duration)
    if not shutil.which("wrk"):
        raise SystemExit("wrk is not installed (Debian: apt-get install wrk): it is the load generator")

    from haru.host.natsd import NatsServer

    only = set(filter(None, args.only.split(",")))
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        nats = NatsServer(tmp / "nats")
        nats.start_sync()
        procs: list[subprocess.Popen] = []
        try:
            up_proc, upstream = gbench.start_upstream("fast", tmp)
            procs.append(up_proc)
            targets: dict[str, tuple[str, list[int]]] = {"direct": (upstream, [up_proc.pid])}
            if not only or "haru" in only:
                asyncio.run(gbench.publish_fleet(nats.url, upstream))
                gw_proc, gw = gbench.start_gateway(nats.url, tmp)
                procs.append(gw_proc)
                gbench.wait_routable(gw)
                targets["haru"] = (gw, _descendants(gw_proc.pid))
            for spec in args.haru_python:
                name, _, python = spec.partition("=")
                gw_proc, gw = gbench.start_gateway(nats.url, tmp, name=name, python=python)
                procs.append(gw_proc)
                gbench.wait_routable(gw)
                targets[name] = (gw, _descendants(gw_proc.pid))
            for spec in args.haru_tree:
                name, _, tree = spec.partition("=")
                gw_proc, gw = gbench.start_gateway(nats.url, tmp, tree=Path(tree), name=name)
                procs.append(gw_proc)
                gbench.wait_routable(gw)
                targets[name] = (gw, _descendants(gw_proc.pid))
            if not only or "nginx" in only:
                if args.nginx and Path(args.nginx).exists():
                    proc, url = start_nginx(args.nginx, upstream, tmp)
                    procs.append(proc)
                    time.sleep(0.2)
                    targets["nginx"] = (url, _descendants(proc.pid))
                else:
                    print("nginx: not installed (Debian: apt-get install nginx), skipped")
            if not only or "vllm-router" in only:
                binary = find_vllm_router(args.vllm_router)
                if binary:
                    proc, url = start_vllm_router(binary, upstream, tmp)
                    procs.append(proc)
                    targets["vllm-router"] = (url, _descendants(proc.pid))
                else:
                    print("vllm-router: not installed (pip install vllm-router, or --vllm-router PATH), skipped")
            names = list(targets)
            print(
                f"targets: {', '.join(names)}; {args.reps} reps x {args.duration:g} s per target and scenario; "
                f"cpus={os.cpu_count()} load average {os.getloadavg()[0]:.2f} at start"
            )
            _child_cpu()
            reps = []
            for i in range(args.reps):
                order = names[i % len(names) :] + names[: i % len(names)]
                rep = one_rep(targets, order, [up_proc.pid], args, tmp)
                rep["other"] = max(r["other_cores"] for r in rep.values())
                rep["load"] = os.getloadavg()[0]
                reps.append(rep)
                errors = {
                    n: rep[n]["json x32"]["errors"] + rep[n]["json x1"]["errors"] + rep[n]["sse ttfb"]["errors"]
                    for n in names
                }
                print(
                    f"rep {i + 1}: other processes up to {rep['other']:.2f} cores, load average {rep['load']:.2f}"
                    + "".join(
                        f"; {n} {rep[n]['json x32']['rps']:.0f} req/s" + (f" ({errors[n]} errors)" if errors[n] else "")
                        for n in names
                    ),
                    flush=True,
                )
            quiet = [r for r in reps if r["other"] <= QUIET_CORES]
            busy = [r for r in reps if r["other"] > QUIET_CORES]
            if quiet:
                medians = report(quiet, names, f"quiet reps (other processes <= {QUIET_CORES} cores)")
                if busy:
                    report(busy, names, f"busy reps (other processes > {QUIET_CORES} cores), apart")
            else:
                medians = report(
                    reps, names, f"no quiet rep (other processes took > {QUIET_CORES} cores in every one): all reps"
                )
            print(f"load average at end {os.getloadavg()[0]:.2f}")
            if os.environ.get("PEERS_DEBUG") and (tmp / "nginx" / "error.log").exists():
                print((tmp / "nginx" / "error.log").read_text()[-2000:])
            verdicts(medians)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
            nats.stop_sync()


if __name__ == "__main__":
    main()
