"""A small HTTP/1.1 response parser for the upstream side of the proxy. Pure: no I/O.

The proxy talks to a handful of known upstreams (the agent's serving port, vLLM's uvicorn,
llama-server) and only ever sends POST; what it needs from a response is the status, the headers,
and the body framing (Content-Length, chunked, or until close), with the body handed on piece by
piece as it arrives. aiohttp's client does all that and much more, for ~90 µs of CPU a request
here (NOTES.md, bench/gateway.py); this parser and `gateway.upstream` do the part the proxy needs
for a fraction of it.

    parser = ResponseParser(on_head, on_data, on_end)
    parser.feed(bytes)        # as data arrives; raises ProtocolError on a malformed response
    parser.eof()              # the connection closed; ends an until-close body, or raises

`on_head(status, headers, keep_alive)`, `on_data(bytes)`, `on_end()`. Informational (1xx) heads
are skipped. Chunk extensions and trailers are read and dropped.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.errors import ProtocolError

MAX_HEAD_BYTES = 64 * 1024
MAX_CHUNK_LINE = 4096

_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILERS, _UNTIL_CLOSE, _DONE = range(8)


Headers = list[tuple[str, str]]


class ResponseParser:
    __slots__ = ("_state", "_buf", "_remaining", "_on_head", "_on_data", "_on_end", "status", "keep_alive",
                 "no_body")

    def __init__(self, on_head: Callable[[int, Headers, bool], None], on_data: Callable[[bytes], None],
                 on_end: Callable[[], None], *, no_body: bool = False) -> None:
        self._state = _HEAD
        self._buf = b""
        self._remaining = 0
        self._on_head = on_head
        self._on_data = on_data
        self._on_end = on_end
        self.status = 0
        self.keep_alive = False
        self.no_body = no_body  # a response to HEAD

    @property
    def done(self) -> bool:
        return self._state == _DONE

    @property
    def started(self) -> bool:
        """Any byte of a response seen (a reused connection that dies before this may be retried)."""
        return self._state != _HEAD or bool(self._buf)

    def feed(self, data: bytes) -> None:
        while data:
            state = self._state
            if state == _LENGTH:
                n = self._remaining
                if len(data) < n:
                    self._remaining = n - len(data)
                    self._on_data(data)
                    return
                piece, data = data[:n], data[n:]
                self._remaining = 0
                if piece:
                    self._on_data(piece)
                self._finish()
                if data:
                    raise ProtocolError("data after the end of a response")
                return
            if state == _UNTIL_CLOSE:
                self._on_data(data)
                return
            if state == _CHUNK_DATA:
                n = self._remaining
                if len(data) <= n:
                    self._remaining = n - len(data)
                    if self._remaining == 0:
                        self._state = _CHUNK_CRLF
                    self._on_data(data)
                    return
                piece, data = data[:n], data[n:]
                self._remaining = 0
                self._state = _CHUNK_CRLF
                self._on_data(piece)
                continue
            if state == _DONE:
                raise ProtocolError("data after the end of a response")
            # line-oriented states: head, chunk size, chunk CRLF, trailers
            buf = self._buf + data if self._buf else data
            self._buf = b""
            data = self._line_state(buf)

    def _line_state(self, buf: bytes) -> bytes:
        """Consume what a line-oriented state can from `buf`; return the rest (b'' when more is needed)."""
        state = self._state
        if state == _HEAD:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise ProtocolError(f"response head larger than {MAX_HEAD_BYTES} bytes")
                self._buf = buf
                return b""
            self._head(buf[:end])
            return buf[end + 4:]
        if state == _CHUNK_CRLF:
            if len(buf) < 2:
                self._buf = buf
                return b""
            if buf[:2] != b"\r\n":
                raise ProtocolError("chunk data not followed by CRLF")
            self._state = _CHUNK_SIZE
            return buf[2:]
        if state == _CHUNK_SIZE:
            end = buf.find(b"\r\n")
            if end < 0:
                if len(buf) > MAX_CHUNK_LINE:
                    raise ProtocolError("chunk size line too long")
                self._buf = buf
                return b""
            line = buf[:end].split(b";", 1)[0].strip()
            try:
                size = int(line, 16)
            except ValueError:
                raise ProtocolError(f"bad chunk size {line[:20]!r}") from None
            if size < 0:
                raise ProtocolError("negative chunk size")
            if size == 0:
                self._state = _TRAILERS
            else:
                self._remaining = size
                self._state = _CHUNK_DATA
            return buf[end + 2:]
        if state == _TRAILERS:
            end = buf.find(b"\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise ProtocolError("trailers too large")
                self._buf = buf
                return b""
            rest = buf[end + 2:]
            if end == 0:  # the empty line after the last trailer
                self._finish()
                if rest:
                    raise ProtocolError("data after the end of a response")
                return b""
            return rest  # a trailer line, dropped
        raise AssertionError(state)

    def _head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        status_line = lines[0]
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise ProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        try:
            status = int(parts[1])
        except ValueError:
            raise ProtocolError(f"bad status in {status_line[:80]!r}") from None
        headers: Headers = []
        length: int | None = None
        chunked = False
        connection = ""
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name[-1] in " \t":
                raise ProtocolError(f"bad header line {line[:80]!r}")
            value = value.strip()
            lname = name.lower()
            if lname == "content-length":
                try:
                    n = int(value)
                except ValueError:
                    raise ProtocolError(f"bad Content-Length {value[:40]!r}") from None
                if n < 0 or (length is not None and length != n):
                    raise ProtocolError(f"bad Content-Length {value[:40]!r}")
                length = n
            elif lname == "transfer-encoding":
                chunked = value.lower().split(",")[-1].strip() == "chunked"
            elif lname == "connection":
                connection = value.lower()
            headers.append((name, value))
        if 100 <= status < 200:  # informational: the real head follows
            return
        self.status = status
        http10 = parts[0] == "HTTP/1.0"
        self.keep_alive = ("keep-alive" in connection) if http10 else ("close" not in connection)
        if self.no_body or status in (204, 304):
            self._state = _LENGTH
            self._remaining = 0
            self._on_head(status, headers, self.keep_alive)
            self._finish()
            return
        if chunked:
            self._state = _CHUNK_SIZE
        elif length is not None:
            self._state = _LENGTH
            self._remaining = length
        else:
            self._state = _UNTIL_CLOSE
            self.keep_alive = False
        self._on_head(status, headers, self.keep_alive)
        if self._state == _LENGTH and self._remaining == 0:
            self._finish()

    def _finish(self) -> None:
        self._state = _DONE
        self._on_end()

    def eof(self) -> None:
        """The connection closed. Ends an until-close body; anything else unfinished is an error."""
        if self._state == _UNTIL_CLOSE:
            self._finish()
        elif self._state != _DONE:
            what = "before the response head" if self._state == _HEAD else "in the middle of the response body"
            raise ProtocolError(f"the upstream closed the connection {what}")
