"""A two-domain fleet of real `haru agent` processes on the simulated runtime and GPU (`sim_fleet`), its
layout, the load the tests put on it, and the residency events they wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from haru.agents.sim.gpu_state import GiB, SimGpuState
from haru.core import subjects
from haru.core.layout import load_layout
from haru.host.children import alive as proc_alive
from haru.log.apply import apply
from tests.support.agent_harness import FAST_POLICY, REPO, AgentProcess, sim_model, tag, write_config
from tests.support.ports import lasting_port

FLEET = "default"
MODELS = ("m1", "m2")
# These fleets restart their agents and expect no failover: an agent's restart (the old one's shutdown, a new
# interpreter's start, a `--dry-run` beside it) took over 6 s on a loaded two-core CI, and the promoter rightly
# failed the silent active over. Silence is what other tests time.
RESTART_HEARTBEAT_TIMEOUT_MS = 15_000
POLICY = {**FAST_POLICY, "heartbeat_timeout_ms": RESTART_HEARTBEAT_TIMEOUT_MS}


def outliving_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("HARU_SERVING_TOKEN", None)
    return env


def sim_layout(path: Path, tmp: Path) -> Path:
    domains = []
    for d in ("a", "b"):
        sim_dir = tmp / "sim" / d
        sim_dir.mkdir(parents=True, exist_ok=True)
        SimGpuState(sim_dir, 0).ensure(24 * GiB)
        ms = [sim_model(name, sim_dir, d, vram="4GiB") for name in MODELS]
        domains.append(
            {
                "name": d,
                "gpus": [{"index": 0, "memory": "24GiB", "reserve": "1GiB"}],
                "slots": [{"name": "chat", "gpu": 0, "models": ms}],
                "serving_url": f"http://127.0.0.1:{lasting_port()}",
            }
        )
    path.write_text(json.dumps({"fleet": FLEET, "policy": POLICY, "domains": domains}))
    return path


def identities(state_dir: Path) -> dict[str, dict]:
    out = {}
    for f in sorted((state_dir / "runtimes").glob("*.json")):
        doc = json.loads(f.read_text())
        out[doc["model"]] = doc
    return out


def kill_leftovers(state_dir: Path) -> None:
    """Whatever outlived the test's agents: runtimes (identity files) and the serving port holder."""
    for doc in identities(state_dir).values():
        if proc_alive(doc["pid"], doc["start"]):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(doc["pid"], signal.SIGKILL)
    from haru.agents.portholder import stop_holder

    stop_holder(state_dir)


class Fleet:
    def __init__(self, tmp: Path, nats_url: str, layout: Path, gw, declared: bool = False) -> None:
        self.tmp, self.nats_url, self.layout, self.gw, self.declared = tmp, nats_url, layout, gw, declared
        self.agents: dict[str, AgentProcess] = {}

    def state_dir(self, d: str) -> Path:
        return self.tmp / "state" / d

    def start(self, d: str) -> AgentProcess:
        cfg = write_config(
            self.tmp / f"agent-{d}.json",
            self.nats_url,
            self.tmp,
            domain=d,
            layout=None if self.declared else self.layout,
            fleet=FLEET,
            serving={"host": "127.0.0.1", "port": 0},
        )
        self.agents[d] = AgentProcess(cfg, self.tmp / f"agent-{d}.log", outliving_env())
        return self.agents[d]

    async def stop(self) -> None:
        """Every agent stopped for good (SIGINT unloads its runtimes and closes its port holder), and
        whatever an agent killed earlier left behind killed."""
        for p in self.agents.values():
            p.signal(signal.SIGINT)
        for d, p in self.agents.items():
            with contextlib.suppress(Exception):
                await p.wait(30)
            p.kill()
            kill_leftovers(self.state_dir(d))


@contextlib.asynccontextmanager
async def sim_fleet(tmp_path, nats_server, event_log, layout: Path, *, declared: bool = False):
    from haru.gateway.config import GatewayConfig
    from haru.gateway.server import Gateway
    from haru.host.tasks import cancel_and_wait
    from haru.projections.projector import Projector
    from tests.support.promoter import promoters

    await apply(event_log, load_layout(layout), datetime.now(UTC))
    projector = asyncio.create_task(Projector(event_log).run(), name="projector")
    fleet = None
    try:
        async with promoters(nats_server.url):
            async with Gateway(GatewayConfig(port=0), event_log) as gw:
                fleet = Fleet(tmp_path, nats_server.url, layout, gw, declared)
                for d in ("a", "b"):
                    fleet.start(d)
                yield fleet
    finally:
        if fleet is not None:
            await fleet.stop()
        await cancel_and_wait(projector)


def steady(view) -> bool:
    from haru.core.residency import Resident, Sleeping

    return (
        view.active == "a"
        and view.operation is None
        and view.domains["b"].eligible
        and all(isinstance(m.residency, Resident) for m in view.domains["a"].models.values())
        and all(isinstance(m.residency, (Resident, Sleeping)) for m in view.domains["b"].models.values())
    )


class ChatLoad:
    """`clients` concurrent clients asking the gateway, each in a loop, until stopped. Counts answers."""

    def __init__(
        self,
        url: str,
        clients: int = 8,
        stream_every: int = 4,
        models: tuple[str, ...] = MODELS,
        pause_s: float = 0.0,
    ) -> None:
        """`pause_s`: each client's wait between two requests (a real runtime on a shared CPU: load enough to see
        every moment of a failover, without taking the CPU from everything else)."""
        self.url, self.clients, self.stream_every, self.models = url, clients, stream_every, models
        self.pause_s = pause_s
        self.ok = 0
        self.failed: list[tuple[float, str]] = []  # (monotonic time, what)
        self.killed_at = float("inf")  # the first SIGKILL of an agent
        self.streams: list[list[float]] = []  # [began, ended] (monotonic; ended inf while it runs) per stream
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _client(self, i: int) -> None:
        n = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            while not self._stop.is_set():
                n += 1
                model = self.models[(i + n) % len(self.models)]
                stream = n % self.stream_every == 0
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": f"hi {i} {n}"}],
                    "max_tokens": 16,
                    "stream": stream,
                }
                span = [time.monotonic(), float("inf")]
                if stream:
                    self.streams.append(span)
                try:
                    async with s.post(self.url + "/v1/chat/completions", json=body) as r:
                        raw = await r.read()
                        if r.status != 200 or (stream and b"[DONE]" not in raw):
                            self.failed.append((time.monotonic(), f"{model} {r.status} {raw[:300]!r}"))
                        else:
                            self.ok += 1
                except (TimeoutError, aiohttp.ClientError) as exc:
                    self.failed.append((time.monotonic(), f"{model} {exc!r}"))
                finally:
                    span[1] = time.monotonic()
                if self.pause_s:
                    await asyncio.sleep(self.pause_s)

    def streams_open_since(self, moment: float) -> int:
        """How many of the clients' streams were under way at `moment` (monotonic) or began after it."""
        return sum(1 for _, ended in self.streams if ended >= moment)

    async def __aenter__(self) -> ChatLoad:
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def residency_tags(event_log, d: str, model: str) -> list[str]:
    return [tag(r) for r in await event_log.history(subjects.model(FLEET, d, model))]


async def wait_adopted(event_log, d: str, model: str, count: int, agent: AgentProcess) -> None:
    deadline = time.monotonic() + 30
    while (await residency_tags(event_log, d, model)).count("model_adopted") < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{model}: {await residency_tags(event_log, d, model)}\n{agent.output()[-4000:]}")
        if agent.proc.poll() is not None:
            raise AssertionError(f"the agent exited:\n{agent.output()[-4000:]}")
        await asyncio.sleep(0.1)


def edit_layout(path, fn) -> None:
    doc = json.loads(path.read_text())
    for d in doc["domains"]:
        fn(d["name"], d["slots"][0]["models"])
    path.write_text(json.dumps(doc))


async def tags_become(event_log, d: str, model: str, since: int, want: list[str], timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        got = (await residency_tags(event_log, d, model))[since:]
        if got == want:
            return got
        assert time.monotonic() < deadline, f"{d}/{model}: {got}, wanted {want}"
        await asyncio.sleep(0.1)
