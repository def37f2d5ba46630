"""The right llama-server for the host: the build's backend (CUDA only with a compiler and a GPU NVML
sees), a recent enough llama-server on PATH before the cache, a CPU-only binary refused at start on real
GPUs (never run on the CPU behind a VRAM plan), and `haru serve`'s binary per runtime.

The CUDA build itself cannot run here (no GPU): what is tested is the choice and the refusal, with
fake binaries that answer `--version` and `--list-devices` as llama.cpp's builds do."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import aiohttp
import pytest

from haru.agents.errors import RuntimeRefused
from haru.agents.runtimes import llama_backend
from haru.agents.runtimes import llama_build as lb
from haru.agents.runtimes.llama_server import LlamaServerRuntime
from haru.cli.serve import runtime_binaries
from haru.core.specs import ModelSpec

pytestmark = pytest.mark.timeout(60)

CUDA_DEVICES = "Available devices:\n  CUDA0: NVIDIA H100 80GB HBM3 (81079 MiB, 80521 MiB free)\n"
NO_DEVICES = "Available devices:\n  (none)\n"


def fake_llama(path: Path, *, version: str, devices: str) -> Path:
    """An executable that answers like a llama-server build, and otherwise sleeps (a started server)."""
    path.write_text(
        "#!/bin/sh\n"
        f'case "$1" in --version) printf "%s\\n" "{version}"; exit 0;; '
        f'--list-devices) printf "{devices.replace(chr(10), chr(92) + "n")}"; exit 0;; esac\n'
        "exec sleep 30\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_what_a_binary_says_of_itself():
    assert llama_backend.parse_devices(CUDA_DEVICES) == ["CUDA0"]
    assert llama_backend.parse_devices(NO_DEVICES) == []
    assert llama_backend.build_number("version: 6896 (a1b2c3d)\nbuilt with GNU 12.2.0") == 6896
    assert llama_backend.build_number("version: 0.6.0-dev (build 0, commit unknown)") is None


def test_cuda_is_built_only_with_a_compiler_and_a_gpu():
    choose = llama_backend.choose_backend
    assert choose(nvcc="/usr/bin/nvcc", gpus=2, forced="")[0] == "cuda"
    backend, why = choose(nvcc="/usr/bin/nvcc", gpus=0, forced="")  # a CI machine: the toolkit, no GPU
    assert backend == "cpu" and "no NVIDIA GPU seen by NVML" in why
    assert choose(nvcc="/usr/bin/nvcc", gpus=None, forced="")[0] == "cpu"  # NVML unreadable: no guess
    backend, why = choose(nvcc=None, gpus=1, forced="")
    assert backend == "cpu" and "no CUDA compiler" in why
    assert choose(nvcc=None, gpus=0, forced="cuda") == ("cuda", "HARU_LLAMA_BACKEND=cuda")
    with pytest.raises(ValueError, match="HARU_LLAMA_BACKEND='metal' is not a backend"):
        choose(nvcc=None, gpus=0, forced="metal")


def test_a_recent_llama_server_on_path_is_used_and_an_old_one_passed_over(tmp_path, monkeypatch):
    monkeypatch.delenv("HARU_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # an empty cache
    monkeypatch.setenv("HARU_LLAMA_BACKEND", "cpu")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    fake_llama(bindir / "llama-server", version="version: 6896 (a1b2c3d)", devices=CUDA_DEVICES)
    assert lb.find_binary() == (bindir / "llama-server").resolve()
    fake_llama(bindir / "llama-server", version="version: 1200 (0ld0ld0)", devices=CUDA_DEVICES)
    assert lb.find_binary() is None  # too old: the managed build (none cached here) is wanted instead
    assert "older than" in llama_backend.path_binary()[1]
    fake_llama(bindir / "llama-server", version="version: 0.6.0-dev (build 0, commit unknown)", devices="")
    assert lb.find_binary() is None and "does not say its build number" in llama_backend.path_binary()[1]


def spec(binary: Path, gpu_layers: int = -1) -> ModelSpec:
    return ModelSpec(
        name="tiny",
        slot="chat",
        gpu_index=0,
        runtime="llama_server",
        vram_bytes=2 << 30,
        source="/srv/tiny.gguf",
        binary=[str(binary)],
        gpu_layers=gpu_layers,
    )


async def test_a_cpu_only_llama_server_is_refused_on_real_gpus_and_never_run_on_the_cpu(tmp_path):
    cpu_only = fake_llama(tmp_path / "llama-cpu", version="version: 6896 (a1b2c3d)", devices=NO_DEVICES)
    async with aiohttp.ClientSession() as session:
        runtime = LlamaServerRuntime(spec(cpu_only), session=session, log_dir=tmp_path, real_gpus=True)
        with pytest.raises(RuntimeRefused, match="has no GPU backend") as refused:
            await runtime.start()
        assert "HARU_LLAMA_SERVER" in str(refused.value) and "gpu_layers: 0" in str(refused.value)
        assert runtime.pid is None  # nothing was started
        # On the CPU on purpose (gpu_layers 0), or on simulated GPUs (the demo): it runs.
        for rt in (
            LlamaServerRuntime(spec(cpu_only, gpu_layers=0), session=session, log_dir=tmp_path, real_gpus=True),
            LlamaServerRuntime(spec(cpu_only), session=session, log_dir=tmp_path, real_gpus=False),
        ):
            await rt.start()
            assert rt.pid is not None
            await rt.stop(1.0)
        cuda = fake_llama(tmp_path / "llama-cuda", version="version: 6896 (a1b2c3d)", devices=CUDA_DEVICES)
        runtime = LlamaServerRuntime(spec(cuda), session=session, log_dir=tmp_path, real_gpus=True)
        await runtime.start()  # a GPU build offloads as planned
        assert runtime.pid is not None
        await runtime.stop(1.0)


def test_haru_serve_takes_a_binary_per_runtime(tmp_path):
    llama, vllm = tmp_path / "llama-server", tmp_path / "vllm"
    llama.touch()
    vllm.touch()

    def args(**kw: str) -> argparse.Namespace:
        return argparse.Namespace(**{"binary": "", "llama_binary": "", "vllm_binary": "", **kw})

    both = {"llama_server", "vllm"}
    refused = runtime_binaries(args(binary=str(llama)), both)
    assert isinstance(refused, str) and "--llama-binary" in refused and "--vllm-binary" in refused
    assert runtime_binaries(args(llama_binary=str(llama), vllm_binary=str(vllm)), both) == (str(llama), str(vllm))
    assert runtime_binaries(args(binary=str(llama)), {"llama_server"}) == (str(llama), "")
    assert runtime_binaries(args(binary=str(vllm)), {"vllm"}) == ("", str(vllm))
    missing = runtime_binaries(args(vllm_binary=str(tmp_path / "nope")), {"vllm"})
    assert isinstance(missing, str) and "--vllm-binary" in missing and "does not exist" in missing
