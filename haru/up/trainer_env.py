"""Make (once per machine) or find the example LoRA trainer's Python: a virtual environment with PEFT.

    python -m haru.up.trainer_env            # print its interpreter; make the env first if needed
    python -m haru.up.trainer_env --check    # print it if present, exit 1 if not (makes nothing)

What is installed: TRAINER_REQUIREMENTS (torch CPU 2.13.0, which pip takes from the machine's local
wheels where its configuration points there; transformers, peft, safetensors, sentencepiece from PyPI).
The same interpreter writes the tiny model the tests train on (`agents/runtimes/tiny_hf_model.py`).
On a GPU host an operator points `HARU_TRAINER_PYTHON` at a Python with a CUDA torch and peft instead:
the trainer (deploy/examples/trainer/train_lora.py) uses a GPU when torch sees one.

Where it lives: `$XDG_CACHE_HOME/haru/trainer-venv` (default `~/.cache/...`), beside the vLLM and
converter venvs. The stamp `haru-trainer.json` is written last, after the trainer's imports succeeded;
no stamp (an interrupted install), or a stamp naming other requirements, means it is made again.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from haru.agents.runtimes.cached import BuildError, cache_root, made_once, maker_main, run_step, say

__all__ = ["TRAINER_REQUIREMENTS", "ENV_PYTHON", "BuildError", "env_dir", "find_python", "ensure_env"]

TRAINER_REQUIREMENTS = (
    "torch==2.13.0",
    "numpy>=1.26,<2.3",
    "sentencepiece>=0.1.98,<0.3.0",
    "protobuf>=4.21.0,<5.0.0",
    "transformers==4.57.6",
    "peft==0.21.2",
    "safetensors",
)
ENV_PYTHON = "HARU_TRAINER_PYTHON"
STAMP = "haru-trainer.json"
IMPORTS = "import torch, transformers, peft, safetensors, sentencepiece; print(peft.__version__)"


def env_dir() -> Path:
    return cache_root() / "trainer-venv"


def _stamped(root: Path) -> bool:
    try:
        stamp = json.loads((root / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("requirements") == list(TRAINER_REQUIREMENTS)


def find_python() -> Path | None:
    """$HARU_TRAINER_PYTHON, else the managed env's interpreter (None when absent or not finished)."""
    explicit = os.environ.get(ENV_PYTHON)
    if explicit:
        path = Path(explicit).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise BuildError(
                f"{ENV_PYTHON}={explicit} is not an executable file; point it at a Python with torch and peft, "
                f"or unset it to use (or make) the managed one in {env_dir()}"
            )
        return path
    root = env_dir()
    python = root / "bin" / "python"
    return python if _stamped(root) and python.exists() else None


def ensure_env(*, build: bool = True) -> Path:
    """The interpreter path; makes the managed env first when absent and `build` is true."""
    found = find_python()
    if found is not None:
        return found
    if not build:
        raise BuildError(
            f"no trainer env: {env_dir()} is not made and {ENV_PYTHON} is unset; make it once "
            f"(~1.2 GB) with `python -m haru.up.trainer_env`"
        )
    root = env_dir()
    return made_once("trainer-env", root.parent / "trainer-venv.lock", find_python, lambda: _make(root))


def _make(root: Path) -> Path:
    started = time.monotonic()
    python = root / "bin" / "python"
    if root.exists():
        shutil.rmtree(root)  # no stamp, or other requirements: made again from nothing
    run_step("trainer-env", [sys.executable, "-m", "venv", str(root)], "creating the venv", stderr=sys.stderr)
    run_step(
        "trainer-env",
        [str(python), "-m", "pip", "install", "--progress-bar", "off", "--disable-pip-version-check"]
        + list(TRAINER_REQUIREMENTS),
        "installing the trainer's requirements (" + ", ".join(TRAINER_REQUIREMENTS) + ")",
        stderr=sys.stderr,
    )
    run_step("trainer-env", [str(python), "-c", IMPORTS], "checking the trainer's imports", capture=True)
    tmp = root / f".{STAMP}.{os.getpid()}.tmp"
    tmp.write_text(
        json.dumps({"requirements": list(TRAINER_REQUIREMENTS), "made_s": round(time.monotonic() - started)})
    )
    os.replace(tmp, root / STAMP)
    say("trainer-env", f"ready in {root} after {time.monotonic() - started:.0f} s")
    return python


def main(argv: list[str] | None = None) -> int:
    return maker_main(
        "haru.up.trainer_env",
        __doc__ or "",
        "make nothing; exit 1 when the env is not there",
        lambda build: ensure_env(build=build),
        str,
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
