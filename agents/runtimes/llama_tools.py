"""llama.cpp's other managed pieces, beside `llama_build`'s llama-server: `llama-quantize` (another cmake
target of the same tree and build directory) and the tree's own converter, `convert_hf_to_gguf.py`
with its `gguf-py`.

    <cache>/haru/llama.cpp/<version>/bin/llama-quantize     built on demand, copied then renamed
    <cache>/haru/llama.cpp/<version>/src/convert_hf_to_gguf.py

The same lock file as the server's build serializes builders.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import haru.agents.runtimes.llama_backend as llama_backend
import haru.agents.runtimes.llama_build as lb

__all__ = ["TOOLS", "find_tool", "ensure_tool", "converter", "status"]

TOOLS = ("llama-server", "llama-quantize")


def find_tool(name: str) -> Path | None:
    if name == "llama-server":
        return lb.find_binary()
    path = lb.cache_dir() / "bin" / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def converter() -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py from the pinned tree (present once the tree was fetched)."""
    path = lb.cache_dir() / "src" / "convert_hf_to_gguf.py"
    return path if path.is_file() else None


def ensure_tool(name: str) -> Path:
    """Build `name` (a cmake target of the pinned tree) into the cache, with -j2, unless it is there."""
    if name not in TOOLS:
        raise lb.BuildError(f"unknown llama.cpp tool {name!r}; one of {', '.join(TOOLS)}")
    if name == "llama-server":
        return lb.ensure_binary(build=True)
    found = find_tool(name)
    if found is not None:
        return found
    root = lb.cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = find_tool(name)
        if found is not None:
            return found
        src = lb._fetch_source(root)
        build = root / "build"
        if not (build / "CMakeCache.txt").exists():
            lb._run(["cmake", "-S", str(src), "-B", str(build), *lb.CMAKE_FLAGS], "configuring")
        lb._run(
            ["cmake", "--build", str(build), "--target", name, f"-j{lb.JOBS}"], f"compiling {name} with -j{lb.JOBS}"
        )
        built = build / "bin" / name
        if not built.is_file():
            raise lb.BuildError(f"cmake finished but {built} is missing")
        out = root / "bin"
        out.mkdir(exist_ok=True)
        tmp = out / f".{name}.{os.getpid()}.tmp"
        shutil.copy2(built, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, out / name)
        return out / name


def status() -> dict:
    """What the managed runtime holds now, without building anything."""
    out: dict = {
        "package": lb.PACKAGE,
        "version": lb.VERSION,
        "sdist_sha256": lb.SDIST_SHA256,
        "cache": str(lb.cache_dir()),
        "tools": {},
    }
    for name in TOOLS:
        try:
            found = find_tool(name)
        except lb.BuildError as exc:
            out["tools"][name] = {"path": None, "error": str(exc)}
            continue
        entry: dict = {"path": str(found) if found else None}
        if name == "llama-server":
            backend, why = lb.backend()
            on_path, path_said = llama_backend.path_binary()
            entry["host_backend"] = f"{backend} ({why})"
            entry["on_path"] = path_said
            if found is not None:
                entry["from"] = (
                    lb.ENV_BINARY if os.environ.get(lb.ENV_BINARY) else "PATH" if found == on_path else "cache"
                )
                gpus = llama_backend.devices(found)
                entry["devices"] = gpus
                entry["backend"] = f"GPU ({', '.join(gpus)})" if gpus else "CPU only (lists no GPU device)"
        if found is not None and name == "llama-server":
            try:
                done = subprocess.run([str(found), "--version"], capture_output=True, text=True, timeout=10)
                text = (done.stdout + done.stderr).strip().splitlines()
                entry["reports"] = next((line for line in text if "version" in line.lower()), text[0] if text else "")
            except (OSError, subprocess.TimeoutExpired):
                entry["reports"] = ""
        out["tools"][name] = entry
    conv = converter()
    out["converter"] = str(conv) if conv else None
    return out
