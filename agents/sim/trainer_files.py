"""What a simulated trainer leaves in its host's sim dir, and how `haru sim finish-run` asks it to end its run.

    <sim dir>/trainer-<pid>.json         written at its start, removed at its exit:
                                         {"pid", "gpu_index", "checkpoint_dir", "run", "base_model", "adapter"}
    <sim dir>/trainer-<pid>.finish.json  {"diverged": bool}: finish the run now (the trainer reads it each step)

A real run ends when its last step is done; a simulated one ends when someone asks, so a demo shows a
publication when its reader wants one. How the run then ends (its adapter, `publish.json`, exit 0) is the
training contract's, as the example trainer keeps it (docs/training.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from haru.host.procfs import pid_alive

__all__ = ["ask_finish", "finish_asked", "forget", "register", "trainers"]


def _path(sim_dir: str | os.PathLike[str], pid: int) -> Path:
    return Path(sim_dir) / f"trainer-{pid}.json"


def _finish_path(sim_dir: str | os.PathLike[str], pid: int) -> Path:
    return Path(sim_dir) / f"trainer-{pid}.finish.json"


def _write(path: Path, value: object) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, sort_keys=True))
    os.replace(tmp, path)


def register(sim_dir: str | os.PathLike[str], pid: int, about: dict[str, Any]) -> None:
    """Say that trainer `pid` runs on this host, and what its run is."""
    _write(_path(sim_dir, pid), {"pid": pid, **about})


def forget(sim_dir: str | os.PathLike[str], pid: int) -> None:
    """Trainer `pid` is exiting: it is no longer there to finish."""
    _path(sim_dir, pid).unlink(missing_ok=True)
    _finish_path(sim_dir, pid).unlink(missing_ok=True)


def trainers(sim_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The simulated trainers running on this host, by pid (a file left by one that was SIGKILLed is skipped)."""
    out = []
    for path in sorted(Path(sim_dir).glob("trainer-*.json")):
        if path.name.endswith(".finish.json"):
            continue
        try:
            about = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(about, dict) and pid_alive(int(about.get("pid", 0))):
            out.append(about)
    return out


def ask_finish(sim_dir: str | os.PathLike[str], pid: int, *, diverged: bool) -> None:
    """Ask trainer `pid` to finish its run at its next step (`diverged`: its adapter answers garbage)."""
    _write(_finish_path(sim_dir, pid), {"diverged": diverged})


def finish_asked(sim_dir: str | os.PathLike[str], pid: int) -> dict[str, Any] | None:
    """What `ask_finish` asked of trainer `pid` (None: nothing yet)."""
    try:
        asked = json.loads(_finish_path(sim_dir, pid).read_text())
    except (OSError, ValueError):
        return None
    return asked if isinstance(asked, dict) else None
