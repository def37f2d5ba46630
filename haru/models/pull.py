"""`haru pull`: fetch what a resolution names into the store, resumable and verified.

Per blob:
1. in `blobs/` already: re-hashed; right -> reused, wrong (a same-size corruption, a truncated copy)
   -> removed and fetched again ("healed");
2. a `partial/<digest>.part` left by an interrupted pull is hashed up to its length and continued
   with `Range: bytes=<length>-` (a 200 instead of 206 means the server ignored the range: start over);
3. the bytes stream into the `.part` while being hashed, on three threads off the event loop
   (`haru.models.download`: receive, write, hash side by side); a connection that breaks off leaves
   the `.part` for the next pull to resume, and the error says how far it got; a cancelled pull stops
   those threads and keeps the `.part` too;
4. at the promised size the digest is checked: wrong -> the `.part` is deleted (if it had been
   resumed, the whole blob is fetched once more from zero first); right -> fsync, read-only, renamed
   into `blobs/`. More bytes than promised, or a response that ends short, is `Truncated`.

Credentials go only to the registry's own origin; redirects to a CDN carry none (the download asks
`Settings.headers_for` again at every redirect, and it adds them only for the registry). The aiohttp
session resolves; for blob bodies only its timeouts are used. A `.lock` beside each `.part` (flock)
keeps two pullers of the same blob from writing it together.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from haru.core.model_errors import DigestMismatch
from haru.core.refs import Blob, Resolution
from haru.core.sizes import format_size
from haru.models.download import Download
from haru.models.resolve import Settings
from haru.models.store import Hasher, Store, hash_file

ProgressFn = Callable[[int], None]


@dataclass
class PullResult:
    resolution: Resolution
    path: Path
    fetched_bytes: int = 0  # bytes that came over the network in this pull
    reused_bytes: int = 0  # bytes already verified in the store (or resumed from a .part)
    healed: list[str] = field(default_factory=list)  # digests found corrupt and fetched again
    fetched: list[str] = field(default_factory=list)  # digests that came (at least partly) over the network
    took_ms: int = 0


class Progress:
    """A progress bar on a terminal (bytes, rate, ETA), nothing otherwise. Redrawn at most 10 times a second."""

    def __init__(self, total: int, *, label: str, stream=None, enabled: bool | None = None) -> None:
        import sys

        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total, self.label, self.done = total, label, 0
        self.fetched = 0
        self.started = time.monotonic()
        self._drawn = 0.0

    def advance(self, n: int, *, fetched: bool = True) -> None:
        self.done += n
        if fetched:
            self.fetched += n
        now = time.monotonic()
        if self.enabled and (now - self._drawn >= 0.1 or self.done >= self.total):
            self._drawn = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        took = max(now - self.started, 1e-6)
        rate = self.fetched / took
        left = max(self.total - self.done, 0)
        eta = f"{left / rate:.0f}s" if rate > 0 and left else "-"
        pct = 100.0 * self.done / self.total if self.total else 100.0
        width = 24
        fill = int(width * pct / 100)
        self.stream.write(
            f"\r{self.label[:32]:<32} [{'#' * fill}{'.' * (width - fill)}] {pct:5.1f}% "
            f"{format_size(self.done)}/{format_size(self.total)} {format_size(rate)}/s ETA {eta}   "
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()


async def pull(
    res: Resolution, store: Store, settings: Settings, http: aiohttp.ClientSession, *, progress: Progress | None = None
) -> PullResult:
    """Every blob of `res` verified in the store, then the materialized path. Raises ModelsError subclasses."""
    started = time.monotonic()
    store.ensure_dirs()
    result = PullResult(resolution=res, path=store.root)
    for blob in res.blobs:
        state = await asyncio.to_thread(store.verified, blob.digest, blob.size)
        if state:
            result.reused_bytes += blob.size
            if progress:
                progress.advance(blob.size, fetched=False)
            continue
        if state is False:
            await asyncio.to_thread(store.discard_blob, blob.digest)
            result.healed.append(blob.digest)
        fetched, resumed = await fetch_blob(blob, store, settings, http, progress=progress)
        result.fetched_bytes += fetched
        result.reused_bytes += resumed
        if fetched:
            result.fetched.append(blob.digest)
    result.path = await asyncio.to_thread(store.materialize, res)
    result.took_ms = int((time.monotonic() - started) * 1000)
    return result


async def fetch_blob(
    blob: Blob, store: Store, settings: Settings, http: aiohttp.ClientSession, *, progress: Progress | None = None
) -> tuple[int, int]:
    """Fetch one blob into `blobs/`. Returns (bytes fetched now, bytes resumed from an earlier .part)."""
    part = store.partial(blob.digest)
    async with _locked(part.with_suffix(".lock")):
        if store.blob(blob.digest).exists():  # another puller finished it while we waited
            return 0, blob.size
        for attempt in (1, 2):
            was_resumed = part.exists() and part.stat().st_size > 0
            try:
                return await _fetch_once(blob, part, store, settings, http, progress)
            except DigestMismatch:
                part.unlink(missing_ok=True)
                if attempt == 2 or not was_resumed:
                    raise
                # the resumed .part may have been what was bad: fetch the whole blob once more
                if progress:
                    progress.advance(-blob.size, fetched=False)
    raise AssertionError("unreachable")


async def _fetch_once(
    blob: Blob, part: Path, store: Store, settings: Settings, http: aiohttp.ClientSession, progress: Progress | None
) -> tuple[int, int]:
    offset = part.stat().st_size if part.exists() else 0
    if offset > blob.size:
        part.unlink()
        offset = 0
    hasher = (
        await asyncio.to_thread(hash_file, part, blob.digest, blob.size) if offset else Hasher(blob.digest, blob.size)
    )
    resumed = offset
    if progress and offset:
        progress.advance(offset, fetched=False)
    fetched = 0
    if offset < blob.size:
        download = Download(blob, part, offset, hasher, settings, http.timeout)

        def advance(n: int) -> None:  # negative once if a server ignored the Range: the .part starts over
            if progress:
                progress.advance(n, fetched=n > 0)

        await download.run(advance)
        hasher, resumed, fetched = download.hasher, download.start, download.written - download.start
    if not hasher.ok():
        raise DigestMismatch(
            f"{blob.name}: the bytes from {_host(blob.url)} hash to {hasher.algo}:{hasher.hexdigest()}, "
            f"not the expected {blob.digest}; they were discarded (the registry or something between "
            "sent other bytes; try again, and if it persists the registry's metadata is wrong)"
        )
    await asyncio.to_thread(store.commit_blob, part, blob.digest)
    return fetched, resumed


def _host(url: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(url).netloc or url


@contextlib.asynccontextmanager
async def _locked(path: Path):
    """flock without blocking the event loop (an agent pulling must keep its heartbeat)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(0.2)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


__all__ = ["Progress", "PullResult", "fetch_blob", "pull"]
