"""The agent's files in its state directory, and what a starting agent makes of them.

    <state>/runtimes/<model>.json   a runtime's identity (pid, kernel start time, argv, port, model, plan):
                                    runtimes outlive the agent; the next one adopts, replaces or stops them.
                                    While it sleeps, also `wake_answers`: what the wake check compares
    <state>/children.json           the running trainers' process groups (they do not outlive the agent:
                                    a starting agent stops whatever a crashed one left, with the grace)

`runtime_on_start` is the pure verdict on one identity file (`OnStart`: adopt, replace, stop, start);
`haru agent --dry-run` prints it, the agent acts on it. Whether an adopted process answers is checked
at start by the agent, not here.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import msgspec

from haru.core.specs import ModelSpec
from haru.host import procfs
from haru.host.children import alive as proc_alive
from haru.host.children import stop_group

__all__ = ["OnStart", "RuntimeFiles", "runtime_on_start", "read_identities", "start_time", "wake_answers"]


class OnStart(msgspec.Struct, frozen=True):
    """What a starting agent does with the runtime an identity file names, and why."""

    action: Literal["adopt", "replace", "stop", "start", "probe"]
    why: str


def runtime_on_start(
    doc: dict | None, runtime: Any, spec: ModelSpec | None, why_unwanted: str = "the layout no longer has this model"
) -> OnStart:
    """The verdict on an identity file. `runtime` is the model's Runtime under the current layout (None:
    the layout dropped it, or the planner no longer admits it: `why_unwanted` says which)."""
    if doc is None:
        return OnStart("start", "no runtime of a previous agent")
    pid, start, port = int(doc.get("pid", 0)), doc.get("start"), int(doc.get("port", 0))
    if not proc_alive(pid, start):
        reused = start_time(pid) not in ("", str(start))
        return OnStart(
            "start",
            f"the runtime (pid {pid}) exited while no agent was watching it"
            + ("; its pid now belongs to an unrelated process, left alone" if reused else ""),
        )
    if runtime is None or spec is None:
        return OnStart("stop", why_unwanted)
    planned = getattr(runtime, "planned_argv", lambda _p: None)(port)
    if runtime.kind != doc.get("runtime") or planned != doc.get("argv") or (spec.port and spec.port != port):
        return OnStart("replace", f"the layout changed this model (pid {pid} runs another command line)")
    return OnStart("adopt", f"pid {pid} still runs the planned command line on port {port}")


def read_identities(state_dir: Path) -> dict[str, tuple[Path, dict | None]]:
    """model -> (identity file, its document or None if unreadable)."""
    out: dict[str, tuple[Path, dict | None]] = {}
    try:
        files = sorted((state_dir / "runtimes").glob("*.json"))
    except OSError:
        return out
    for path in files:
        try:
            doc = json.loads(path.read_text())
            int(doc["pid"]), int(doc["start"]), int(doc["port"])
            out[str(doc["model"])] = (path, doc)
        except (OSError, ValueError, KeyError, TypeError):
            out[f"?{path.name}"] = (path, None)
    return out


def wake_answers(doc: dict) -> dict[str, str]:
    """The greedy answers an identity file keeps for the wake check ({} when none, or not a str -> str map)."""
    answers = doc.get("wake_answers")
    if isinstance(answers, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in answers.items()):
        return answers
    return {}


def start_time(pid: int) -> str:
    """The process's start time as identity files record it ('' when it is gone)."""
    st = procfs.stat(pid)
    return str(st.start) if st is not None else ""


def _file_token(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:100]


def _write_atomically(path: Path, doc: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


class RuntimeFiles:
    """The identity files and the trainers' pid file of one agent's state directory."""

    def __init__(self, state_dir: Path, *, logger: Any) -> None:
        self.state_dir = state_dir
        self.logger = logger

    @property
    def children_path(self) -> Path:
        return self.state_dir / "children.json"

    def identity_path(self, model: str) -> Path:
        return self.state_dir / "runtimes" / f"{_file_token(model)}.json"

    def write_identity(self, model: str, runtime: Any) -> None:
        """Record who the runtime is, for the next agent (a runtime without an identity: nothing). The
        wake check's answers stay when the file already names this very process (same pid and start)."""
        identity = getattr(runtime, "identity", None)
        doc = identity() if identity is not None else None
        if doc is None:
            return
        path = self.identity_path(model)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            before = json.loads(path.read_text())
            if (before.get("pid"), before.get("start")) == (doc.get("pid"), doc.get("start")) and wake_answers(before):
                doc = {**doc, "wake_answers": wake_answers(before)}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_atomically(path, doc)
        except OSError as exc:
            self.logger.warning(
                "could not write the runtime's identity file", model=model, path=str(path), error=str(exc)
            )

    def write_wake_answers(self, model: str, answers: dict[str, str]) -> None:
        """Keep the greedy answers the runtime gave before it slept (agents/wake_check.py) in its identity
        file, for an agent that adopts it asleep ({} removes them: the wake was checked)."""
        path = self.identity_path(model)
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            self.logger.warning(
                "no identity file to keep the wake check's answers in; an agent restarted before "
                "the wake will wake it unchecked",
                model=model,
                path=str(path),
                error=str(exc),
            )
            return
        if answers:
            doc["wake_answers"] = answers
        elif doc.pop("wake_answers", None) is None:
            return
        try:
            _write_atomically(path, doc)
        except OSError as exc:
            self.logger.warning("could not keep the wake check's answers", model=model, path=str(path), error=str(exc))

    def drop_identity(self, model: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.identity_path(model).unlink()

    def write_children(self, trainers: Iterable[Any]) -> None:
        """The running trainers' pid file (runtimes have identity files of their own)."""
        kids = [
            {"pid": t.pgid, "start": start_time(t.pgid), "what": f"training:{t.spec.slot}", "grace_ms": t.grace_ms}
            for t in trainers
            if t.running() and t.pgid
        ]
        try:
            _write_atomically(self.children_path, kids)
        except OSError as exc:
            self.logger.warning("could not write the trainers' pid file", path=str(self.children_path), error=str(exc))

    def sweep_children(self, default_grace_ms: int) -> dict[str, str]:
        """Stop the trainers a previous agent on this host left running (their parent-death SIGTERM did not
        end them), with their grace: training is never left unsupervised. Returns slot -> how it ended.
        (A pid file from an agent before issue 14 also lists runtimes: they are stopped the same way.)"""
        swept: dict[str, str] = {}
        try:
            kids = json.loads(self.children_path.read_text())
        except (OSError, ValueError):
            return swept
        for kid in kids:
            pid = int(kid.get("pid", 0))
            start = kid.get("start")
            if pid > 1 and start and start_time(pid) == start:
                grace = int(kid.get("grace_ms") or default_grace_ms) / 1000
                ended = stop_group(pid, int(start), grace)
                what = str(kid.get("what", ""))
                if what.startswith("training:"):
                    swept[what.split(":", 1)[1]] = "killed" if ended == "killed" else "terminated"
                self.logger.warning("stopped a child the previous agent left", pid=pid, what=what, how=ended)
        return swept
