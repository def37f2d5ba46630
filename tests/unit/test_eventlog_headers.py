"""haru.eventlog's replacement of nats-py's header parser returns what nats-py's own returns."""

from __future__ import annotations

import sys

from hypothesis import given, settings
from hypothesis import strategies as st

import haru.eventlog as eventlog
from nats.aio.client import Client

PIECES = [b"\r\n", b":", b": ", b" ", b"\t", b"\x0b", b"\x0c", b"\x1c", b"\x1f", b"\x85", b"\xa0",
          "é".encode(), "\u2028".encode(), b"\xff", b"Nats-Msg-Id", b"Nats-Expected-Last-Subject-Sequence", b"a", b"1"]


def original(raw: bytes) -> dict[str, str]:
    return Client._nats_parse_header_lines(raw) if eventlog.HEADER_PARSER_INSTALLED else Client._parse_header_lines(raw)


def test_installed_on_the_nats_py_it_was_written_for() -> None:
    import importlib.metadata

    if importlib.metadata.version("nats-py") == "2.16.0" and "fast_mail_parser" not in sys.modules:
        assert eventlog.HEADER_PARSER_INSTALLED
        assert Client._parse_header_lines is eventlog._parse_header_lines_fast


def test_the_headers_append_writes() -> None:
    raw = b"Nats-Expected-Last-Subject-Sequence: 12345\r\nNats-Msg-Id: 0123456789abcdef0123456789abcdef01234567\r\n\r\n"
    expected = {"Nats-Expected-Last-Subject-Sequence": "12345", "Nats-Msg-Id": "0123456789abcdef0123456789abcdef01234567"}
    assert eventlog._parse_header_lines_fast(raw) == original(raw) == expected


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(PIECES), st.binary(max_size=4)), max_size=24))
def test_same_result_as_nats_py_on_arbitrary_bytes(pieces: list[bytes]) -> None:
    raw = b"".join(pieces)
    assert eventlog._parse_header_lines_fast(raw) == original(raw)


def test_name_whitespace_is_str_isspace() -> None:
    # The whole point of the replacement: the regex's \s is exactly str.isspace, code point by code point.
    for i in range(0x110000):
        c = chr(i)
        assert (eventlog._HEADER_NAME_SPACE.search(c) is not None) == c.isspace(), hex(i)
