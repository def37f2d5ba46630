"""The simulated vLLM's configuration: `vllm serve`'s argv and the HARU_SIM_* environment, read once at start.

    config = parse_config(argv, env)    # SimConfig; argv is `vllm serve`'s (unknown flags are ignored)

HARU_SIM_DIR (required), HARU_SIM_GPU_INDEX (else the first of CUDA_VISIBLE_DEVICES), HARU_SIM_DOMAIN,
HARU_SIM_VRAM, HARU_SIM_RESIDUAL, HARU_SIM_GPU_MEMORY, HARU_SIM_LOAD_MS, HARU_SIM_WAKE_MS,
HARU_SIM_SLEEP_MS, HARU_SIM_TOKENS_PER_S, HARU_SIM_WEIGHTS, HARU_SIM_PROFILE, HARU_SIM_PREFILL and
VLLM_SERVER_DEV_MODE (docs/sim.md).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from haru.agents.sim.gpu_state import parse_size
from haru.core.sizes import GiB, MiB

DEFAULT_GPU_MEMORY = 24 * GiB


@dataclass(frozen=True)
class SimConfig:
    source: str
    names: tuple[str, ...]
    host: str
    port: int
    sleep_mode: bool
    dev_mode: bool
    sim_dir: Path
    gpu_index: int
    domain: str
    vram: int
    residual: int
    gpu_memory: int
    load_ms: int
    wake_ms: int
    sleep_ms: int
    tokens_per_s: float
    weights: int = 0  # 0 = half the VRAM
    profile: bool = True
    adapters: tuple[str, ...] = ()  # served under their names (--lora-modules NAME=PATH)
    prefill: bool = False  # HARU_SIM_PREFILL=1: a final assistant message is continued (llama-server's prefill)
    # Adapters loaded at run time (POST /v1/load_lora_adapter), as vLLM: --enable-lora with
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, each of rank <= --max-lora-rank (more than --max-loras is not
    # refused, as vLLM's LRU cache does not refuse: the agent's admission is what keeps to it).
    enable_lora: bool = False
    runtime_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    @property
    def name(self) -> str:
        return self.names[0]


def default_gpu_index(env: dict[str, str]) -> int:
    if env.get("HARU_SIM_GPU_INDEX"):
        return int(env["HARU_SIM_GPU_INDEX"])
    visible = env.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(visible) if visible.isdigit() else 0


def parse_config(argv: list[str], env: dict[str, str]) -> SimConfig:
    parser = argparse.ArgumentParser(prog="haru.agents.sim.vllm", description="simulated vLLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("source", help="the model (path or hub id) vLLM would load")
    serve.add_argument("--lora-modules", nargs="+", default=[])
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", nargs="+", default=None)
    serve.add_argument("--enable-sleep-mode", action="store_true")
    serve.add_argument("--enable-lora", action="store_true")
    serve.add_argument("--max-loras", type=int, default=1)
    serve.add_argument("--max-lora-rank", type=int, default=16)
    args, _ignored = parser.parse_known_args(argv)
    sim_dir = env.get("HARU_SIM_DIR")
    if not sim_dir:
        parser.error("HARU_SIM_DIR is not set; set it to the simulated host's directory (e.g. ~/.haru/sim/a)")
    return SimConfig(
        source=args.source,
        names=tuple(args.served_model_name or [args.source]),
        host=args.host,
        adapters=tuple(m.split("=", 1)[0] for m in args.lora_modules),
        port=args.port,
        sleep_mode=args.enable_sleep_mode,
        dev_mode=env.get("VLLM_SERVER_DEV_MODE", "0") == "1",
        sim_dir=Path(sim_dir),
        gpu_index=default_gpu_index(env),
        domain=env.get("HARU_SIM_DOMAIN", "sim"),
        vram=parse_size(env.get("HARU_SIM_VRAM", "4GiB")),
        residual=parse_size(env.get("HARU_SIM_RESIDUAL", str(256 * MiB))),
        gpu_memory=parse_size(env.get("HARU_SIM_GPU_MEMORY", str(DEFAULT_GPU_MEMORY))),
        load_ms=int(env.get("HARU_SIM_LOAD_MS", "300")),
        wake_ms=int(env.get("HARU_SIM_WAKE_MS", "100")),
        sleep_ms=int(env.get("HARU_SIM_SLEEP_MS", "50")),
        tokens_per_s=float(env.get("HARU_SIM_TOKENS_PER_S", "200")),
        weights=parse_size(env.get("HARU_SIM_WEIGHTS", "0")),
        profile=env.get("HARU_SIM_PROFILE", "1") != "0",
        prefill=env.get("HARU_SIM_PREFILL") == "1",
        enable_lora=args.enable_lora or bool(args.lora_modules),
        runtime_lora=env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("true", "1"),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
    )
