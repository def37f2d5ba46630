"""A layout's model that names a reference with its prefix (`"source": "ollama:qwen3:0.6b"`,
`"hf:ORG/REPO:Q4_K_M"`; a bare `Qwen/Qwen3-0.6B` stays what it was, an id vLLM fetches itself): the agent
pulls it into the store (`haru.models`, under the agent's $HARU_HOME) before starting the runtime.

On the model's own subject, so an agent writes only its domain's subjects:

    model_pulling{reference, done 0, total}          the pull starts (resolution done: sizes known)
    model_pulling{done, total}                        every PROGRESS_S while bytes arrive
    model_pulling{done = total, origin, files}        every file verified: where the files came from
    model_loading ...                                  the runtime starts on the materialized path
or  model_failed{runtime_said: "pull <ref>: <the registry's answer>"}   then the supervisor's backoff,
                                                       and a new attempt resumes the pull (HTTP Range)

The runtime's spec then names the materialized path; the declared spec keeps the reference.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from haru.agents.observe import Observation, PullProgressed, PullRefused
from haru.core import refs
from haru.core.events import FetchedFile
from haru.core.model_errors import ModelsError
from haru.models.pull import Progress, pull
from haru.models.resolve import Settings, resolve, session
from haru.models.store import Store, default_root

PROGRESS_S = 5.0
Record = Callable[[Any, Observation], Awaitable[object]]


class _Counted(Progress):
    def __init__(self, total: int) -> None:
        super().__init__(total, label="", enabled=False)


def needs_pull(source: str, runtime_kind: str) -> bool:
    return runtime_kind != "external" and refs.is_explicit_reference(source)


async def pull_for(m, record: Record, about: Callable[[Any], dict]) -> bool:
    """Pull `m`'s reference, recording `pulling` and its outcome; True when the runtime may start.

    `record(m, observation)` is the agent's one way to write what it saw (agents/observe.py decides the
    event); `about(m)` gives the fields every observation carries."""
    spec = m.runtime.spec
    reference = spec.source
    settings = Settings.from_env()
    store = Store(default_root())

    def pulling(done: int, total: int, **kw) -> PullProgressed:
        return PullProgressed(**about(m), reference=reference, done_bytes=done, total_bytes=total, **kw)

    async def failed(why: str) -> bool:
        if m.state_tag != "pulling":
            await record(m, pulling(0, 0))
        await record(m, PullRefused(**about(m), reference=reference, why=why))
        return False

    async with session(settings) as http:
        try:
            res = await resolve(reference, settings, http)
        except ModelsError as exc:
            return await failed(str(exc))
        want = refs.RUNTIME_OF[res.format]
        if want != m.runtime.kind:
            return await failed(
                f"it is a {res.format} model, served by {want}, but the layout declares runtime "
                f'{m.runtime.kind!r}; declare "runtime": "{want}" for it'
            )
        await record(m, pulling(0, res.total_bytes, origin=res.origin))
        progress = _Counted(res.total_bytes)

        async def report() -> None:
            last = 0
            while True:
                await asyncio.sleep(PROGRESS_S)
                if progress.done != last:
                    last = progress.done
                    await record(m, pulling(max(0, min(last, res.total_bytes)), res.total_bytes))

        reporter = asyncio.create_task(report(), name=f"pull-progress:{m.name}")
        try:
            result = await pull(res, store, settings, http, progress=progress)
        except ModelsError as exc:
            return await failed(str(exc))
        finally:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
    fetched = set(result.fetched)
    await record(
        m,
        pulling(
            res.total_bytes,
            res.total_bytes,
            origin=res.origin,
            files=[
                FetchedFile(name=b.name, digest=b.digest, size=b.size, fetched=b.digest in fetched) for b in res.blobs
            ],
        ),
    )
    m.runtime.spec = msgspec.structs.replace(spec, source=str(result.path))
    return True
