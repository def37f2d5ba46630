"""A simulated vLLM server: a real HTTP process that speaks vLLM's OpenAI-compatible API.

    python -m haru.agents.sim.vllm serve <source> --host 127.0.0.1 --port P --served-model-name NAME \
        [--enable-sleep-mode] [any other vllm flag, accepted and ignored]

The argv is `vllm serve`'s, so the agent spawns it through the same code path as real vLLM with only
the binary changed. Configuration comes from the environment (see docs/sim.md): HARU_SIM_DIR,
HARU_SIM_GPU_INDEX, HARU_SIM_DOMAIN, HARU_SIM_VRAM, HARU_SIM_LOAD_MS, HARU_SIM_WAKE_MS,
HARU_SIM_SLEEP_MS, HARU_SIM_TOKENS_PER_S, HARU_SIM_RESIDUAL, HARU_SIM_GPU_MEMORY.

Start-up follows real vLLM: the port is bound (not listening) first, so nobody else takes it; the
model "loads" for HARU_SIM_LOAD_MS holding its VRAM on the simulated GPU; only then does the HTTP
server listen. While loading, a connection is refused (real vLLM binds its socket before building
the engine and starts uvicorn after), so "the child is alive but refuses connections" means loading.

Start-up memory profiling, as vLLM does it: the weights are taken, then a profiling pass runs for
HARU_SIM_LOAD_MS, and the KV cache gets what is left of the instance's share (HARU_SIM_VRAM minus
HARU_SIM_WEIGHTS, half of it by default). What other processes hold on the GPU is read before and
after that pass: more held after (a neighbour started, or woke) is counted as the instance's own
non-torch memory, so its cache is mis-sized by that much, or, if nothing is left, it exits like vLLM
("No available memory for the cache blocks"); less held after (a neighbour exited or slept) fails
vLLM's profiling assertion ("Error in memory profiling"). Each start-up appends one line to
`<sim_dir>/profiles.jsonl` (pid, model, GPU, window, KV bytes, mis-sized, error), which tests read to
prove the agent never starts two on one GPU at once. HARU_SIM_PROFILE=0 turns the check off.

Fault injection (loopback only): POST /_sim/crash | evict | hang | oom_on_wake | fail_probe | reset,
GET /_sim/state.

LoRA adapters named by `--lora-modules NAME=PATH ...` are served under their names (their answers
name the adapter). Fault injection (loopback only): POST /_sim/crash | evict | hang | oom_on_wake |
fail_probe | sleep_frees_nothing (a sleep pauses the engine and keeps its memory, as vLLM does on a
platform without sleep mode) | corrupt_wake (every wake after it answers other text, like a wake with stale or wrong
weights) | drop_adapter (after the next wake, an adapter's requests answer as the base model: the
adapter silently stops applying) | fail_lora?name=N (an adapter loaded at run time answers 500) | reset,
GET /_sim/state.

This module is the process (bind, profile, listen, stop); the parts live beside it: `vllm_config`
(argv and environment, read once), `vllm_profile` (the start-up profiling), `vllm_engine` (the
engine's state and request checks), `vllm_completions` (the answers), `vllm_app` (the routes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from aiohttp import web

from haru.agents.sim.errors import SimError
from haru.agents.sim.gpu_state import SimGpuState
from haru.agents.sim.vllm_app import build_app
from haru.agents.sim.vllm_config import SimConfig, parse_config
from haru.agents.sim.vllm_engine import Engine
from haru.agents.sim.vllm_profile import others_held, profile_outcome, record_profile
from haru.core.sizes import format_size
from haru.core.subjects import model_token


def runtime_path(sim_dir: str | os.PathLike[str], model: str) -> Path:
    """`<sim_dir>/runtime-<model token>.json`: where a running sim server says who and where it is."""
    return Path(sim_dir) / f"runtime-{model_token(model)}.json"


def _log(message: str) -> None:
    print(f"(haru-sim-vllm pid={os.getpid()}) {message}", file=sys.stderr, flush=True)


async def serve(config: SimConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    # Bind (do not listen) first, like vLLM: the port is ours, but connections are refused until loaded.
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
    except OSError as exc:
        _log(f"ERROR: cannot bind {config.host}:{config.port}: {exc}")
        return 1
    port = sock.getsockname()[1]

    pid = os.getpid()
    gpu = SimGpuState(config.sim_dir, config.gpu_index)
    gpu.ensure(config.gpu_memory)
    rt_path = runtime_path(config.sim_dir, config.name)
    rt_path.write_text(
        json.dumps(
            {
                "pid": pid,
                "port": port,
                "host": config.host,
                "model": config.name,
                "names": list(config.names),
                "domain": config.domain,
                "gpu_index": config.gpu_index,
            }
        )
    )
    engine = Engine(config=config, gpu=gpu)
    runner: web.AppRunner | None = None
    try:
        _log(
            f"loading {config.source} as {config.name!r} for domain {config.domain!r} "
            f"({format_size(config.vram)} on GPU {config.gpu_index}, {config.load_ms} ms)"
        )
        if not engine.gpu_present():
            _log(f"RuntimeError: CUDA error: no CUDA-capable device is detected (GPU {config.gpu_index} is absent)")
            return 1
        # vLLM takes its baseline of the GPU's memory before it loads its own weights: another process that
        # allocates from then until its profiling ends mis-sizes it, however close together the two began
        began, before = time.time(), others_held(gpu, pid)
        if not gpu.allocate(pid, config.vram):
            _log(f"torch.OutOfMemoryError: CUDA out of memory. {engine.oom_message(config.vram)}")
            return 1
        with contextlib.suppress(asyncio.TimeoutError):
            async with asyncio.timeout(config.load_ms / 1000):
                await stop.wait()
        if stop.is_set():
            return 0
        if config.profile:
            total = gpu.read()["memory_total_bytes"]
            outcome = profile_outcome(config.vram, config.weights, before, others_held(gpu, pid), total)
            record_profile(config, pid, began, time.time(), outcome)
            if outcome.error:
                _log(outcome.error)
                return 1
            engine.kv_cache_bytes, engine.mis_sized = outcome.kv_cache_bytes, outcome.mis_sized
            if outcome.mis_sized:
                _log(
                    f"WARNING: KV cache sized to {format_size(outcome.kv_cache_bytes)} instead of "
                    f"{format_size(outcome.planned_kv_bytes)}: another process allocated on GPU {config.gpu_index} "
                    f"while this instance profiled its memory"
                )
        runner = web.AppRunner(build_app(engine), access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        _log(f"Started server process; listening on http://{config.host}:{port}")
        await stop.wait()
        engine.hung = False
        engine.released.set()  # let hung requests finish so shutdown is prompt
        return 0
    finally:
        if runner is not None:
            await runner.cleanup()
        gpu.free(pid)
        with contextlib.suppress(FileNotFoundError):
            rt_path.unlink()
        sock.close()


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(sys.argv[1:] if argv is None else argv, dict(os.environ))
    except SimError as exc:
        print(f"haru.agents.sim.vllm: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
