"""One blob's bytes into its `.part`: the HTTP transfer on three threads, off the event loop.

    receiver   (haru-pull-recv)   connect, request, follow redirects; then the body from the socket
                                  straight into a ring of RING preallocated 1 MiB buffers (`readinto1`:
                                  no `bytes` object per read, no joins)
    writer     (haru-pull-write)  each received segment -> the `.part` (`os.pwrite`), written behind
                                  (`_PartFile`: the page cache holds a few MiB of it, not the blob)
    hasher     (haru-pull-hash)   the same segment, beside the writer -> sha256 (or git's sha1)

Socket reads, file writes and hashlib all release the GIL, so the three run side by side: the hash
(the one cost curl does not pay) overlaps the receive and the write instead of taking turns with them.
A buffer is free again once both the writer and the hasher are done with it. A segment goes on as soon
as the socket has nothing more to give at once (or at 256 KiB, or at the end of a buffer), so a slow
download grows the `.part` as the bytes arrive and a puller killed at any moment has on disk all it
had received, bar the last segment.

Why not aiohttp (still used for resolution): on the event loop, the receive, its 1 MiB joins and the
hand-offs to the write and hash threads cost as much CPU as the sha256 itself; on two cores that made
`haru pull` 0.58–0.82x of curl in bench/pull.py, and this layout 0.81–1.09x (docs/models.md#benchmark).

What the transfer keeps from the aiohttp session it replaced for blob bodies: its timeouts (`connect`
for the TCP and TLS handshake, `sock_read` for every read: a stalled server fails the pull, it never
hangs it), no proxy taken from the environment (the session does not trust it either), HTTPS with
`ssl.create_default_context()`, credentials only where `Settings.headers_for` puts them (recomputed
at every redirect, so a CDN on another origin never sees the registry's token), at most 10 redirects.

Cancellation (`Download.run`'s task cancelled, e.g. an agent stopping mid-pull): the receiver's socket
is shut down, which wakes a blocked read; the threads stop at their next segment and the file is closed
with everything written so far, so the `.part` resumes; `run` waits for that before it re-raises (the
caller's flock stays held until nobody writes the file). Before the file is opened there is nothing to
wait for: a thread still connecting finds the stop flag when it returns and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import http.client
import mmap
import os
import queue
import re
import select
import socket
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import aiohttp

from haru.core.model_errors import FetchError, StoreError, Truncated
from haru.core.refs import Blob
from haru.models.resolve import TIMEOUT, Settings, registry_error
from haru.models.store import CHUNK, Hasher

RING = 16  # buffers of CHUNK bytes: 4 left the hasher idle a third of the time on 2 cores (bench/pull.py)
HANDOFF = 256 << 10  # a segment goes to the writer at this size even while more is waiting in the socket
WRITE_BEHIND = 8 << 20  # the `.part` is written back to disk, and dropped from the page cache, in windows of this
MAX_REDIRECTS = 10  # as aiohttp
PROGRESS_S = 0.1  # how often `run` reads the byte count for the progress bar
REDIRECTS = (301, 302, 303, 307, 308)

Segment = tuple[int, int, int, bool]  # (buffer, start, end, the buffer's last segment)


class _Stopped(Exception):
    """The transfer was asked to stop (its task was cancelled)."""


class Download:
    """`blob` from byte `offset` into `part`, whose first `offset` bytes `hasher` has already seen.

    After `run`: `hasher` holds the digest of the whole `.part`, `written` its length, `start` the byte
    the body began at (0 when a server ignored the Range and sent everything)."""

    def __init__(
        self, blob: Blob, part: Path, offset: int, hasher: Hasher, settings: Settings, timeout: aiohttp.ClientTimeout
    ) -> None:
        self.blob, self.part, self.offset, self.hasher, self.settings = blob, part, offset, hasher, settings
        self.connect_s = timeout.sock_connect or timeout.connect or TIMEOUT.connect
        self.read_s = timeout.sock_read or TIMEOUT.sock_read
        self.start = offset
        self.written = offset  # bytes in the .part, counted by the writer
        self._state = threading.Lock()  # guards _stopping, _sock and _part against `_stop` on the loop
        self._stopping = False
        self._sock: socket.socket | None = None
        self._part: _PartFile | None = None
        self._write_error: OSError | None = None
        self._crashed: Exception | None = None  # what the writer or hasher thread raised that it should not have
        self._ring = memoryview(b"")  # RING buffers of CHUNK bytes while the body streams (_take_ring)
        # Each segment goes to both the writer and the hasher; each hands a buffer back when done with its
        # last segment. Both go through the buffers in the receiver's order, so the two queues give back
        # the same buffer in the same order: one free in both is free.
        self._to_write: queue.SimpleQueue[Segment | None] = queue.SimpleQueue()
        self._to_hash: queue.SimpleQueue[Segment | None] = queue.SimpleQueue()
        self._written_out: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._hashed: queue.SimpleQueue[int] = queue.SimpleQueue()

    # ---------------------------------------------------------------------------- on the event loop

    async def run(self, advance: Callable[[int], None]) -> None:
        """The transfer on its threads; `advance(n)` (on the loop) with the bytes written since the
        last call, every PROGRESS_S. Raises FetchError, Truncated, RegistryError or StoreError."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        threading.Thread(target=self._main, args=(loop, done), name="haru-pull-recv", daemon=True).start()
        reported = self.offset
        try:
            while not done.done():
                await asyncio.wait({done}, timeout=PROGRESS_S)
                reported = self._report(advance, reported)
        except asyncio.CancelledError:
            if self._stop():
                await _wait_through_cancels(done)
                self._report(advance, reported)
            else:
                done.cancel()  # the thread finds the flag before it opens anything: no one to wait for
            raise
        done.result()

    def _report(self, advance: Callable[[int], None], reported: int) -> int:
        now = self.written
        if now != reported:
            advance(now - reported)
        return now

    def _stop(self) -> bool:
        """Ask the threads to stop; True if the `.part` is open (then they must be waited for)."""
        with self._state:
            self._stopping = True
            sock, opened = self._sock, self._part is not None
        if sock is not None:  # wakes a read blocked on it; the base class's, so an SSLSocket keeps its state
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
        return opened

    # ---------------------------------------------------------------------------- on the receiver thread

    def _main(self, loop: asyncio.AbstractEventLoop, done: asyncio.Future[None]) -> None:
        error: BaseException | None = None
        try:
            self._transfer()
        except BaseException as exc:  # handed to the loop, raised there
            error = exc

        def settle() -> None:
            if done.cancelled():
                return
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

        with contextlib.suppress(RuntimeError):  # the loop is closed: the pull was cancelled and is over
            loop.call_soon_threadsafe(settle)

    def _transfer(self) -> None:
        conn, resp, url = self._request()
        try:
            self._pump(url, resp, self._body_start(url, resp))
        finally:
            resp.close()
            conn.close()
            with self._state:
                sock, self._sock = self._sock, None
            if sock is not None:
                sock.close()

    def _request(self) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, str]:
        """GET the blob's URL, following redirects; the connection, its response and the final URL."""
        url = self.blob.url
        for _ in range(MAX_REDIRECTS + 1):
            headers = self.settings.headers_for(url)  # per hop: credentials only for the registry's origin
            if self.offset:
                headers["Range"] = f"bytes={self.offset}-"
            conn = self._connect(url)
            try:
                u = urlsplit(url)
                conn.request("GET", (u.path or "/") + (f"?{u.query}" if u.query else ""), headers=headers)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                self._check_stopping()
                raise FetchError(
                    f"{self.blob.name}: cannot fetch {url}: {_said(exc)}; check the network or the "
                    "registry URL, then run the pull again (it resumes)"
                ) from exc
            location = resp.getheader("Location")
            if resp.status in REDIRECTS and location:
                resp.close()
                conn.close()
                url = urljoin(url, location)
                continue
            return conn, resp, url
        raise FetchError(
            f"{self.blob.name}: {self.blob.url} redirected more than {MAX_REDIRECTS} times (last to "
            f"{url}); the registry or its CDN is misconfigured"
        )

    def _connect(self, url: str) -> http.client.HTTPConnection:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise FetchError(f"{self.blob.name}: cannot fetch {url}: not an http(s) URL")
        conn: http.client.HTTPConnection
        if u.scheme == "https":
            conn = http.client.HTTPSConnection(u.hostname, u.port, timeout=self.connect_s, context=_tls())
        else:
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=self.connect_s)
        try:
            conn.connect()  # TCP (and TLS) within the connect timeout; every read after it within read_s
        except OSError as exc:
            conn.close()
            self._check_stopping()
            raise FetchError(
                f"{self.blob.name}: cannot fetch {url}: {_said(exc)}; check the network or the "
                "registry URL, then run the pull again (it resumes)"
            ) from exc
        assert conn.sock is not None
        conn.sock.settimeout(self.read_s)
        with self._state:
            self._sock = conn.sock
            stopping = self._stopping
        if stopping:
            conn.close()
            raise _Stopped()
        return conn

    def _body_start(self, url: str, resp: http.client.HTTPResponse) -> int:
        """The byte of the blob the body starts at, or the registry's error."""
        blob, offset = self.blob, self.offset
        if resp.status == 416 and offset:
            self.part.unlink(missing_ok=True)
            raise FetchError(
                f"{blob.url} refused the range bytes={offset}- (416); the partial download "
                "was removed, run the pull again to start that file over"
            )
        if resp.status not in (200, 206):
            try:
                said = resp.read(4096).decode("utf-8", "replace")
            except (OSError, http.client.HTTPException):
                said = ""
            raise registry_error(url, resp.status, said, f"{blob.name} ({blob.digest})")
        if resp.status == 200:
            return 0  # with a Range sent, the server ignored it: the whole body comes again
        content_range = resp.getheader("Content-Range", "")
        if _range_start(content_range) != offset:
            raise FetchError(
                f"{url} answered Range bytes={offset}- with Content-Range {content_range!r}; cannot resume from that"
            )
        return offset

    def _pump(self, url: str, resp: http.client.HTTPResponse, start: int) -> None:
        blob = self.blob
        length = resp.length if not resp.chunked else None  # None: until the connection closes, or chunked
        if length is not None and start + length > blob.size:
            self.part.unlink(missing_ok=True)
            raise Truncated(
                f"{blob.name}: {url} announced {start + length} bytes, more than the {blob.size} the "
                "registry promised; nothing was kept"
            )
        if start != self.offset:
            self.hasher = Hasher(blob.digest, blob.size)
        self.start = self.written = start
        ring = _take_ring()
        with self._state:
            try:
                if self._stopping:
                    raise _Stopped()
                self._part = part = _PartFile(self.part, start)
            except OSError as exc:
                raise StoreError(
                    f"{blob.name}: cannot write {self.part}: {exc.strerror}; check the permissions "
                    "and free space there (or set HARU_HOME elsewhere)"
                ) from exc
            finally:
                if self._part is None:
                    _give_back(ring)
        self._ring = memoryview(ring)
        try:
            ended, broke = self._stream(resp, length, start, part)
            self._judge(url, part, start, length, ended, broke)
        finally:
            part.close()
            with self._state:
                self._part = None
            self._ring = memoryview(b"")
            _give_back(ring)

    def _stream(
        self, resp: http.client.HTTPResponse, length: int | None, start: int, part: _PartFile
    ) -> tuple[bool, BaseException | None]:
        """Receive, write and hash side by side until the body ends, breaks off, or a stop: (whether it
        ended where it said it would, what broke it)."""
        for i in range(RING):
            self._written_out.put(i)
            self._hashed.put(i)
        writer = threading.Thread(target=self._write_all, args=(part,), name="haru-pull-write", daemon=True)
        hasher = threading.Thread(target=self._hash_all, name="haru-pull-hash", daemon=True)
        writer.start()
        hasher.start()
        try:
            return self._receive(resp, length, self.blob.size - start), None
        except (OSError, http.client.HTTPException) as exc:
            return False, exc
        except _Stopped:
            return False, None  # cancelled, or the writer failed: _judge says which
        finally:
            self._to_write.put(None)
            self._to_hash.put(None)
            writer.join()
            hasher.join()

    def _judge(
        self, url: str, part: _PartFile, start: int, length: int | None, ended: bool, broke: BaseException | None
    ) -> None:
        """The `.part` durable if the whole body came; otherwise the error that says what happened."""
        blob = self.blob
        if self._crashed is not None:
            raise self._crashed
        if self._write_error is not None:
            raise StoreError(
                f"{blob.name}: cannot write {self.part}: {self._write_error.strerror}; free space "
                f"there (or set HARU_HOME elsewhere), then run the pull again (it resumes from "
                f"byte {self.written})"
            ) from self._write_error
        self._check_stopping()
        got = self.written
        if got > blob.size:
            part.close()
            self.part.unlink(missing_ok=True)
            raise Truncated(
                f"{blob.name}: {url} sent more than the {blob.size} bytes the registry promised; nothing was kept"
            )
        if broke is not None or not ended:
            why = (
                _said(broke)
                if broke is not None
                else f"the connection closed {start + (length or 0) - got} bytes before the end it announced"
            )
            raise FetchError(
                f"{blob.name}: the download from {_host(url)} broke off after {got} of {blob.size} "
                f"bytes ({why}); run the same pull again to resume from byte {got}"
            ) from broke
        if got < blob.size:
            raise Truncated(
                f"{blob.name}: {url} ended the response after {got} of {blob.size} bytes; run the "
                f"same pull again to resume from byte {got}"
            )
        part.fsync()

    def _receive(self, resp: http.client.HTTPResponse, length: int | None, room: int) -> bool:
        """Read the body into the ring, handing segments to the writer and the hasher. True when the body
        ended where it said it would (or, without a length, when the server closed it); False when it
        closed early."""
        remaining = length if length is not None else room + 1  # one byte past the promise: too much
        readinto: Callable[[memoryview], int]
        if length is not None:
            fp = resp.fp  # the socket's buffered reader: what came with the headers, then the socket itself
            readinto = fp.readinto1
        else:
            readinto = functools.partial(_copy_read1, resp)
        sock = self._sock
        poller = select.poll()
        if sock is not None:
            poller.register(sock, select.POLLIN)

        def more_waiting() -> bool:
            if isinstance(sock, ssl.SSLSocket) and sock.pending():
                return True
            return bool(poller.poll(0))

        ring, buf, pos, seg = self._ring, self._next_free(), 0, 0
        try:
            while remaining > 0:
                base = buf * CHUNK
                n = readinto(ring[base + pos : base + min(CHUNK, pos + remaining)])
                self._check_stopping()  # after a stop, what a read returns is not the body's
                if not n:
                    return length is None
                pos += n
                remaining -= n
                if pos == CHUNK:
                    self._hand_on((buf, seg, pos, True))
                    buf, pos, seg = self._next_free(), 0, 0
                elif pos - seg >= HANDOFF or not more_waiting():
                    self._hand_on((buf, seg, pos, False))
                    seg = pos
            return True
        finally:
            self._hand_on((buf, seg, pos, True))  # the rest, and the buffer back

    def _hand_on(self, seg: Segment) -> None:
        self._to_write.put(seg)
        self._to_hash.put(seg)

    def _next_free(self) -> int:
        buf, hashed = self._written_out.get(), self._hashed.get()
        assert buf == hashed, (buf, hashed)
        return buf

    # ---------------------------------------------------------------------------- writer and hasher threads

    def _write_all(self, part: _PartFile) -> None:
        while (seg := self._to_write.get()) is not None:
            buf, a, b, last = seg
            if b > a and self._write_error is None and self._crashed is None:
                try:
                    part.write(self._ring[buf * CHUNK + a : buf * CHUNK + b])
                except OSError as exc:  # a full disk, say: stop the receiver, the pull fails with it
                    self._write_error = exc
                    self._stop()
                except Exception as exc:  # a bug: stop as well, rather than leave the receiver waiting for buffers
                    self._crashed = exc
                    self._stop()
                self.written = part.size
            if last:
                self._written_out.put(buf)

    def _hash_all(self) -> None:
        while (seg := self._to_hash.get()) is not None:
            buf, a, b, last = seg
            if b > a and self._crashed is None:
                try:
                    self.hasher.update(self._ring[buf * CHUNK + a : buf * CHUNK + b])
                except Exception as exc:  # a bug: as in _write_all
                    self._crashed = exc
                    self._stop()
            if last:
                self._hashed.put(buf)

    def _check_stopping(self) -> None:
        if self._stopping:
            raise _Stopped()


class _PartFile:
    """The `.part`, open for writing from `start`, written behind: every WRITE_BEHIND bytes the kernel
    is asked to start writing the newest window to disk, and the window before it, once on disk, is
    dropped from the page cache (`sync_file_range`, Linux; `posix_fadvise`). The disk works while the
    bytes arrive, the fsync before the rename waits for the last window only, and a pull touches a few
    MiB of page cache over and over instead of a fresh page for every byte of the blob: on this VM a
    page cache page not used for ~2 s goes back to the host and costs a fault to get again, which made
    one 256 MiB write in three take 0.7 s of CPU instead of 0.05 s (bench/pull.py, docs/models.md). A
    pull does not evict the page cache of what is being served either; the price is a blob that is read
    from disk, not from memory, the first time after its pull. Without sync_file_range it is a plain
    buffered file."""

    def __init__(self, path: Path, start: int) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | (0 if start else os.O_TRUNC), 0o644)
        self.size = self._window = start  # the .part's length; where the newest window begins
        self._behind: tuple[int, int] | None = None  # the window being written back: (offset, length)

    def write(self, view: memoryview) -> None:
        while view:
            n = os.pwrite(self.fd, view, self.size)
            self.size += n
            view = view[n:]
        if _sync_file_range is not None and self.size - self._window >= WRITE_BEHIND:
            window = (self._window, self.size - self._window)
            _sync_file_range(self.fd, *window, _SYNC_FILE_RANGE_WRITE)
            if self._behind is not None:
                _sync_file_range(self.fd, *self._behind, _SYNC_FILE_RANGE_WAIT_ALL)
                with contextlib.suppress(OSError):  # a hint, as the writeback is: the fsync is what counts
                    os.posix_fadvise(self.fd, *self._behind, os.POSIX_FADV_DONTNEED)
            self._behind, self._window = window, self.size

    def fsync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_idle_rings: list[mmap.mmap] = []
_idle_lock = threading.Lock()


def _take_ring() -> mmap.mmap:
    """RING * CHUNK bytes: the last pull's if it is free. Reusing it saves faulting 16 MiB of fresh
    pages in at every blob: 0.27 s instead of 0.30 s a 256 MiB pull here (on this VM a page long
    unused is the host's again, and slow to touch; _PartFile)."""
    with _idle_lock:
        if _idle_rings:
            return _idle_rings.pop()
    return mmap.mmap(-1, RING * CHUNK)


def _give_back(ring: mmap.mmap) -> None:
    with _idle_lock:
        if not _idle_rings:  # one kept (16 MiB for the life of the process); more pulls at once make their own
            _idle_rings.append(ring)


async def _wait_through_cancels(fut: asyncio.Future[None]) -> None:
    """Wait for `fut` even if cancelled again meanwhile (the threads stop within one read or write)."""
    while not fut.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({fut})
    if not fut.cancelled():
        fut.exception()  # retrieved: the _Stopped it ends with is expected


def _copy_read1(resp: http.client.HTTPResponse, into: memoryview) -> int:
    """A chunked body (or one without a length): http.client decodes it, the bytes are copied in."""
    data = resp.read1(len(into))
    into[: len(data)] = data
    return len(data)


@functools.cache
def _tls() -> ssl.SSLContext:
    """What aiohttp's verified connections use (certificates from the system's store), made once."""
    ctx = ssl.create_default_context()
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def _said(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _range_start(content_range: str) -> int:
    m = re.match(r"bytes (\d+)-", content_range.strip())
    return int(m.group(1)) if m else -1


def _host(url: str) -> str:
    return urlsplit(url).netloc or url


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range (Linux), or None: write a file range back to disk now (start it, or wait for it)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writing the range's dirty pages back
_SYNC_FILE_RANGE_WAIT_ALL = 7  # and wait until they are, before and after
