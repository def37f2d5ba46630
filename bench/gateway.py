"""Gateway overhead: the same upstream called directly and through `haru gateway`, in one run.

    .venv/bin/python bench/gateway.py [--duration 4] [--slices 6] [--upstream both|sim|fast] [--client raw|aiohttp]
                                      [--consoles 20] [--churn-hz 5]

Processes (each its own, as in production): a nats-server with the fleet's view and route intent
published; one upstream (`sim`: the vLLM simulator, `python -m haru.agents.sim.vllm serve`, with no token
delay; `fast`: a minimal uvloop server returning a fixed chat completion or a 16-chunk SSE stream,
the stricter baseline since its own CPU per request is smallest); `haru gateway`
(uvloop, as the CLI runs it); and the load generator (uvloop; `raw`: a minimal keep-alive HTTP/1.1
client, so the client's own CPU distorts little; `aiohttp`: aiohttp's client).

For JSON and SSE at 1 and 32 connections it measures direct and via the gateway in alternating slices (so both see the
same background load on a shared machine) and prints: throughput ratio (gateway / direct), added p50 and p99 latency,
and for SSE the time-to-first-token ratio. Targets (issue 7): added p50 <= 0.5 ms at 1 connection, throughput >= 0.5x
direct at 32 connections (>= 0.6x with the `fast` upstream, issue 20). Ratios, not absolute numbers, are the result: the
machine is shared by every process here.

`--consoles N` (issue 18) measures everything twice in the same run: first as above, then with N web
consoles open on /ui/events (a process of their own) while the fleet's view changes `--churn-hz`
times a second (each change a real KV write the gateway's watch applies and fans out to every
console), and prints both sets of ratios side by side: the console must not cost the proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "bench-model"
CHAT_BODY = json.dumps(
    {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Summarise the plot of a long novel in three sentences, please."},
        ],
        "max_tokens": 64,
        "temperature": 0.7,
    }
).encode()
SSE_BODY = json.dumps({**json.loads(CHAT_BODY), "stream": True}).encode()
SSE_CHUNKS = 16


# ------------------------------------------------------------------------------------ upstream


def _completion() -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 1,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "A long novel, summarised. " * 6},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 30, "completion_tokens": 40, "total_tokens": 70},
        },
        separators=(",", ":"),
    ).encode()


def _chunk(i: int) -> bytes:
    return (
        b"data: "
        + json.dumps(
            {
                "id": "chatcmpl-bench",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": MODEL,
                "choices": [{"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": None}],
            },
            separators=(",", ":"),
        ).encode()
        + b"\n\n"
    )


def run_fast_upstream(port_file: str) -> None:
    import uvloop
    from aiohttp import web

    completion = _completion()
    chunks = [_chunk(i) for i in range(SSE_CHUNKS)] + [b"data: [DONE]\n\n"]

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        if b'"stream": true' not in body:
            return web.Response(body=completion, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for c in chunks:
            await resp.write(c)
        await resp.write_eof()
        return resp

    async def main() -> None:
        runner = web.ServerRunner(web.Server(handle, access_log=None), handle_signals=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, backlog=1024).start()
        Path(port_file).write_text(str(runner.addresses[0][1]))
        await asyncio.Event().wait()

    uvloop.run(main())


# ------------------------------------------------------------------------------ load generator


class RawClient:
    """One keep-alive HTTP/1.1 connection; parses Content-Length and chunked responses."""

    def __init__(self, host: str, port: int, path: str, body: bytes) -> None:
        self.host, self.port = host, port
        self.request = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        self.writer.close()

    async def once(self) -> tuple[float, float]:
        """(time to first body byte, total) in seconds."""
        reader = self.reader
        t0 = time.perf_counter()
        self.writer.write(self.request)
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.decode(errors="replace").splitlines()[0])
        lower = head.lower()
        i = lower.find(b"content-length:")
        if i >= 0:
            n = int(lower[i + 15 : lower.index(b"\r\n", i)])
            await reader.readexactly(n)
            t = time.perf_counter() - t0
            return t, t
        first = 0.0
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            await reader.readexactly(size + 2)
            if not first:
                first = time.perf_counter() - t0
        return first, time.perf_counter() - t0


class AiohttpClient:
    def __init__(self, host: str, port: int, path: str, body: bytes) -> None:
        self.url, self.body = f"http://{host}:{port}{path}", body

    async def open(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))

    async def close(self) -> None:
        await self.session.close()

    async def once(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        async with self.session.post(self.url, data=self.body, headers={"Content-Type": "application/json"}) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}")
            first = 0.0
            async for _ in r.content.iter_any():
                if not first:
                    first = time.perf_counter() - t0
        return first, time.perf_counter() - t0


async def load(url: str, path: str, body: bytes, conns: int, duration: float, warmup: float, client: str) -> dict:
    host, port = url.removeprefix("http://").split(":")
    cls = RawClient if client == "raw" else AiohttpClient
    ttfb: list[float] = []
    total: list[float] = []
    errors = 0
    start = time.perf_counter()
    measure_from = start + warmup
    end = measure_from + duration

    async def worker() -> None:
        nonlocal errors
        c = cls(host, int(port), path, body)
        await c.open()
        try:
            while True:
                now = time.perf_counter()
                if now >= end:
                    return
                try:
                    first, t = await c.once()
                except Exception:
                    errors += 1
                    await c.close()
                    await c.open()
                    continue
                if now >= measure_from:
                    ttfb.append(first)
                    total.append(t)
        finally:
            await c.close()

    await asyncio.gather(*(worker() for _ in range(conns)))
    return {"total": total, "ttfb": ttfb, "errors": errors, "seconds": duration}


def summary(samples: list[dict]) -> dict:
    total = [t for s in samples for t in s["total"]]
    ttfb = [t for s in samples for t in s["ttfb"]]
    seconds = sum(s["seconds"] for s in samples)
    return {
        "n": len(total),
        "rps": len(total) / seconds,
        "errors": sum(s["errors"] for s in samples),
        "p50": _pct(total, 50),
        "p99": _pct(total, 99),
        "ttft_p50": _pct(ttfb, 50),
        "ttft_p99": _pct(ttfb, 99),
    }


async def compare(
    direct: str, gateway: str, body: bytes, conns: int, duration: float, warmup: float, client: str, slices: int
) -> dict:
    """Direct and gateway in alternating slices (ABBA...), so both see the same background load."""
    samples: dict[str, list[dict]] = {"direct": [], "gateway": []}
    for i in range(slices):
        order = (("direct", direct), ("gateway", gateway))
        for name, url in order if i % 2 == 0 else order[::-1]:
            samples[name].append(
                await load(
                    url,
                    "/v1/chat/completions",
                    body,
                    conns,
                    duration / slices,
                    warmup if i == 0 else min(warmup, 0.2),
                    client,
                )
            )
    return {name: summary(s) for name, s in samples.items()}


def _pct(values: list[float], p: int) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100))]


def run_load(args: argparse.Namespace) -> None:
    import uvloop

    body = SSE_BODY if args.kind == "sse" else CHAT_BODY
    result = uvloop.run(
        compare(args.url, args.url2, body, args.conns, args.duration, args.warmup, args.client, args.slices)
    )
    print(json.dumps(result))


# --------------------------------------------------------------------------------------- driver


def _wait_file(path: Path, proc: subprocess.Popen, what: str, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        time.sleep(0.02)
    raise SystemExit(f"{what} did not start in {timeout} s")


def start_upstream(kind: str, tmp: Path) -> tuple[subprocess.Popen, str]:
    if kind == "fast":
        port_file = tmp / "upstream.port"
        proc = subprocess.Popen([sys.executable, __file__, "--_upstream", str(port_file)], cwd=ROOT)
        return proc, f"http://127.0.0.1:{_wait_file(port_file, proc, 'the upstream')}"
    from haru.agents.sim.vllm import runtime_path

    env = {
        **os.environ,
        "HARU_SIM_DIR": str(tmp / "sim"),
        "HARU_SIM_DOMAIN": "a",
        "HARU_SIM_LOAD_MS": "10",
        "HARU_SIM_VRAM": "1GiB",
        "HARU_SIM_TOKENS_PER_S": "0",
    }
    (tmp / "sim").mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "haru.agents.sim.vllm", "serve", "/m", "--port", "0", "--served-model-name", MODEL],
        cwd=ROOT,
        env=env,
        stderr=subprocess.DEVNULL,
    )
    info = json.loads(_wait_file(runtime_path(tmp / "sim", MODEL), proc, "the simulator"))
    time.sleep(0.5)
    return proc, f"http://127.0.0.1:{info['port']}"


async def publish_fleet(nats_url: str, upstream: str) -> None:
    from haru.core import subjects
    from haru.core.residency import Answer, Resident
    from haru.core.views import DomainView, FleetView, ModelView, RouteIntent, Target, view_encoder
    from haru.log.eventlog import EventLog

    async with EventLog.connect([nats_url], writer="bench") as log:
        await log.ensure()
        view = FleetView(
            fleet="default",
            active="a",
            route_revision=1,
            seq=1,
            domains={
                "a": DomainView(
                    name="a",
                    serving_url=upstream,
                    models={MODEL: ModelView(name=MODEL, admitted=True, residency=Resident())},
                )
            },
        )
        intent = RouteIntent(
            fleet="default",
            revision=1,
            active=Target(domain="a", serving_url=upstream),
            answers={MODEL: Answer(answer="ready")},
        )
        await log.put_view(subjects.view_key("default"), view_encoder.encode(view), last=0)
        await log.publish_intent("default", view_encoder.encode(intent), expect=0)


def start_gateway(
    nats_url: str, tmp: Path, *, tree: Path = ROOT, python: str = sys.executable, name: str = ""
) -> tuple[subprocess.Popen, str]:
    """`haru gateway` as the CLI runs it, from a source tree (its modules first on the path; this one by
    default) under an interpreter: (process, URL) once it listens."""
    log_path = tmp / (f"gateway-{name}.log" if name else "gateway.log")
    out = open(log_path, "wb")
    env = {**os.environ, "HARU_API_TOKEN": "", "HARU_NO_UVLOOP": "0"}
    if tree != ROOT or python != sys.executable:
        env["PYTHONPATH"] = str(tree.resolve())
    proc = subprocess.Popen(
        [python, "-m", "haru.cli", "gateway", "--port", "0", "--nats-url", nats_url, "--log-format", "json"],
        cwd=tree,
        env=env,
        stdout=out,
        stderr=out,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if line.startswith("haru gateway listening on "):
                return proc, line.rsplit(" ", 1)[1]
        if proc.poll() is not None:
            raise SystemExit(f"haru gateway from {tree} exited: {log_path.read_text()}")
        time.sleep(0.02)
    raise SystemExit(f"haru gateway from {tree} did not start")


def wait_routable(gw: str) -> None:
    import urllib.request

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(gw + "/v1/models") as r:
                data = json.loads(r.read())["data"]
                if data and data[0]["haru"]["routable"]:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit("the gateway never routed the model")


def measure(direct: str, gateway: str, kind: str, conns: int, args: argparse.Namespace) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--_load",
            "--url",
            direct,
            "--url2",
            gateway,
            "--kind",
            kind,
            "--conns",
            str(conns),
            "--duration",
            str(args.duration),
            "--warmup",
            str(args.warmup),
            "--client",
            args.client,
            "--slices",
            str(args.slices),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=4.0, help="seconds measured per scenario")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument(
        "--upstream",
        choices=("both", "sim", "fast"),
        default="both",
        help="sim: the vLLM simulator (the issue's baseline); fast: a minimal upstream (stricter); both",
    )
    p.add_argument("--client", choices=("raw", "aiohttp"), default="raw")
    p.add_argument(
        "--slices",
        type=int,
        default=6,
        help="direct and gateway alternate in this many slices of each scenario's duration",
    )
    p.add_argument("--_upstream", metavar="PORT_FILE", help=argparse.SUPPRESS)
    p.add_argument("--_load", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--url2", help=argparse.SUPPRESS)
    p.add_argument("--kind", help=argparse.SUPPRESS)
    p.add_argument("--conns", type=int, help=argparse.SUPPRESS)
    p.add_argument(
        "--consoles",
        type=int,
        default=0,
        help="measure again with this many consoles open and live, and print both (issue 18: 20)",
    )
    p.add_argument("--churn-hz", type=float, default=5.0, help="with --consoles: fleet view changes per second")
    p.add_argument("--_consoles", metavar="STOP_FILE", help=argparse.SUPPRESS)
    p.add_argument("--nats", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._upstream:
        return run_fast_upstream(args._upstream)
    if args._load:
        return run_load(args)
    if args._consoles:
        return asyncio.run(run_consoles(args))

    from haru.host.natsd import NatsServer

    kinds = ("sim", "fast") if args.upstream == "both" else (args.upstream,)
    for kind in kinds:
        with tempfile.TemporaryDirectory() as tmpdir:
            tmp = Path(tmpdir)
            nats = NatsServer(tmp / "nats")
            nats.start_sync()
            procs: list[subprocess.Popen] = []
            try:
                up_proc, upstream = start_upstream(kind, tmp)
                procs.append(up_proc)
                asyncio.run(publish_fleet(nats.url, upstream))
                gw_proc, gw = start_gateway(nats.url, tmp)
                procs.append(gw_proc)
                wait_routable(gw)
                quiet = bench_one(kind, upstream, gw, args)
                if args.consoles:
                    with consoles_open(args, gw, nats.url, upstream, tmp) as stats:
                        busy = bench_one(
                            kind,
                            upstream,
                            gw,
                            args,
                            note=f"with {args.consoles} consoles open, view changing {args.churn_hz:g}/s",
                        )
                    print_side_by_side(kind, args, quiet, busy, stats)
            finally:
                for proc in procs:
                    proc.terminate()
                for proc in procs:
                    try:
                        proc.wait(10)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                nats.stop_sync()
        print()


def bench_one(kind: str, upstream: str, gw: str, args: argparse.Namespace, note: str = "") -> dict:
    print(
        f"== upstream={kind} client={args.client} {args.duration}s per target and scenario, in {args.slices} "
        f"alternating slices; cpus={os.cpu_count()} load={os.getloadavg()[0]:.1f}" + (f"; {note}" if note else "")
    )
    print(f"{'scenario':<14}{'target':<9}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'ttft50':>9}{'err':>5}")
    results: dict[tuple[str, int], dict[str, dict]] = {}
    for body_kind in ("json", "sse"):
        for conns in (1, 32):
            pair = measure(upstream, gw, body_kind, conns, args)
            for target in ("direct", "gateway"):
                r = pair[target]
                print(
                    f"{body_kind + ' x' + str(conns):<14}{target:<9}{r['rps']:>9.0f}{r['p50'] * 1e3:>9.3f}"
                    f"{r['p99'] * 1e3:>9.3f}{r['ttft_p50'] * 1e3:>9.3f}{r['errors']:>5}",
                    flush=True,
                )
            results[(body_kind, conns)] = pair
    print(f"gateway vs direct, upstream={kind}")
    verdicts = []
    for (body_kind, conns), pair in results.items():
        d, g = pair["direct"], pair["gateway"]
        line = (
            f"  {body_kind:<4} x{conns:<3} throughput {g['rps'] / d['rps']:.2f}x   "
            f"added p50 {(g['p50'] - d['p50']) * 1e3:+.3f} ms   added p99 {(g['p99'] - d['p99']) * 1e3:+.3f} ms"
        )
        if body_kind == "sse":
            line += f"   TTFT {g['ttft_p50'] / d['ttft_p50']:.2f}x ({(g['ttft_p50'] - d['ttft_p50']) * 1e3:+.3f} ms)"
        print(line)
        if body_kind == "json" and conns == 1:
            added = (g["p50"] - d["p50"]) * 1e3
            verdicts.append(
                f"added p50 at 1 connection {added:.3f} ms (target <= 0.5): {'met' if added <= 0.5 else 'MISSED'}"
            )
        if body_kind == "json" and conns == 32:
            ratio = g["rps"] / d["rps"]
            goal = 0.6 if kind == "fast" else 0.5  # issue 20 raised the fast upstream's from issue 7's 0.5
            verdicts.append(
                f"throughput at 32 connections {ratio:.2f}x direct (target >= {goal}): "
                f"{'met' if ratio >= goal else 'MISSED'}"
            )
    for v in verdicts:
        print(f"  [{kind}] {v}")
    return results


# ---------------------------------------------------------------------------------- consoles open


async def run_consoles(args: argparse.Namespace) -> None:
    """N consoles reading /ui/events, and a writer changing the fleet view, until STOP_FILE appears.
    Prints {"frames": [...per console], "changes": n} on stdout."""
    import aiohttp
    import msgspec

    from haru.core import subjects
    from haru.core.views import view_decoder, view_encoder
    from haru.log.eventlog import EventLog

    stop_file = Path(args._consoles)
    frames = [0] * args.consoles
    opened = [0]

    async def console(i: int, session: aiohttp.ClientSession) -> None:
        async with session.get(args.url + "/ui/events") as resp:
            assert resp.status == 200, resp.status
            opened[0] += 1
            async for chunk in resp.content.iter_any():
                frames[i] += chunk.count(b"event: fleet")

    changes = 0
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session,
        EventLog.connect([args.nats], writer="bench-consoles") as log,
    ):
        tasks = [asyncio.create_task(console(i, session)) for i in range(args.consoles)]
        key = subjects.view_key("default")
        while opened[0] < args.consoles:
            await asyncio.sleep(0.05)
        print("open", flush=True)
        period = 1 / args.churn_hz if args.churn_hz > 0 else None
        while not stop_file.exists():
            if period is None:
                await asyncio.sleep(0.1)
                continue
            data, rev = await log.get_view(key)
            view = view_decoder.decode(data)
            view = msgspec.structs.replace(view, seq=view.seq + 1)  # a newer view: applied and fanned out
            await log.put_view(key, view_encoder.encode(view), last=rev)
            changes += 1
            await asyncio.sleep(period)
        await asyncio.sleep(0.5)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    print(json.dumps({"frames": frames, "changes": changes}), flush=True)


class consoles_open:
    """Context manager: the console process runs inside it; `stats` is filled when it ends."""

    def __init__(self, args: argparse.Namespace, gw: str, nats_url: str, upstream: str, tmp: Path) -> None:
        self.args, self.gw, self.nats_url, self.tmp = args, gw, nats_url, tmp
        self.stats: dict = {}

    def __enter__(self) -> dict:
        self.stop = self.tmp / "consoles.stop"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--_consoles",
                str(self.stop),
                "--consoles",
                str(self.args.consoles),
                "--churn-hz",
                str(self.args.churn_hz),
                "--url",
                self.gw,
                "--nats",
                self.nats_url,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        if line.strip() != "open":
            raise SystemExit(f"the consoles did not open: {line!r}")
        return self.stats

    def __exit__(self, *exc: object) -> None:
        self.stop.write_text("stop")
        out, _ = self.proc.communicate(timeout=30)
        self.stats.update(json.loads(out.strip().splitlines()[-1]))


def fanout_cost_us(consoles: int, upstream: str, rounds: int = 2000) -> float:
    """CPU per view change of the console fan-out itself (snapshot encoded once, offered to every
    console), measured in this process on the bench's own view: the part of a change the proxy shares
    its core with. Writing to the sockets is the event loop's, and is in the side-by-side figures."""
    from haru.core.residency import Answer, Resident
    from haru.core.views import DomainView, FleetView, ModelView, RouteIntent, Target
    from haru.gateway.console import Console, _Subscriber
    from haru.gateway.routing import RoutingTable

    table = RoutingTable()
    view = FleetView(
        fleet="default",
        active="a",
        route_revision=1,
        seq=1,
        domains={
            "a": DomainView(
                name="a",
                serving_url=upstream,
                models={MODEL: ModelView(name=MODEL, admitted=True, residency=Resident())},
            )
        },
    )
    table.set_view("default", view)
    table.set_intent(
        "default",
        RouteIntent(
            fleet="default",
            revision=1,
            active=Target(domain="a", serving_url=upstream),
            answers={MODEL: Answer(answer="ready")},
        ),
        1,
    )

    async def run() -> float:
        console = Console(table, None)
        subs = [_Subscriber() for _ in range(consoles)]
        console.subscribers.update(subs)
        t0 = time.process_time()
        for _ in range(rounds):
            console._dirty.add("default")
            console._send()
            for sub in subs:
                sub.pending.clear()
                sub.wake.clear()
        return (time.process_time() - t0) / rounds * 1e6

    return asyncio.run(run())


def print_side_by_side(kind: str, args: argparse.Namespace, quiet: dict, busy: dict, stats: dict) -> None:
    frames = stats.get("frames", [])
    cost = fanout_cost_us(args.consoles, "http://127.0.0.1:1")
    print(
        f"console fan-out: {cost:.1f} us of CPU per view change with {args.consoles} consoles "
        f"({cost * args.churn_hz / 1e4:.4f}% of a core at {args.churn_hz:g} changes/s)"
    )
    print(
        f"consoles: {len(frames)} open, {stats.get('changes', 0)} view changes, frames received per console "
        f"min {min(frames, default=0)} max {max(frames, default=0)}"
    )
    print(f"gateway vs direct, upstream={kind}: no console | {args.consoles} consoles live")
    for key, q in quiet.items():
        b = busy[key]
        body_kind, conns = key
        qr, br = q["gateway"]["rps"] / q["direct"]["rps"], b["gateway"]["rps"] / b["direct"]["rps"]
        qa, ba = (q["gateway"]["p50"] - q["direct"]["p50"]) * 1e3, (b["gateway"]["p50"] - b["direct"]["p50"]) * 1e3
        print(f"  {body_kind:<4} x{conns:<3} throughput {qr:.2f}x | {br:.2f}x   added p50 {qa:+.3f} | {ba:+.3f} ms")


if __name__ == "__main__":
    main()
