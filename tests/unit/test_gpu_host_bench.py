"""bench/gpu_host.py where there is no NVML: a clear message and status 3, nothing pretended."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_without_nvml_it_says_so_and_measures_nothing():
    from haru.agents.gpu import NvmlGpus

    gpus = NvmlGpus()
    try:
        if gpus.available:
            pytest.skip("this host has NVML: run bench/gpu_host.py itself")
    finally:
        gpus.close()
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_host.py")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "no NVML here" in done.stderr and "Nothing was measured" in done.stderr, done.stderr
    assert "present=" not in done.stdout  # no reading was printed as if it were one
