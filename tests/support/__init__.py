"""Small helpers shared by integration tests."""

from __future__ import annotations

import os
import subprocess
import sys


def haru(
    *args: str, nats_url: str | None = None, timeout: float = 30, env: dict | None = None, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run the real `haru` CLI in a child process (python -m haru.cli ...)."""
    argv = [sys.executable, "-m", "haru.cli", *args]
    if nats_url is not None:
        argv += ["--nats-url", nats_url]
    full_env = {**os.environ, "HARU_NO_UVLOOP": "1", **(env or {})}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"haru {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc
