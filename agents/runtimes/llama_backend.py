"""Which llama-server fits this host: the backend to build, a binary's own account of its devices and
version, and whether one found on PATH is recent enough to trust.

    choose_backend(nvcc="/usr/local/bin/nvcc", gpus=1, forced="")   # ("cuda", "CUDA compiler ... and 1 GPU")
    devices(binary)                                                   # ["CUDA0"]; [] for a CPU-only build
    build_number(version_output)                                      # 6896, or None when it does not say

A GGUF model planned on a GPU gets `-ngl` (its layers offloaded), which a llama-server without a GPU
backend accepts and ignores: it would run on the CPU while the plan books VRAM. So the build takes the
CUDA backend when the host can use it (a CUDA compiler and a GPU that NVML sees: a compiler alone, as
on a CI machine, builds for the CPU), and a runtime on real GPUs refuses a binary whose
`--list-devices` lists no GPU (agents/runtimes/llama_server.py).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

__all__ = [
    "BACKENDS",
    "ENV_BACKEND",
    "MIN_BUILD",
    "build_number",
    "choose_backend",
    "devices",
    "parse_devices",
    "path_binary",
]

ENV_BACKEND = "HARU_LLAMA_BACKEND"  # cpu | cuda: the build's backend, whatever the host looks like
# The cmake flags each backend adds to the common ones (llama_build.CMAKE_FLAGS).
BACKENDS: dict[str, tuple[str, ...]] = {"cpu": (), "cuda": ("-DGGML_CUDA=ON",)}
# A llama-server on PATH is used only from this build on (llama.cpp's `version: N (commit)`): a floor
# well inside the server API the runtime code uses (OpenAI chat with an assistant prefill, /health's
# loading answer). An older or unidentifiable one is passed over; HARU_LLAMA_SERVER names one anyway.
MIN_BUILD = 6000
_DEVICE = re.compile(r"^\s*([A-Za-z]+\d+):")
_BUILD = re.compile(r"version:\s*(\d+)\s*\(")


def parse_devices(output: str) -> list[str]:
    """The devices `llama-server --list-devices` prints (`CUDA0: NVIDIA H100 ...`), [] for `(none)`."""
    return [m.group(1) for line in output.splitlines() if (m := _DEVICE.match(line))]


def build_number(output: str) -> int | None:
    """llama.cpp's build number from `--version` (`version: 6896 (a1b2c3d)`); None when it says none
    (a build from a source tree without git says `version: 0.6.0-dev (build 0, ...)`)."""
    m = _BUILD.search(output)
    return int(m.group(1)) if m else None


def choose_backend(*, nvcc: str | None, gpus: int | None, forced: str = "") -> tuple[str, str]:
    """The backend to build and why (pure): `forced` when given; CUDA with a compiler and a GPU."""
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{ENV_BACKEND}={forced!r} is not a backend; use one of {', '.join(BACKENDS)}")
        return forced, f"{ENV_BACKEND}={forced}"
    if nvcc and gpus:
        return "cuda", f"CUDA compiler {nvcc} and {gpus} NVIDIA GPU(s) seen by NVML"
    if nvcc:
        return "cpu", f"a CUDA compiler ({nvcc}) but no NVIDIA GPU seen by NVML"
    return "cpu", "no CUDA compiler (nvcc) on PATH" + ("" if not gpus else f", though NVML sees {gpus} GPU(s)")


def _ask(binary: str, flag: str) -> str:
    try:
        done = subprocess.run([binary, flag], capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout + done.stderr


@functools.lru_cache(maxsize=16)
def _devices(binary: str, mtime_ns: int) -> tuple[str, ...]:
    return tuple(parse_devices(_ask(binary, "--list-devices")))


def devices(binary: str | os.PathLike[str]) -> list[str]:
    """The devices the binary itself lists (asked once per binary and modification time)."""
    path = shutil.which(str(binary)) or str(binary)
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError:
        return []
    return list(_devices(path, mtime))


def path_binary() -> tuple[Path | None, str]:
    """The llama-server on PATH if it is recent enough, and what was found (for `haru runtime llama`)."""
    found = shutil.which("llama-server")
    if found is None:
        return None, "none on PATH"
    number = build_number(_ask(found, "--version"))
    if number is None:
        return None, f"{found} does not say its build number: passed over (name it with HARU_LLAMA_SERVER to use it)"
    if number < MIN_BUILD:
        return None, f"{found} is build {number}, older than {MIN_BUILD}: passed over"
    return Path(found).resolve(), f"{found} (build {number})"
