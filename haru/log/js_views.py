"""The views part of the JetStream log: the fleet views in the KV bucket haru_views, written by
compare-and-swap on their revision, read one at a time, all at once, or watched."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import nats.js.errors

from haru.core import subjects
from haru.core.errors import Conflict, LogUnavailable
from haru.log.jetstream import (
    CONFLICT_CODES,
    JetStreamClient,
    holds_nothing,
    not_an_answer,
    stream_state,
    translated,
)

__all__ = ["JetStreamViews"]


class JetStreamViews(JetStreamClient):
    """The views' KV bucket (`haru.log.seam.ViewStore`)."""

    async def _views(self) -> Any:
        if self._kv is None:
            with translated("opening the KV bucket haru_views"):
                try:
                    self._kv = await self.js.key_value(subjects.VIEWS_BUCKET)
                except nats.js.errors.BucketNotFoundError as exc:
                    raise LogUnavailable(
                        "the KV bucket haru_views does not exist yet: run `haru up` (or ensure())"
                    ) from exc
        return self._kv

    async def get_view(self, key: str) -> tuple[bytes, int] | None:
        kv = await self._views()
        with translated(f"reading view {key}"):
            try:
                entry = await kv.get(key)
            except nats.js.errors.KeyNotFoundError as exc:
                if not holds_nothing(exc):
                    raise not_an_answer(f"reading view {key}", exc) from exc
                return None
        if entry.value is None:
            return None
        return entry.value, entry.revision

    async def views(self) -> dict[str, bytes]:
        """Every view stored now, by key (empty when there is none)."""
        await self._views()
        out: dict[str, bytes] = {}
        # The bucket's subjects, counted by the server in one answer. nats-py's kv.keys() reads them through a
        # last-per-subject consumer and stops at its first "nothing pending", so a key rewritten while it
        # reads (a view during a failover) can come after that marker and be missed.
        prefix = f"$KV.{subjects.VIEWS_BUCKET}."
        with translated("listing views"):
            info = await stream_state(self.js, f"KV_{subjects.VIEWS_BUCKET}", subjects_filter=f"{prefix}>")
        keys = sorted(s.removeprefix(prefix) for s in (info.state.subjects or {}))
        for key in keys:
            got = await self.get_view(key)
            if got is not None:
                out[key] = got[0]
        return out

    async def put_view(self, key: str, data: bytes, *, last: int) -> int:
        """Compare-and-swap a view: `last` is the revision read (0 = the key must not exist)."""
        kv = await self._views()
        with translated(f"writing view {key}"):
            try:
                if last == 0:
                    return int(await kv.create(key, data))
                return int(await kv.update(key, data, last=last))
            except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError) as exc:
                if isinstance(exc, nats.js.errors.KeyWrongLastSequenceError) or exc.err_code in CONFLICT_CODES:
                    current = await self.get_view(key)
                    raise Conflict(f"kv:{key}", last, None if current is None else current[1]) from exc
                raise

    async def watch_views(self, pattern: str = "fleet.*") -> AsyncIterator[tuple[str, bytes | None, int]]:
        """Current views, then every change: (key, value or None when deleted, revision)."""
        kv = await self._views()
        with translated("watching views"):
            watcher = await kv.watch(pattern)
        try:
            async for entry in watcher:
                if entry is None:
                    continue  # the end of the initial values
                value = entry.value if entry.operation is None else None
                yield entry.key, value, entry.revision
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    # ------------------------------------------------------------------------- route intents
