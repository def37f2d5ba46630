"""What a starting agent does with the runtimes a previous agent left (docs/agent.md, "Restarts keep
runtimes"): for each identity file, by `runtime_on_start`'s verdict,

    adopt     the process is the recorded one, runs the planned command line, and answers (/health,
              /v1/models lists the model): kept, to be adopted by the model's supervisor (`Adoptable`)
    stop      the layout no longer has the model, or changed it: stopped; `unwanted(model, why)` records it
    start     it died while no agent watched (or its pid is a stranger's now: never signalled): said once
              in `lost` by the supervisor before it loads the model anew (`away`)

A runtime that is the recorded process but does not answer is stopped and counted `away` too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from haru.agents.errors import RuntimeProblem
from haru.agents.model_slot import RUNTIME_STOP_GRACE_S, ModelSlot
from haru.agents.runtime_files import read_identities, runtime_on_start, wake_answers
from haru.host.children import stop_group

__all__ = ["Adoptable", "FoundRuntimes", "find_runtimes"]


class Adoptable(msgspec.Struct, frozen=True, kw_only=True):
    """A live runtime of a previous agent that the model's supervisor adopts."""

    pid: int
    asleep: bool
    endpoint: str
    wake_answers: dict[str, str] = {}  # what it answered before it slept (its identity file): the wake check's


class FoundRuntimes(msgspec.Struct, kw_only=True):
    adoptable: dict[str, Adoptable] = {}  # model -> the runtime to adopt
    away: dict[str, str] = {}  # model -> what is known of a runtime that died while no agent watched


async def find_runtimes(
    state_dir: Path,
    models: Mapping[str, ModelSlot],
    *,
    probe_timeout_s: float,
    unwanted: Callable[[str, str], Awaitable[None]],
    logger: Any,
    why_unwanted: Callable[[str], str] = lambda _name: "the layout no longer has this model",
) -> FoundRuntimes:
    """Read the identity files a previous agent left: adopt what still matches the layout and answers,
    stop what the layout no longer wants, and note what died while no agent watched. A pid now held by
    another process is never touched."""
    found = FoundRuntimes()
    timeout = min(probe_timeout_s, 5.0)
    for name, (path, doc) in read_identities(state_dir).items():
        if doc is None:
            logger.warning("unreadable runtime identity file; ignored", path=str(path))
            path.unlink(missing_ok=True)
            continue
        pid, start, port = int(doc["pid"]), int(doc["start"]), int(doc["port"])
        log = logger.bind(model=name, pid=pid)
        m = models.get(name)
        verdict = runtime_on_start(doc, m.runtime if m else None, m.spec if m else None, why_unwanted(name))
        if verdict.action == "start":
            found.away[name] = verdict.why
            path.unlink(missing_ok=True)
            log.warning("runtime died while no agent watched it", why=verdict.why)
            continue
        if verdict.action in ("stop", "replace"):
            log.info("stopping a runtime the layout no longer wants", why=verdict.why)
            await asyncio.to_thread(stop_group, pid, start, RUNTIME_STOP_GRACE_S)
            path.unlink(missing_ok=True)
            await unwanted(name, verdict.why)
            continue
        assert m is not None
        if not m.runtime.adopt(pid, start, port, list(doc.get("argv") or [])):  # type: ignore[attr-defined]
            found.away[name] = f"the runtime (pid {pid}) exited while the agent was starting"
            path.unlink(missing_ok=True)
            continue
        health = await m.runtime.health(timeout_s=timeout)
        listed = False
        asleep: bool | None = None
        if health.ok:
            with contextlib.suppress(RuntimeProblem):
                listed = m.name in await m.runtime.list_models(timeout_s=timeout)
            with contextlib.suppress(RuntimeProblem):
                asleep = await m.runtime.is_sleeping(timeout_s=timeout)
        if not (health.ok and listed):
            why = (
                health.detail or f"/health answered {health.status}"
                if not health.ok
                else "it no longer lists the model"
            )
            log.warning("not adopting a runtime that does not answer; stopping it", why=why)
            m.on_purpose = True
            await m.runtime.stop(RUNTIME_STOP_GRACE_S)
            m.on_purpose = False
            path.unlink(missing_ok=True)
            found.away[name] = f"the runtime (pid {pid}) outlived its agent but did not answer ({why[:200]}); stopped"
            continue
        # Answers kept while it is awake mean a wake nobody checked: its agent died between the wake and
        # the check. The next agent checks them on adoption (agents/supervisor.py `_adopt`).
        found.adoptable[name] = Adoptable(
            pid=pid, asleep=bool(asleep), endpoint=m.runtime.base_url, wake_answers=wake_answers(doc)
        )
    return found
