"""The upstream side's HTTP/1.1 response parser: llhttp (through `httptools`), strict. Pure: no I/O.

The proxy talks to a handful of known upstreams (the agent's serving port, vLLM's uvicorn,
llama-server) and only ever sends POST; what it needs from a response is the status, the headers,
and the body framing (Content-Length, chunked, or until close), with the body handed on piece by
piece as it arrives. The parsing itself is llhttp's, in C (the parser Node.js uses; aiohttp's own
C parser is llhttp too): a pure-Python parser cost ~15% of the gateway's CPU under SSE (issue 20).

Strict per RFC 9112, as llhttp is without its lenient flags (tests/unit/test_gateway_http1.py
pins each): a chunk size is HEXDIG only (no sign, no `0x`, no spaces), lines end in CRLF, header
names are tokens, no obs-fold, no control characters in values, one Content-Length of digits only,
never both Content-Length and Transfer-Encoding. Anything else is a `ProtocolError`, which the
proxy answers with a 502 (or, once the head has gone to the client, a truncated stream).

    parser = ResponseParser(on_head, on_data, on_end)
    parser.feed(bytes)        # as data arrives; raises ProtocolError on a malformed response
    parser.eof()              # the connection closed; ends an until-close body, or raises

`on_head(status, headers, keep_alive)`, `on_data(bytes)`, `on_end()`. Informational (1xx) heads
are skipped. Chunk extensions and trailers are read and dropped.
"""

from __future__ import annotations

from collections.abc import Callable

import httptools

from haru.gateway.errors import ProtocolError

MAX_HEAD_BYTES = 64 * 1024

Headers = list[tuple[str, str]]

_HEAD, _BODY, _DONE = range(3)


class ResponseParser:
    __slots__ = (
        "_state",
        "_parser",
        "_fed",
        "_headers",
        "_length",
        "_chunked",
        "_on_head",
        "_on_data",
        "_on_end",
        "_error",
        "status",
        "keep_alive",
    )

    def __init__(
        self,
        on_head: Callable[[int, Headers, bool], None],
        on_data: Callable[[bytes], None],
        on_end: Callable[[], None],
    ) -> None:
        self._state = _HEAD
        self._parser = httptools.HttpResponseParser(self)
        self._fed = 0  # bytes fed while the head is incomplete (llhttp sets no bound on a head)
        self._headers: Headers = []
        self._length = False
        self._chunked = False
        self._on_head = on_head
        self._on_data = on_data
        self._on_end = on_end
        self._error: ProtocolError | None = None
        self.status = 0
        self.keep_alive = False

    def reset(self) -> None:
        """Ready for the next response on the same keep-alive connection (llhttp carries on from the
        end of the last one): one parser per connection, not one per request."""
        if self._state != _DONE:
            raise ProtocolError("a response parser reused before its response ended")
        self._state = _HEAD
        self._fed = 0
        self._headers = []
        self._length = self._chunked = False
        self._error = None
        self.status = 0
        self.keep_alive = False

    @property
    def done(self) -> bool:
        return self._state == _DONE

    @property
    def started(self) -> bool:
        """Any byte of a response seen (a reused connection that dies before this may be retried)."""
        return self._state != _HEAD or self._fed > 0

    def feed(self, data: bytes) -> None:
        if self._state == _DONE:
            raise ProtocolError("data after the end of a response")
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise ProtocolError("the upstream switched protocols (an upgrade the proxy never asked for)") from None
        except httptools.HttpParserError as exc:
            if self._error is not None:
                raise self._error from None
            cause = exc.__context__
            if isinstance(cause, ProtocolError):
                raise cause from None
            if self._state == _DONE:
                raise ProtocolError("data after the end of a response") from None
            raise ProtocolError(str(exc) or type(exc).__name__) from None
        if self._state == _HEAD:
            self._fed += len(data)
            if self._fed > MAX_HEAD_BYTES:
                raise ProtocolError(f"response head larger than {MAX_HEAD_BYTES} bytes")

    def eof(self) -> None:
        """The connection closed. Ends an until-close body; anything else unfinished is an error."""
        state = self._state
        if state == _BODY and not self._length and not self._chunked:
            self._finish()
        elif state != _DONE:
            what = "before the response head" if state == _HEAD else "in the middle of the response body"
            raise ProtocolError(f"the upstream closed the connection {what}")

    # --------------------------------------------------------------------- llhttp callbacks

    def on_message_begin(self) -> None:
        if self._state == _DONE:
            self._error = ProtocolError("data after the end of a response")
            raise self._error

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._state != _HEAD:
            return  # a trailer: dropped
        lname = name.lower()
        if lname == b"content-length":
            self._length = True
        elif lname == b"transfer-encoding":
            self._chunked = value.lower().rsplit(b",", 1)[-1].strip() == b"chunked"
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        parser = self._parser
        status = parser.get_status_code()
        if 100 <= status < 200:  # informational: the real head follows
            self._headers = []
            self._length = self._chunked = False
            return
        self.status = status
        keep_alive = parser.should_keep_alive()
        if not self._length and not self._chunked and status not in (204, 304):
            keep_alive = False  # until close
        self.keep_alive = keep_alive
        self._state = _BODY
        self._on_head(status, self._headers, keep_alive)

    def on_body(self, body: bytes) -> None:
        self._on_data(body)

    def on_message_complete(self) -> None:
        if self._state == _BODY:
            self._finish()

    def _finish(self) -> None:
        self._state = _DONE
        self._on_end()
