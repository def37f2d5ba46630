"""A fleet spread over the region harness, its client load and the history checker.

`RegionFleet` places, on a `Regions` harness whose NATS cluster runs: domain a's agent in region 1 (the
active), domain b's agent in region 2 (the standby), a promoter, a projector and a gateway in every
region, each connected to its own region's node first and to the others through the delay proxy, and a
witness writer in regions 1 and 3 (tests/support/witness.py) that records every append it was
acknowledged. The agents run simulated GPUs and the vLLM simulator; their serving ports listen on their
region's address with a serving token, so a gateway in any region reaches the active.

`ClientLoad` is closed-loop JSON and SSE clients through one gateway; `check_history` is the checker
every scenario ends with: each acknowledged witness append is in the log with its content, `haru verify`
passes, the route moves form one line, and every operation that started ended.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import aiohttp
import msgspec
import nats
import nats.errors

from haru.agents.sim.gpu_state import GiB, SimGpuState
from haru.core import subjects
from haru.core.errors import LogError, LogUnavailable
from haru.core.events import (
    FleetDeclared,
    OperationAborted,
    OperationCompleted,
    RouteMoved,
)
from haru.log.eventlog import EventLog
from tests.support.agent_harness import sim_model
from tests.support.regions import Proc, Regions, ensure_streams, region_of

FLEET = "rf"
MODEL = "m1"
TOKEN = "region-test-token"
GATEWAY_PORT = 8700
SERVING_PORT = 9100
DOMAINS = {"a": 1, "b": 2}  # domain -> region of its host
POLICY = {
    "probe_interval_ms": 200,
    "restart_backoff_ms": 200,
    "restart_backoff_max_ms": 1000,
    "training_grace_ms": 500,
    # a loaded 2-core machine has shown 2.7 s scheduling gaps: 4 s of silence is a lost host, not a slow one
    "heartbeat_timeout_ms": 4000,
    # an aborted automatic operation (a standby's settling that met a leader election) is retried after
    # max(degraded_grace_ms, heartbeat_timeout_ms): seconds here, not the default minute
    "degraded_grace_ms": 3000,
    "probe_timeout_ms": 3000,
    "wake_timeout_ms": 10000,
    "command_timeout_ms": 10000,
}
CHAT = [{"role": "user", "content": "hello"}]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(
        HARU_NO_UVLOOP="1",
        HARU_API_TOKEN=TOKEN,
        HARU_SERVING_TOKEN=TOKEN,
        HARU_GATEWAY_HOST="0.0.0.0",
        HARU_DEFAULT_FLEET=FLEET,
        # A request in flight to a lost region waits for the majority's verdict (heartbeat timeout plus,
        # when the region led the streams, JetStream's elections: up to ~30 s seen on a loaded 2-core
        # machine). The header timeout must exceed that or it answers 504 first (docs/deploy.md).
        HARU_CHAT_HEADER_TIMEOUT_MS="90000",
    )
    return e


def haru_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "haru.cli", *args]


@dataclass
class RegionFleet:
    rg: Regions
    root: Path
    procs: dict[str, Proc] = field(default_factory=dict)
    agent_config: dict[str, dict] = field(default_factory=dict)  # domain -> settings added to its agent's config
    # `haru promoter --stream-leaders` ('': the streams' leaders where JetStream elects them)
    stream_leaders: str = ""

    def layout(self) -> Path:
        domains, slots = [], []
        for d, r in DOMAINS.items():
            sim_dir = self.root / "sim" / d
            sim_dir.mkdir(parents=True, exist_ok=True)
            SimGpuState(sim_dir, 0).ensure(24 * GiB)
            domains.append(
                {
                    "name": d,
                    "serving_url": f"http://{self.rg.ip(r)}:{SERVING_PORT}",
                    "gpus": [{"index": 0, "memory": "24GiB", "reserve": "1GiB"}],
                    "slots": [{"name": "chat", "gpu": 0, "models": [sim_model(MODEL, sim_dir, d, vram="4GiB")]}],
                }
            )
        del slots
        path = self.root / "layout.json"
        path.write_text(json.dumps({"fleet": FLEET, "policy": POLICY, "domains": domains}))
        return path

    def urls(self, region: int) -> str:
        return ",".join(self.rg.nats_urls(region))

    async def start(self) -> None:
        layout = self.layout()
        await ensure_streams(self.rg.test_urls())
        subprocess.run(
            haru_cli("apply", "-f", str(layout), "--nats-url", ",".join(self.rg.test_urls())),
            check=True,
            capture_output=True,
            env=env(),
            timeout=60,
        )
        for r in self.rg.regions():
            keep = ["--stream-leaders", self.stream_leaders] if self.stream_leaders else []
            argv = haru_cli("promoter", "--id", f"promoter-r{r}", "--nats-url", self.urls(r), *keep)
            self.spawn(r, f"promoter-r{r}", argv)
            self.spawn(r, f"projector-r{r}", haru_cli("projector", "--nats-url", self.urls(r)))
            self.spawn(r, f"gateway-r{r}", haru_cli("gateway", "--port", str(GATEWAY_PORT), "--nats-url", self.urls(r)))
        for d, r in DOMAINS.items():
            cfg = {
                "nats_url": self.rg.nats_urls(r),
                "fleet": FLEET,
                "domain": d,
                "gpus": "sim",
                "sim_dir": str(self.root / "sim" / d),
                "serving": {"host": "0.0.0.0", "port": SERVING_PORT},
                "state_dir": str(self.root / "state" / d),
                "layout": str(layout),
                **self.agent_config.get(d, {}),
            }
            path = self.root / f"agent-{d}.json"
            path.write_text(json.dumps(cfg))
            self.spawn(r, f"agent-{d}", haru_cli("agent", "--config", str(path), "--log-format", "json"))
        for r in (1, 3):
            self.spawn(r, f"witness-r{r}", self.witness_argv(r))

    def witness_argv(self, region: int) -> list[str]:
        out = self.root / f"witness-r{region}.acks"
        return [
            sys.executable,
            "-m",
            "tests.support.witness",
            "--nats-url",
            self.urls(region),
            "--fleet",
            f"witness-r{region}",
            "--out",
            str(out),
        ]

    def spawn(self, region: int, name: str, argv: list[str]) -> Proc:
        proc = self.rg.spawn(region, name, argv, env())
        self.procs[name] = proc
        return proc

    def gateway_url(self, region: int) -> str:
        return f"http://{self.rg.ip(region)}:{GATEWAY_PORT}"

    def dead(self) -> list[str]:
        """The processes that exited although nothing killed them (their output's tail each)."""
        return [f"{n}: {p.output(1500)}" for n, p in self.procs.items() if not p.alive and p.region not in self.rg.down]

    def kill_agents_runtimes(self) -> None:
        from tests.support.agent_harness import kill_runtimes

        for d in DOMAINS:
            kill_runtimes(self.root / "state" / d)


async def view(region: int, rg: Regions) -> dict | None:
    """The fleet's view as region's gateway serves it (None when it does not answer)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as s:
            async with s.get(
                f"http://{rg.ip(region)}:{GATEWAY_PORT}/v1/fleets/{FLEET}",
                headers={"Authorization": f"Bearer {TOKEN}"},
            ) as r:
                return await r.json() if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------- load


class ClientLoad:
    """Closed-loop clients through one gateway; every finished request is kept as (start, end, kind, outcome)."""

    def __init__(self, gateway: str, json_clients: int = 2, sse_clients: int = 1) -> None:
        self.gateway = gateway
        self.json_clients, self.sse_clients = json_clients, sse_clients
        self.done: list[tuple[float, float, str, str]] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _one(self, s: aiohttp.ClientSession, stream: bool) -> None:
        body: dict = {"model": MODEL, "messages": CHAT, "max_tokens": 16 if stream else 8}
        if stream:
            body["stream"] = True
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                async with s.post(self.gateway + "/v1/chat/completions", json=body) as r:
                    data = await r.read()
                    if r.status != 200:
                        outcome = f"failed:{r.status} {data[:200]!r}"
                    elif not stream:
                        outcome = "ok"
                    elif b'data: {"error"' in data:
                        outcome = f"failed:error_event {data[-300:]!r}"
                    else:
                        outcome = "ok" if data.rstrip().endswith(b"data: [DONE]") else "cut"
            except (aiohttp.ClientError, TimeoutError) as exc:
                outcome = f"failed:{type(exc).__name__}"
            self.done.append((t0, time.monotonic(), "sse" if stream else "json", outcome))

    async def __aenter__(self) -> ClientLoad:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=120), headers={"Authorization": f"Bearer {TOKEN}"}
        )
        self._tasks = [asyncio.create_task(self._one(self._session, False)) for _ in range(self.json_clients)]
        self._tasks += [asyncio.create_task(self._one(self._session, True)) for _ in range(self.sse_clients)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._session.close()

    def bad(self) -> list[str]:
        return [o for _, _, _, o in self.done if o != "ok"]

    def since(self, t: float) -> list[tuple[float, float, str, str]]:
        return [d for d in self.done if d[0] >= t]


def p99(xs: list[float]) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


# ------------------------------------------------------------------------------------------- checker


@dataclass
class History:
    route: list[tuple[int, str]]  # (sequence, active) of each route_moved, in order
    ops: dict[str, list[str]]  # op id -> the types of its events, in order
    witnesses: dict[str, int]  # witness -> acknowledged appends checked
    story: str = ""  # the fleet's operations, route moves and liveness verdicts, one line each, in order

    def told(self) -> str:
        """For an assertion's message: what the log says happened, so a failure explains itself."""
        return "the log says:\n" + self.story


async def check_history(fleet: RegionFleet) -> History:
    """Read the whole history through the majority and assert what every scenario must leave behind.
    A heal right before makes leaders move (the cut-off side's higher Raft terms): reads are retried
    for a bounded time while JetStream answers that it is unavailable."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return await _check_history(fleet)
        except (LogUnavailable, LogError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def replicas_current(urls: list[str], down: set[int], stream: str = subjects.EVENTS_STREAM) -> str:
    """Why `stream` cannot be read whole from every reachable node yet ('' = it can): its leader must
    be known and each replica in a region that is not down must be current with no lag. A read is served
    by the node it lands on; a node just healed from a partition answers with what it has until it has
    caught up, so a checker that reads before then finds acknowledged appends missing that are not lost."""
    nc = await nats.connect(servers=urls, connect_timeout=2, max_reconnect_attempts=0)
    try:
        info = await nc.jetstream(timeout=2).stream_info(stream)
    except (nats.errors.Error, TimeoutError) as exc:
        return f"{stream}: no stream info ({type(exc).__name__})"
    finally:
        await nc.close()
    cluster = info.cluster
    if cluster is None or not cluster.leader:
        return f"{stream}: no leader"
    behind = [
        f"{p.name} (current={p.current}, lag={p.lag}, offline={p.offline})"
        for p in cluster.replicas or []
        if region_of(p.name) not in down and (p.offline or not p.current or (p.lag or 0) > 0)
    ]
    return f"{stream}: replicas behind the leader {cluster.leader}: {', '.join(behind)}" if behind else ""


async def _check_history(fleet: RegionFleet) -> History:
    rg, problems = fleet.rg, []
    # Every acknowledged append read below was acknowledged before this wait: once each reachable replica
    # is current, whichever node serves the reads holds them all.
    acked = {f"witness-r{r}": (fleet.root / f"witness-r{r}.acks").read_text().split() for r in (1, 3)}
    deadline = time.monotonic() + 30
    while why := await replicas_current(rg.test_urls(), set(rg.down)):
        if time.monotonic() > deadline:
            raise AssertionError(f"the event stream's replicas did not catch up within 30 s: {why}")
        await asyncio.sleep(0.2)
    async with EventLog.connect(rg.test_urls(), writer="test:checker") as log:
        witnesses = {}
        for r in (1, 3):
            name = f"witness-r{r}"
            acks = acked[name]
            stored = {rec.seq: rec for rec in await log.history(subjects.decl(name))}
            for seq_s, at_s in zip(acks[::2], acks[1::2], strict=True):
                rec = stored.get(int(seq_s))
                if rec is None or not isinstance(rec.event, FleetDeclared):
                    problems.append(f"{name}: acknowledged append {seq_s} is not in the log")
                elif rec.event.at != datetime.fromisoformat(at_s):
                    problems.append(f"{name}: sequence {seq_s} holds another event than the one acknowledged")
            # read again after the history: acknowledgements that came in since the first read count too
            later = (fleet.root / f"{name}.acks").read_text().split()
            extra = set(stored) - {int(s) for s in later[::2]}
            # an append the witness sent but whose ack it never got (the region was cut) may be stored once
            if len(extra) > 1:
                problems.append(f"{name}: {len(extra)} stored appends were never acknowledged")
            witnesses[name] = len(acks) // 2
        moves = [(rec.seq, rec.event) for rec in await log.history(subjects.route(FLEET))]
        route = [(seq, e.active) for seq, e in moves if isinstance(e, RouteMoved)]
        for (_, a), (_, b) in zip(route, route[1:], strict=False):
            if a == b:
                problems.append(f"the route moved to {b} while already there: {route}")
        ops: dict[str, list[str]] = {}
        for rec in await log.history(subjects.op(FLEET)):
            op_id = getattr(rec.event, "op_id", None)
            if op_id:
                ops.setdefault(op_id, []).append(type(rec.event).__name__)
        told = await log.history(subjects.op(FLEET)) + await log.history(subjects.route(FLEET))
        for d in DOMAINS:
            told += await log.history(subjects.liveness(FLEET, d))
        story = "\n".join(
            f"  {rec.seq} {rec.subject.rsplit('.', 2)[-1]} {msgspec.json.encode(rec.event).decode()[:400]}"
            for rec in sorted(told, key=lambda r: r.seq)
        )
        for op_id, kinds in ops.items():
            if kinds[0].endswith("Requested") and not (
                OperationCompleted.__name__ in kinds or OperationAborted.__name__ in kinds
            ):
                problems.append(f"operation {op_id} never ended: {kinds}")
    verify = subprocess.run(
        haru_cli("verify", "--nats-url", ",".join(rg.test_urls())),
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
    )
    if verify.returncode != 0 and "JetStream did not answer" in verify.stderr + verify.stdout:
        raise LogUnavailable(f"haru verify could not read the log yet: {verify.stderr[-300:]}")
    if verify.returncode != 0:
        problems.append(f"haru verify failed: {verify.stdout[-1500:]} {verify.stderr[-1500:]}")
    assert not problems, "\n".join(problems) + "\nthe log says:\n" + story
    return History(route, ops, witnesses, story)


# ------------------------------------------------------------ waiting on the fleet, as the scenarios do


async def wait_for(check, timeout: float, what: str, fleet: RegionFleet):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await check()
        if got:
            return got
        await asyncio.sleep(0.2)
    seen = {r: brief(await view(r, fleet.rg)) for r in fleet.rg.regions() if r not in fleet.rg.down}
    promoters = {n: p.output(1200) for n, p in fleet.procs.items() if n.startswith("promoter")}
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what}; exited: {fleet.dead()}; views: {seen}; promoters: {promoters}"
    )


def brief(v: dict | None) -> str:
    """A view in one line: the active, the operation, and each domain's state, reachability and eligibility."""
    if not v:
        return "no view"
    doms = {
        d: (state(v, d), "reachable" if dv.get("reachable") else "unreachable", dv.get("ineligible_why") or "eligible")
        for d, dv in v["domains"].items()
    }
    return f"active={v.get('active')} operation={v.get('operation')} domains={doms}"


def state(v: dict, domain: str) -> str:
    return v["domains"][domain]["models"]["m1"]["residency"]["state"]


async def settled_in(region: int, rg: Regions) -> dict | None:
    """One domain active and resident, the other asleep, reachable and eligible, no operation: whichever."""
    v = await view(region, rg)
    if not v or v["operation"] is not None or v["active"] not in ("a", "b"):
        return None
    active = v["active"]
    standby = "b" if active == "a" else "a"
    ok = (
        state(v, active) == "resident"
        and state(v, standby) == "sleeping"
        and v["domains"][standby]["reachable"]
        and v["domains"][active]["reachable"]
    )
    return v if ok else None


async def serving_in(region: int, rg: Regions, active: str):
    v = await view(region, rg)
    return v if v and v["active"] == active and state(v, active) == "resident" and v["operation"] is None else None
