"""What the two runtime makers share (`llama_build`: llama-server compiled once per machine;
`vllm_env`: the vLLM virtual environment installed once per machine): where the cache is, how
progress is said, how one maker waits for another, how a step is run, and the command line.

    python -m haru.agents.runtimes.<maker>            # print what to launch; make it first if needed
    python -m haru.agents.runtimes.<maker> --check    # print it if present, exit 1 if not (makes nothing)
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from haru.agents.errors import RuntimeBuildFailed as BuildError

__all__ = ["BuildError", "cache_root", "say", "made_once", "run_step", "maker_main"]

T = TypeVar("T")


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/haru` (default `~/.cache/haru`): every maker's cache lives under it."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "haru"


def say(who: str, msg: str) -> None:
    """Progress, on stderr (stdout is the made thing's path alone)."""
    sys.stderr.write(f"{who}: {msg}\n")
    sys.stderr.flush()


def made_once(who: str, lock_path: Path, find: Callable[[], T | None], make: Callable[[], T]) -> T:
    """`make()` under an exclusive lock on `lock_path`, unless `find()` (asked again once the lock is
    held) says another maker finished while this one waited."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(who, f"another maker holds {lock_path}; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        found = find()
        return found if found is not None else make()


def run_step(who: str, argv: list[str], what: str, *, missing: str = "", capture: bool = False, **kw) -> str:
    """Run one step of a make, its output on stderr (or captured and returned); a failure is a
    BuildError naming the step (and, for a missing program, `missing`: what to install or set)."""
    say(who, f"{what}: {' '.join(argv)}")
    try:
        done = subprocess.run(
            argv,
            check=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if capture else sys.stderr,
            text=True,
            **kw,
        )
    except FileNotFoundError as exc:
        raise BuildError(
            f"{what}: {argv[0]} is not there ({exc.strerror})" + (f"; {missing}" if missing else "")
        ) from exc
    except subprocess.CalledProcessError as exc:
        raise BuildError(f"{what} failed with exit status {exc.returncode}: {' '.join(argv)}") from exc
    return done.stdout or ""


def maker_main(
    module: str,
    doc: str,
    check_help: str,
    ensure: Callable[[bool], T],
    show: Callable[[T], str],
    argv: list[str] | None = None,
) -> int:
    """The command line of a maker: make (or with --check only find) the thing, print what `show`
    makes of it; a BuildError is said on stderr with exit status 1."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=(doc or "").split("\n")[0])
    p.add_argument("--check", action="store_true", help=check_help)
    args = p.parse_args(argv)
    try:
        made = ensure(not args.check)
    except BuildError as exc:
        say(module.rsplit(".", 1)[-1].replace("_", "-"), str(exc))
        return 1
    with contextlib.suppress(BrokenPipeError):
        print(show(made))
    return 0
