"""`haru pull`: fetch what a resolution names into the store, resumable and verified.

Per blob:
1. in `blobs/` already: re-hashed; right -> reused, wrong (a same-size corruption, a truncated copy)
   -> removed and fetched again ("healed");
2. a `partial/<digest>.part` left by an interrupted pull is hashed up to its length and continued
   with `Range: bytes=<length>-` (a 200 instead of 206 means the server ignored the range: start over);
3. the bytes stream into the `.part` while being hashed; a connection that breaks off leaves the
   `.part` for the next pull to resume, and the error says how far it got;
4. at the promised size the digest is checked: wrong -> the `.part` is deleted (if it had been
   resumed, the whole blob is fetched once more from zero first); right -> fsync, read-only, renamed
   into `blobs/`. More bytes than promised, or a response that ends short, is `Truncated`.

Credentials go only to the registry's own origin; redirects to a CDN carry none (aiohttp drops
`Authorization` across origins, and `Settings.headers_for` adds it only for the registry).
A `.lock` beside each `.part` (flock) keeps two pullers of the same blob from writing it together.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import aiohttp

from haru.models.errors import DigestMismatch, FetchError, Truncated
from haru.models.refs import Blob, Resolution
from haru.models.resolve import Settings, registry_error
from haru.models.store import CHUNK, Hasher, Store, hash_file

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
        self.stream.write(f"\r{self.label[:32]:<32} [{'#' * fill}{'.' * (width - fill)}] {pct:5.1f}% "
                          f"{format_size(self.done)}/{format_size(self.total)} {format_size(rate)}/s ETA {eta}   ")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


async def pull(res: Resolution, store: Store, settings: Settings, http: aiohttp.ClientSession, *,
               progress: Progress | None = None) -> PullResult:
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


async def fetch_blob(blob: Blob, store: Store, settings: Settings, http: aiohttp.ClientSession, *,
                     progress: Progress | None = None) -> tuple[int, int]:
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


async def _fetch_once(blob: Blob, part: Path, store: Store, settings: Settings, http: aiohttp.ClientSession,
                      progress: Progress | None) -> tuple[int, int]:
    offset = part.stat().st_size if part.exists() else 0
    if offset > blob.size:
        part.unlink()
        offset = 0
    hasher = await asyncio.to_thread(hash_file, part, blob.digest, blob.size) if offset else Hasher(blob.digest, blob.size)
    resumed = offset
    if progress and offset:
        progress.advance(offset, fetched=False)
    fetched = 0
    if offset < blob.size:
        headers = settings.headers_for(blob.url)
        if offset:
            headers["Range"] = f"bytes={offset}-"
        try:
            async with http.get(blob.url, headers=headers) as resp:
                if resp.status == 416 and offset:
                    part.unlink(missing_ok=True)
                    raise FetchError(f"{blob.url} refused the range bytes={offset}- (416); the partial download "
                                     "was removed, run the pull again to start that file over")
                if resp.status not in (200, 206):
                    raise registry_error(str(resp.url), resp.status, await resp.text(errors="replace"),
                                         f"{blob.name} ({blob.digest})")
                if offset and resp.status == 200:
                    if progress:
                        progress.advance(-offset, fetched=False)
                    offset, resumed = 0, 0  # the server ignored Range: the whole body comes again
                    hasher = Hasher(blob.digest, blob.size)
                elif resp.status == 206:
                    start = _range_start(resp.headers.get("Content-Range", ""))
                    if start != offset:
                        raise FetchError(f"{resp.url} answered Range bytes={offset}- with Content-Range "
                                         f"{resp.headers.get('Content-Range')!r}; cannot resume from that")
                mode = "ab" if offset else "wb"
                with open(part, mode) as out:
                    written = offset
                    # Writing and hashing a chunk happen in one worker thread (hashlib and file writes
                    # release the GIL) while the next chunk arrives: one chunk in flight, order kept.
                    sink = _Sink(out, hasher)
                    try:
                        async for chunk in resp.content.iter_chunked(CHUNK):
                            written += len(chunk)
                            if written > blob.size:
                                await sink.drain()
                                out.close()
                                part.unlink(missing_ok=True)
                                raise Truncated(f"{blob.name}: {resp.url} sent more than the {blob.size} bytes the "
                                                "registry promised; nothing was kept")
                            await sink.put(chunk)
                            fetched += len(chunk)
                            if progress:
                                progress.advance(len(chunk))
                        await sink.drain()
                    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                        await sink.drain()
                        out.flush()
                        raise FetchError(
                            f"{blob.name}: the download from {_host(blob.url)} broke off after "
                            f"{written} of {blob.size} bytes ({type(exc).__name__}: {exc}); run the same pull again "
                            f"to resume from byte {written}") from exc
                    finally:
                        sink.close()
                    out.flush()
                    await asyncio.to_thread(os.fsync, out.fileno())
                if written < blob.size:
                    raise Truncated(f"{blob.name}: {resp.url} ended the response after {written} of {blob.size} "
                                    f"bytes; run the same pull again to resume from byte {written}")
        except aiohttp.ClientConnectionError as exc:
            raise FetchError(f"{blob.name}: cannot fetch {blob.url}: {exc}; check the network or the registry URL, "
                             "then run the pull again (it resumes)") from exc
    if not hasher.ok():
        raise DigestMismatch(f"{blob.name}: the bytes from {_host(blob.url)} hash to {hasher.algo}:{hasher.hexdigest()}, "
                             f"not the expected {blob.digest}; they were discarded (the registry or something between "
                             "sent other bytes; try again, and if it persists the registry's metadata is wrong)")
    await asyncio.to_thread(store.commit_blob, part, blob.digest)
    return fetched, resumed


class _Sink:
    """Write and hash chunks in order, each on its own single-thread executor (file writes and hashlib
    release the GIL; one thread each keeps the order), up to IN_FLIGHT chunks behind the network: the
    receive, the write and the hash overlap instead of taking turns. Every WRITEBACK_BYTES written,
    the writer asks the kernel to start writing them to disk (`sync_file_range`, Linux), so the
    fsync before the rename waits for the tail only, not for the whole file (bench/pull.py)."""

    IN_FLIGHT = 4
    WRITEBACK_BYTES = 32 << 20

    def __init__(self, out, hasher: Hasher) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.out, self.hasher = out, hasher
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="haru-pull-write")
        self.hashing = ThreadPoolExecutor(1, thread_name_prefix="haru-pull-hash")
        self.pending: collections.deque[asyncio.Future] = collections.deque()
        self._unsynced = 0
        self._synced_to = out.tell()

    def _write(self, chunk: bytes) -> None:
        self.out.write(chunk)
        self._unsynced += len(chunk)
        if self._unsynced >= self.WRITEBACK_BYTES:
            self.out.flush()
            end = self.out.tell()
            _start_writeback(self.out.fileno(), self._synced_to, end - self._synced_to)
            self._synced_to, self._unsynced = end, 0

    async def put(self, chunk: bytes) -> None:
        while len(self.pending) >= 2 * self.IN_FLIGHT:
            await self.pending.popleft()
        loop = asyncio.get_running_loop()
        self.pending.append(loop.run_in_executor(self.writer, self._write, chunk))
        self.pending.append(loop.run_in_executor(self.hashing, self.hasher.update, chunk))

    async def drain(self) -> None:
        while self.pending:
            await self.pending.popleft()

    def close(self) -> None:
        self.writer.shutdown(wait=True)
        self.hashing.shutdown(wait=True)


def _load_sync_file_range():
    """libc's sync_file_range (Linux), or None: start writing a file range back, without waiting."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """A hint: the fsync before the rename is what makes the file durable, whatever this did."""
    if _sync_file_range is not None and nbytes > 0:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def _range_start(content_range: str) -> int:
    m = re.match(r"bytes (\d+)-", content_range.strip())
    return int(m.group(1)) if m else -1


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


__all__ = ["Progress", "PullResult", "fetch_blob", "format_size", "pull"]
