"""The runtime seam, one contract per implementation: vLLM (through the simulator), llama-server, external."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import aiohttp
import pytest

from haru.agents import probes
from haru.agents.errors import OutOfMemory, RuntimeRefused
from haru.agents.runtimes import ExternalRuntime, LlamaServerRuntime, VllmRuntime
from haru.agents.sim.gpu_state import GiB, SimGpuState
from haru.core.specs import ModelSpec
from tests.support.agent_harness import SIM_VLLM, sim_fault

pytestmark = pytest.mark.timeout(60)
FAKE_LLAMA = [sys.executable, str(Path(__file__).parent / "agent_fakes" / "fake_llama_server.py")]


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
def reap():
    runtimes = []
    yield runtimes.append
    for rt in runtimes:
        if rt.pid:
            try:
                os.killpg(rt.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass


async def until_ready(rt, timeout=20.0):
    deadline = asyncio.get_running_loop().time() + timeout
    seen = []
    while True:
        p = await probes.ready(rt, timeout_s=2.0, check_sleep=False)
        seen.append(p)
        if p.ok:
            return seen
        assert asyncio.get_running_loop().time() < deadline, seen[-3:]
        await asyncio.sleep(0.1)


async def test_vllm_runtime_on_the_simulator(tmp_path, session, reap):
    sim = tmp_path / "sim"
    sim.mkdir()
    SimGpuState(sim, 0).ensure(24 * GiB)
    spec = ModelSpec(
        name="qwen3.6:27b",
        slot="chat",
        gpu_index=0,
        vram_bytes=4 * GiB,
        source="Qwen/x",
        context_length=4096,
        binary=SIM_VLLM,
        args=["--max-num-seqs", "8"],
        env={"HARU_SIM_DIR": str(sim), "HARU_SIM_VRAM": "4GiB", "HARU_SIM_LOAD_MS": "300"},
    )
    rt = VllmRuntime(spec, session=session, log_dir=tmp_path / "logs", gpu_memory_bytes=24 * GiB)
    argv = rt.argv()
    assert argv[len(SIM_VLLM) : len(SIM_VLLM) + 2] == ["serve", "Qwen/x"]
    for flag in ("--enable-sleep-mode", "--served-model-name", "--host", "--port"):
        assert flag in argv
    # the plan's flags: 4 GiB of a 24 GiB GPU is 0.1666..., rounded down; the operator's extra flag passes through
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.166"
    assert argv[argv.index("--max-model-len") + 1] == "4096" and argv[-2:] == ["--max-num-seqs", "8"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and rt.env()["VLLM_SERVER_DEV_MODE"] == "1"
    assert rt.env()["CUDA_VISIBLE_DEVICES"] == "0" and rt.env()["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # pinned
    await rt.start()
    reap(rt)
    seen = await until_ready(rt)
    assert not seen[0].ok and seen[0].step == "health"  # loading: connection refused, not a failure of the model
    assert await rt.is_sleeping() is False
    await rt.sleep(1, 10)  # verified by /is_sleeping inside
    assert await rt.is_sleeping() is True
    sleeping_probe = await probes.ready(rt, timeout_s=2)
    assert not sleeping_probe.ok and sleeping_probe.step == "sleeping"
    await rt.wake(10)
    assert (await probes.ready(rt, timeout_s=2)).ok
    await rt.sleep(1, 10)
    await sim_fault(rt.base_url, "oom_on_wake")
    with pytest.raises(OutOfMemory):
        await rt.wake(10)
    assert await rt.is_sleeping() is True
    waiter = asyncio.ensure_future(rt.wait_exit())
    code = await rt.stop(5)
    assert code == 0 and await waiter == 0 and not rt.alive()


async def test_llama_server_runtime_reports_loading_then_ready(tmp_path, session, reap):
    argv_file = tmp_path / "argv.json"
    spec = ModelSpec(
        name="gemma:2b",
        slot="chat",
        gpu_index=0,
        runtime="llama_server",
        source="/models/gemma.gguf",
        context_length=4096,
        binary=FAKE_LLAMA,
        args=["--parallel", "2"],
        env={"FAKE_ARGV_FILE": str(argv_file), "FAKE_LOAD_MS": "800"},
    )
    rt = LlamaServerRuntime(spec, session=session, log_dir=tmp_path / "logs")
    await rt.start()
    reap(rt)
    seen = await until_ready(rt)
    loading = [p for p in seen if not p.ok and "Loading model" in p.detail]
    assert loading, seen  # 503 "Loading model" while loading
    args = json.loads(argv_file.read_text())
    assert args[:2] == ["-m", "/models/gemma.gguf"] and args[args.index("--alias") + 1] == "gemma:2b"
    assert args[args.index("--host") + 1] == "127.0.0.1" and args[-2:] == ["--parallel", "2"]
    assert args[args.index("-c") + 1] == "4096" and args[args.index("-ngl") + 1] == "999"  # the plan's: every layer
    assert not rt.can_sleep and await rt.is_sleeping() is None
    with pytest.raises(RuntimeRefused, match="no sleep mode"):
        await rt.sleep(1, 5)
    assert await rt.stop(5) is not None and not rt.alive()


async def test_external_runtime_is_probed_not_spawned(tmp_path, session, reap):
    sim = tmp_path / "sim"
    sim.mkdir()
    spec = ModelSpec(
        name="ext", slot="chat", gpu_index=0, binary=SIM_VLLM, env={"HARU_SIM_DIR": str(sim), "HARU_SIM_LOAD_MS": "100"}
    )
    served = VllmRuntime(spec, session=session, log_dir=tmp_path / "logs", gpu_memory_bytes=24 * GiB)  # someone else's
    await served.start()
    reap(served)
    await until_ready(served)
    ext = ExternalRuntime(
        ModelSpec(name="ext", slot="chat", gpu_index=0, runtime="external", url=served.base_url + "/v1"),
        session=session,
    )
    assert ext.base_url == served.base_url and ext.pid is None and ext.alive()
    await ext.start()
    assert (await probes.ready(ext, timeout_s=2)).ok
    assert await ext.stop(1) is None
    assert served.alive()  # not ours to stop
    await served.stop(5)
    p = await probes.ready(ext, timeout_s=2)
    assert not p.ok


async def test_direct_domains_bind_where_routers_reach_them(tmp_path, session):
    spec = ModelSpec(name="m", slot="chat", gpu_index=1, port=18100, source="s")
    loop = VllmRuntime(spec, session=session, log_dir=tmp_path, gpu_memory_bytes=24 * GiB)
    assert loop.argv()[loop.argv().index("--host") + 1] == "127.0.0.1"  # the default: loopback only
    direct = VllmRuntime(spec, session=session, log_dir=tmp_path, bind_host="0.0.0.0", gpu_memory_bytes=24 * GiB)
    assert direct.argv()[direct.argv().index("--host") + 1] == "0.0.0.0"
    assert direct.base_url == "http://127.0.0.1:18100"  # probed over loopback
    private = LlamaServerRuntime(spec, session=session, log_dir=tmp_path, bind_host="10.1.2.3")
    assert (
        private.argv()[private.argv().index("--host") + 1] == "10.1.2.3" and private.base_url == "http://10.1.2.3:18100"
    )
    assert direct.env()["CUDA_VISIBLE_DEVICES"] == "1"


async def test_a_spec_whose_args_contradict_its_plan_is_refused_at_start(tmp_path, session):
    """A log declared before `haru apply` checked args: the runtime refuses to start, naming the flag."""
    spec = ModelSpec(
        name="m",
        slot="chat",
        gpu_index=0,
        vram_bytes=4 * GiB,
        source="Qwen/x",
        binary=SIM_VLLM,
        args=["--gpu-memory-utilization=0.9"],
    )
    rt = VllmRuntime(spec, session=session, log_dir=tmp_path, gpu_memory_bytes=24 * GiB)
    with pytest.raises(RuntimeRefused, match=r"--gpu-memory-utilization 0\.9.*0\.166"):
        await rt.start()
    assert rt.pid is None and not rt.alive()
    unplanned = VllmRuntime(
        spec.__class__(name="m", slot="chat", gpu_index=0, vram_bytes=GiB, source="Qwen/x"),
        session=session,
        log_dir=tmp_path,
    )  # no GPU memory known: no fraction to give
    with pytest.raises(RuntimeRefused, match="GPU memory"):
        await unplanned.start()
