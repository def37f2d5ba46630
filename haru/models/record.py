"""A pull as history: the `model_fetched` event, and its append to `haru.evt.<fleet>.decl`."""

from __future__ import annotations

import socket
from datetime import UTC, datetime

from haru.core import subjects
from haru.core.errors import Conflict
from haru.core.events import FetchedFile, ModelFetched
from haru.models.pull import PullResult


def fetched_event(
    result: PullResult, *, model: str = "", domain: str = "", by: str = "", at: datetime | None = None
) -> ModelFetched:
    res = result.resolution
    fetched = set(result.fetched)
    return ModelFetched(
        at=at or datetime.now(UTC),
        by=by,
        reference=res.reference,
        model=model,
        domain=domain,
        origin=res.origin,
        revision=res.revision,
        format=res.format,
        path=str(result.path),
        host=socket.gethostname(),
        files=[FetchedFile(name=b.name, digest=b.digest, size=b.size, fetched=b.digest in fetched) for b in res.blobs],
        fetched_bytes=result.fetched_bytes,
        reused_bytes=result.reused_bytes,
        healed=list(result.healed),
        took_ms=result.took_ms,
    )


async def record_fetch(log, fleet: str, event: ModelFetched, *, attempts: int = 5) -> int:
    """Append to the fleet's decl subject with its expected sequence, re-reading on a lost race."""
    subject = subjects.decl(fleet)
    for attempt in range(attempts):
        expect = await log.last_seq_of(subject)
        try:
            return await log.append(subject, event, expect=expect)
        except Conflict:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")
