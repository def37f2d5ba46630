"""The tokens this gateway served, recorded in the event log: `tokens_counted` on haru.evt.<fleet>.usage.

Every response whose body carried a `usage` (JSON or SSE, a continued stream's spliced one included) is
counted per (fleet, model) in a `Ledger` (a dict increment on the request path, beside the Prometheus
counter). The `UsageWriter` appends, every `interval_s` and once more when the gateway stops, one
`tokens_counted` per fleet with what was counted since its previous one: a delta, so the deltas of a
period add up to its tokens (haru.core.cost), whichever gateway served them.

Durability: counts are taken out of the ledger only when the append is acknowledged; an append that
fails puts them back for the next round. What a gateway counted and had not yet appended when it died
(at most one interval) is lost, and docs/cost.md says so. Appends are sequence-checked like every
other; several gateways write the same subject, so a `Conflict` is another gateway's append: re-read,
append again. Fleets the gateway does not know (`(unknown)`) are not written.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime

import structlog

from haru.core import subjects
from haru.core.errors import Conflict, InvalidName, LogError
from haru.core.events import ModelTokens, TokensCounted
from haru.host.tasks import cancel_and_wait

log = structlog.get_logger("haru.gateway")

__all__ = ["Ledger", "UsageWriter"]


class Ledger:
    """Tokens per (fleet, model) since the last `take`: prompt, completion, responses."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], list[int]] = {}

    def count(self, fleet: str, model: str, prompt: int, completion: int) -> None:
        c = self._counts.get((fleet, model))
        if c is None:
            c = self._counts[(fleet, model)] = [0, 0, 0]
        c[0] += prompt
        c[1] += completion
        c[2] += 1

    def take(self) -> dict[str, list[ModelTokens]]:
        counts, self._counts = self._counts, {}
        out: dict[str, list[ModelTokens]] = {}
        for (fleet, model), (prompt, completion, responses) in counts.items():
            out.setdefault(fleet, []).append(
                ModelTokens(model=model, prompt=prompt, completion=completion, responses=responses)
            )
        return out

    def put_back(self, fleet: str, models: list[ModelTokens]) -> None:
        for m in models:
            c = self._counts.setdefault((fleet, m.model), [0, 0, 0])
            c[0] += m.prompt
            c[1] += m.completion
            c[2] += m.responses


class UsageWriter:
    """Appends the ledger's deltas every `interval_s` and when it stops. An async context manager."""

    def __init__(self, events, ledger: Ledger, gateway: str, *, interval_s: float = 10.0, attempts: int = 5) -> None:
        self.events = events
        self.ledger = ledger
        self.gateway = gateway
        self.interval_s = interval_s
        self.attempts = attempts
        self.appended = 0
        self._since: dict[str, datetime] = {}
        self._last: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> UsageWriter:
        self._task = asyncio.create_task(self._run(), name="gateway-usage")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        with contextlib.suppress(Exception):  # the last deltas, bounded: a gateway that cannot write still stops
            await asyncio.wait_for(self.flush(), timeout=max(self.interval_s, 2.0))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.flush()
            except Exception as exc:  # the log is away: the counts were put back; try next round
                log.warning("gateway.usage_not_recorded", error=str(exc))

    async def flush(self) -> None:
        """Append one `tokens_counted` per fleet with what was counted; put back what could not be."""
        taken = self.ledger.take()
        now = datetime.now(UTC)
        failed: Exception | None = None
        for fleet, models in taken.items():
            try:
                subject = subjects.usage(fleet)
            except InvalidName:
                continue  # `(unknown)`: nothing a subject can name
            if failed is not None:
                self.ledger.put_back(fleet, models)
                continue
            event = TokensCounted(
                at=now, fleet=fleet, gateway=self.gateway, since=self._since.get(fleet), models=models
            )
            try:
                await self._append(subject, event)
            except (LogError, OSError) as exc:
                self.ledger.put_back(fleet, models)
                failed = exc
                continue
            self._since[fleet] = now
            self.appended += 1
        if failed is not None:
            raise failed

    async def _append(self, subject: str, event: TokensCounted) -> None:
        expect = self._last.get(subject)
        if expect is None:
            expect = await self.events.last_seq_of(subject)
        for _ in range(self.attempts):
            try:
                self._last[subject] = await self.events.append(subject, event, expect=expect)
                return
            except Conflict as exc:  # another gateway appended: ours is a delta, append it after theirs
                expect = exc.current if exc.current is not None else await self.events.last_seq_of(subject)
        raise Conflict(subject, expect, None)
