"""The agent's loops survive a raising dependency: the failure is logged with its traceback, counted
by loop name (haru_agent_loop_errors_total{loop}), and the loop goes on."""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime
from types import SimpleNamespace as NS

import msgspec
import pytest
import structlog
from prometheus_client import generate_latest

from haru.agents.gpu import GpuReading, SimGpus
from haru.agents.gpu_watch import GpuWatcher
from haru.agents.heartbeat import Heartbeats, heartbeat_of
from haru.agents.loops import LoopErrors
from haru.agents.metrics import registry_for
from haru.agents.sim.gpu_state import SimGpuState
from haru.core.commands import Heartbeat
from haru.core.events import GpuObserved
from haru.core.sizes import GiB
from haru.core.specs import Policy
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(30)


async def test_the_heartbeat_loop_survives_a_failing_publish_and_counts_each_failure():
    published: list[bytes] = []
    failures = 3

    async def publish(data: bytes) -> None:
        nonlocal failures
        if failures:
            failures -= 1
            raise ConnectionResetError("nats: connection reset")
        published.append(data)

    def beat() -> Heartbeat:
        return heartbeat_of(
            fleet="f",
            domain="a",
            role="standby",
            models={"m": "sleeping", "n": "sleeping"},
            training=["lora"],
            pid=7,
            at=datetime(2026, 12, 1, tzinfo=UTC),
        )

    errors = LoopErrors()
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(
            Heartbeats(publish, beat, interval_s=0.01, errors=errors, logger=structlog.get_logger("test")).run()
        )
        try:
            await wait_until(lambda: len(published) >= 2, 5.0, interval_s=0.005)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert errors["heartbeat"] == 3  # every failure counted; the loop kept beating after them
    hb = msgspec.json.decode(published[0], type=Heartbeat)
    assert hb.summary == "standby; 2 sleeping; training lora" and hb.pid == 7
    failed = [e for e in logs if e["event"].startswith("agent loop step failed")]
    assert len(failed) == 3 and failed[0]["loop"] == "heartbeat" and failed[0]["exc_info"] is True
    assert [e["errors"] for e in failed] == [1, 2, 3]


class FlakyGpus:
    """The simulated GPUs, with GPU 0's reads raising as a broken NVML binding would."""

    def __init__(self, inner: SimGpus) -> None:
        self.inner = inner
        self.reads = {0: 0, 1: 0}

    def read(self, index: int) -> GpuReading:
        self.reads[index] += 1
        if index == 0:
            raise RuntimeError("NVML_ERROR_UNKNOWN")
        return self.inner.read(index)

    def close(self) -> None:
        pass


async def test_the_gpu_loop_survives_a_raising_read_and_keeps_observing_the_other_gpus(tmp_path):
    SimGpuState(tmp_path, 1).ensure(24 * GiB)
    gpus = FlakyGpus(SimGpus(tmp_path))
    appended: list[tuple[str, object, int]] = []

    async def append(subject: str, event, expect: int) -> int:
        appended.append((subject, event, expect))
        return len(appended)

    errors = LoopErrors()
    watcher = GpuWatcher(
        fleet="f",
        domain="a",
        gpus=gpus,
        append=append,
        owners=lambda index: [],
        exclude_pid=0,
        logger=structlog.get_logger("test"),
    )
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(watcher.run(lambda: [0, 1], lambda: 0.01, errors))
        try:
            await wait_until(lambda: errors["gpus"] >= 3, 5.0, interval_s=0.005)
            SimGpuState(tmp_path, 1).allocate(os.getpid(), 2 * GiB)  # a change on the healthy GPU is still recorded
            await wait_until(lambda: len(appended) >= 2, 5.0, interval_s=0.005)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert errors["gpus"] >= 3 and gpus.reads[1] >= 3
    subjects = {s for s, _e, _x in appended}
    assert subjects == {"haru.evt.f.a.gpu.1"}
    first, second = appended[0][1], appended[1][1]
    assert isinstance(first, GpuObserved) and first.present and first.memory_used_bytes == 0
    assert isinstance(second, GpuObserved) and second.memory_used_bytes == 2 * GiB and appended[1][2] == 1
    failed = [e for e in logs if e["event"].startswith("agent loop step failed")]
    assert failed and all(e["loop"] == "gpus" and e["gpu"] == 0 for e in failed)


def test_loop_errors_are_exported_per_loop():
    errors = LoopErrors()
    errors.count("heartbeat")
    errors.count("gpus")
    errors.count("gpus")
    status = NS(
        fleet="f",
        domain="a",
        models=NS(models={}),
        training=NS(trainers={}),
        live=NS(slots=NS(gpu_indexes=lambda: [], policy=Policy())),
        gpu_watch=NS(last={}),
        role=NS(now="standby", revision=3),
    )
    agent = NS(status=status, loop_errors=errors)
    text = generate_latest(registry_for(agent)).decode()
    assert 'haru_agent_loop_errors_total{domain="a",fleet="f",loop="gpus"} 2.0' in text
    assert 'haru_agent_loop_errors_total{domain="a",fleet="f",loop="heartbeat"} 1.0' in text
    assert 'haru_agent_loop_errors_total{domain="a",fleet="f",loop="supervise"} 0.0' in text


async def test_a_supervisor_survives_a_raising_append_counts_it_and_loads_on_the_next_attempt(tmp_path):
    """The model's supervisor, its recorder and the decision table for real, against the vLLM simulator
    served in-process (an `external` runtime in front of it); the event log's append raises once."""
    import aiohttp
    from aiohttp import web

    from haru.agents.model_slot import ModelSlot
    from haru.agents.recorder import Recorder
    from haru.agents.runtime_files import RuntimeFiles
    from haru.agents.runtimes import make_runtime
    from haru.agents.sim.vllm_app import build_app
    from haru.agents.sim.vllm_config import SimConfig
    from haru.agents.sim.vllm_engine import Engine
    from haru.agents.supervisor import ModelSupervisor, SupervisorContext
    from haru.core.specs import ModelSpec

    SimGpuState(tmp_path, 0).ensure(24 * GiB)
    config = SimConfig(
        source="m",
        names=("m",),
        host="127.0.0.1",
        port=0,
        sleep_mode=False,
        dev_mode=False,
        sim_dir=tmp_path,
        gpu_index=0,
        domain="a",
        vram=GiB,
        residual=0,
        gpu_memory=24 * GiB,
        load_ms=0,
        wake_ms=0,
        sleep_ms=0,
        tokens_per_s=1000.0,
    )
    runner = web.AppRunner(build_app(Engine(config=config, gpu=SimGpuState(tmp_path, 0))))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    appended: list[tuple[str, object]] = []
    raised = []

    async def append(subject: str, event, expect: int) -> int:
        if not raised:
            raised.append(event)
            raise RuntimeError("a bug in the log adapter")
        appended.append((subject, event))
        return len(appended)

    logger = structlog.get_logger("test")
    errors = LoopErrors()
    stop = asyncio.Event()
    tasks: list[asyncio.Task] = []
    policy = Policy(restart_backoff_ms=10, restart_backoff_max_ms=20, probe_interval_ms=50)

    def spawn(coro, name: str) -> asyncio.Task:
        tasks.append(asyncio.ensure_future(coro))
        return tasks[-1]

    async def no_training(*_args):
        return []

    gpus = SimGpus(tmp_path)
    watcher = GpuWatcher(
        fleet="f",
        domain="a",
        gpus=gpus,
        append=append,
        owners=lambda index: [],
        exclude_pid=0,
        logger=logger,
    )
    recorder = Recorder(
        domain="a", append=append, gpu=watcher, agent_seq=lambda: 1, stopping=stop.is_set, logger=logger
    )
    async with aiohttp.ClientSession() as session:
        spec = ModelSpec(
            name="m", slot="s", gpu_index=0, vram_bytes=GiB, runtime="external", url=f"http://127.0.0.1:{port}"
        )
        m = ModelSlot(
            spec,
            make_runtime(spec, session=session, log_dir=tmp_path, bind_host="127.0.0.1", gpu_memory_bytes=24 * GiB),
            "haru.evt.f.a.model.m",
        )
        ctx = SupervisorContext(
            domain="a",
            record=recorder.record,
            about=recorder.about,
            gpu=watcher,
            files=RuntimeFiles(tmp_path, logger=logger),
            role=NS(now="active"),
            policy=lambda: policy,
            stopping=stop.is_set,
            stop_event=stop,
            spawn=spawn,
            make_room=no_training,
            resume_training=no_training,
            errors=errors,
            logger=logger,
        )
        with structlog.testing.capture_logs() as logs:
            task = asyncio.create_task(ModelSupervisor(m, ctx).run())
            try:
                await wait_until(lambda: m.state_tag == "resident", 15, interval_s=0.005)
            finally:
                stop.set()
                task.cancel()
                await asyncio.gather(task, *tasks, return_exceptions=True)
    await runner.cleanup()
    assert errors["supervise"] == 1  # the attempt whose append raised: counted, and supervision went on
    assert type(raised[0]).__struct_config__.tag == "model_loading"
    assert [type(e).__struct_config__.tag for _s, e in appended] == ["model_loading", "model_resident"]
    assert appended[0][1].attempt == 2  # a new attempt after the backoff, recorded afresh
    failed = [e for e in logs if e["event"].startswith("supervision attempt failed")]
    assert len(failed) == 1 and failed[0]["exc_info"] is True and failed[0]["errors"] == 1
