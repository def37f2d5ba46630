"""The upstream response parser: any split of the bytes gives the same head, body and end."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from haru.gateway.errors import ProtocolError
from haru.gateway.http1 import ResponseParser


class Sink:
    def __init__(self, **kw) -> None:
        self.heads: list = []
        self.data: list[bytes] = []
        self.ends = 0
        self.parser = ResponseParser(self.on_head, self.data.append, self.on_end, **kw)

    def on_head(self, status, headers, keep_alive) -> None:
        self.heads.append((status, headers, keep_alive))

    def on_end(self) -> None:
        self.ends += 1

    @property
    def body(self) -> bytes:
        return b"".join(self.data)


def feed_split(raw: bytes, cuts: list[int], **kw) -> Sink:
    sink = Sink(**kw)
    points = sorted({c % (len(raw) + 1) for c in cuts}) if raw else []
    prev = 0
    for p in points + [len(raw)]:
        if p > prev:
            sink.parser.feed(raw[prev:p])
            prev = p
    return sink


SIZED = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"d\r\ndata: hello\n\n\r\n"
    b"f;ext=1\r\ndata: world!!\n\n\r\n"
    b"0\r\nX-Trailer: t\r\n\r\n"
)
CHUNKED_BODY = b"data: hello\n\ndata: world!!\n\n"


@given(st.lists(st.integers(min_value=0, max_value=500), max_size=12))
def test_sized_body_any_split(cuts):
    sink = feed_split(SIZED, cuts)
    assert sink.heads == [(200, [("Content-Type", "application/json"), ("Content-Length", "11")], True)]
    assert sink.body == b'{"ok":true}' and sink.ends == 1 and sink.parser.done


@given(st.lists(st.integers(min_value=0, max_value=500), max_size=20))
def test_chunked_body_any_split(cuts):
    sink = feed_split(CHUNKED, cuts)
    assert sink.heads[0][0] == 200
    assert sink.body == CHUNKED_BODY and sink.ends == 1 and sink.parser.done


def test_chunks_are_handed_on_as_they_arrive():
    sink = Sink()
    sink.parser.feed(CHUNKED[: CHUNKED.index(b"\r\n\r\n") + 4])
    assert sink.heads and not sink.data
    sink.parser.feed(b"d\r\ndata: hel")
    assert sink.data == [b"data: hel"] and sink.ends == 0


def test_informational_heads_are_skipped():
    sink = feed_split(b"HTTP/1.1 100 Continue\r\n\r\n" + SIZED, [])
    assert len(sink.heads) == 1 and sink.heads[0][0] == 200 and sink.body == b'{"ok":true}'


def test_until_close_body_and_keep_alive_rules():
    sink = Sink()
    sink.parser.feed(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nabc")
    sink.parser.feed(b"def")
    assert sink.heads[0][2] is False and sink.ends == 0
    sink.parser.eof()
    assert sink.body == b"abcdef" and sink.ends == 1
    assert feed_split(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", []).heads[0][2] is False
    assert feed_split(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", []).heads[0][2] is False
    assert feed_split(b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n", []).heads[0][2] is True


def test_no_body_statuses_and_empty_bodies_end_at_the_head():
    for raw in (b"HTTP/1.1 204 No Content\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"):
        sink = feed_split(raw, [])
        assert sink.ends == 1 and sink.body == b""


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "Expected HTTP/"),
        (b"HTTP/1.1 abc OK\r\n\r\n", "Invalid status code"),
        (b"HTTP/1.1 200 OK\r\nno-colon\r\n\r\n", "Invalid header token"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "Invalid character in Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "Invalid character in chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabX\r\n", "Expected LF after chunk data"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nab", "data after the end"),
        # RFC 9112, strictly (issue 20): a chunk size is HEXDIG only
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n+5\r\nhello\r\n0\r\n\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n 5\r\nhello\r\n0\r\n\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5 \r\nhello\r\n0\r\n\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\nhello\r\n0\r\n\r\n", "CR after chunk size"),
        # header names are tokens; no obs-fold; no control characters in values; CRLF line ends
        (b"HTTP/1.1 200 OK\r\nBad Name: x\r\nContent-Length: 0\r\n\r\n", "Invalid header token"),
        (b"HTTP/1.1 200 OK\r\nBad : x\r\nContent-Length: 0\r\n\r\n", "Invalid header token"),
        (b"HTTP/1.1 200 OK\r\nX@A: a\r\nContent-Length: 0\r\n\r\n", "Invalid header token"),
        (b"HTTP/1.1 200 OK\r\n: x\r\nContent-Length: 0\r\n\r\n", "Invalid header token"),
        (b"HTTP/1.1 200 OK\r\nX-A: a\r\n b\r\nContent-Length: 0\r\n\r\n", "whitespace"),
        (b"HTTP/1.1 200 OK\r\nX-A: a\x01b\r\nContent-Length: 0\r\n\r\n", "Invalid header value char"),
        (b"HTTP/1.1 200 OK\nContent-Length: 0\n\n", "CR"),
        # one Content-Length, digits only; never both framings
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nhi", "Duplicate Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nhi", "Duplicate Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nhi", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\nhi", "Content-Length"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            "Transfer-Encoding can't be present with Content-Length",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            "Content-Length",
        ),
    ],
)
def test_malformed_responses_raise(raw, words):
    with pytest.raises(ProtocolError, match=words):
        Sink().parser.feed(raw)


def test_eof_in_the_middle_is_an_error_that_says_where():
    sink = Sink()
    assert not sink.parser.started
    sink.parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
    assert sink.parser.started
    with pytest.raises(ProtocolError, match="in the middle of the response body"):
        sink.parser.eof()
    with pytest.raises(ProtocolError, match="before the response head"):
        Sink().parser.eof()


def test_an_endless_head_is_refused():
    sink = Sink()
    sink.parser.feed(b"HTTP/1.1 200 OK\r\n")
    with pytest.raises(ProtocolError, match="response head larger than"):
        for _ in range(100):
            sink.parser.feed(b"X-Filler: " + b"a" * 1000 + b"\r\n")


def test_a_large_body_in_the_heads_packet_is_not_a_large_head():
    body = b"x" * 200_000
    sink = feed_split(b"HTTP/1.1 200 OK\r\nContent-Length: 200000\r\n\r\n" + body, [])
    assert sink.body == body and sink.ends == 1


def test_one_parser_reads_response_after_response():
    sink = Sink()
    for i in range(3):
        if i:
            sink.parser.reset()
        sink.parser.feed(SIZED[:30])
        sink.parser.feed(SIZED[30:])
        assert sink.parser.done and sink.ends == i + 1
    sink.parser.reset()
    sink.parser.feed(CHUNKED)
    assert sink.ends == 4 and sink.body.endswith(CHUNKED_BODY)
    sink.parser.reset()
    sink.parser.feed(SIZED[:10])
    with pytest.raises(ProtocolError, match="reused before its response ended"):
        sink.parser.reset()
