"""The fake NVML (tests/nvml/fake_nvml.c) built as `libnvidia-ml.so.1`, and a child process reading GPUs through it.

The library is compiled with gcc once per source version and cached (`$XDG_CACHE_HOME/haru-tests/` or
`~/.cache/haru-tests/`, else the session's temporary directory). A child process started with its directory
on LD_LIBRARY_PATH loads it through pynvml's own `CDLL("libnvidia-ml.so.1")`: the dynamic loader reads
LD_LIBRARY_PATH at process start, which is why the readers are child processes, never this one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "tests" / "nvml" / "fake_nvml.c"
LIB_NAME = "libnvidia-ml.so.1"

_READER = r"""
import json, sys
import msgspec
from haru.agents.gpu import NvmlGpus
from haru.agents.signals import NvmlGpuSignals
gpus = NvmlGpus()
signals = None
print(json.dumps({"unavailable": gpus.unavailable}), flush=True)
for line in sys.stdin:
    verb, _, arg = line.strip().partition(" ")
    if verb == "read":
        print(json.dumps(msgspec.to_builtins(gpus.read(int(arg)))), flush=True)
    elif verb == "signals":
        signals = signals or NvmlGpuSignals()
        print(json.dumps(signals.critical(int(arg))), flush=True)
    elif verb == "close":
        gpus.close()
        print(json.dumps({"closed": gpus.unavailable}), flush=True)
"""


def build(fallback_dir: Path) -> Path:
    """The directory holding the compiled fake `libnvidia-ml.so.1` (built if this source version is not cached)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "haru-tests"
    for root in (cache_root, fallback_dir):
        target = root / f"fake-nvml-{digest}"
        lib = target / LIB_NAME
        if lib.exists():
            return target
        try:
            target.mkdir(parents=True, exist_ok=True)
            tmp = target / f".{LIB_NAME}.{os.getpid()}"
            gcc = shutil.which("gcc") or shutil.which("cc")
            if gcc is None:
                raise RuntimeError("no C compiler (gcc) to build the fake NVML library")
            subprocess.run(
                [gcc, "-shared", "-fPIC", "-O1", "-Wall", "-o", str(tmp), str(SOURCE)],
                check=True,
                capture_output=True,
                timeout=60,
            )
            os.replace(tmp, lib)  # atomic: a concurrent session sees the whole library or none
            return target
        except OSError:
            continue  # not writable: the next root
    raise RuntimeError("could not build the fake NVML library anywhere")


def env_with(lib_dir: Path, state: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(lib_dir) + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    env["FAKE_NVML_STATE"] = str(state)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def write_state(path: Path, lines: list[str]) -> None:
    """Replace the fake's state atomically (it re-reads the file on every NVML call)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)


class Reader:
    """A child process holding one `agents.gpu.NvmlGpus` over the fake library; `read(i)` is one GpuReading."""

    def __init__(self, lib_dir: Path, state: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _READER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env_with(lib_dir, state),
            cwd=str(REPO),
        )
        self.unavailable = self._line()["unavailable"]

    def _line(self) -> dict:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise AssertionError(f"the reader died: {self.proc.stderr.read()}")  # type: ignore[union-attr]
        return json.loads(line)

    def read(self, index: int) -> dict:
        self.proc.stdin.write(f"read {index}\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._line()

    def signals(self, index: int) -> list[list[str]]:
        """`agents.signals.NvmlGpuSignals.critical(index)` in the child: [[source, detail], ...]."""
        self.proc.stdin.write(f"signals {index}\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._line()  # type: ignore[return-value]

    def close(self) -> str:
        self.proc.stdin.write("close\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._line()["closed"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
