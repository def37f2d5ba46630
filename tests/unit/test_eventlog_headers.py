"""The faster header parse (haru/log/nats_headers.py) returns what nats-py's own returns, and is in
effect only when a service enables it: importing haru.log.eventlog changes no nats-py class."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap

from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client

from haru.log import nats_headers

PIECES = [
    b"\r\n",
    b":",
    b": ",
    b" ",
    b"\t",
    b"\x0b",
    b"\x0c",
    b"\x1c",
    b"\x1f",
    b"\x85",
    b"\xa0",
    "é".encode(),
    "\u2028".encode(),
    b"\xff",
    b"Nats-Msg-Id",
    b"Nats-Expected-Last-Subject-Sequence",
    b"a",
    b"1",
]

WRITTEN_FOR = (
    importlib.metadata.version("nats-py") == nats_headers.FOR_NATS_PY and "fast_mail_parser" not in sys.modules
)


def original(raw: bytes) -> dict[str, str]:
    own = Client.__dict__.get("_nats_parse_header_lines") or Client.__dict__["_parse_header_lines"]
    return own.__func__(raw) if isinstance(own, staticmethod) else own(raw)


def _in_a_fresh_interpreter(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_importing_the_event_log_leaves_nats_py_untouched() -> None:
    out = _in_a_fresh_interpreter("""
        from nats.aio.client import Client
        before = dict(Client.__dict__)
        import haru.log.eventlog, haru.log.nats_headers, projections.projector
        import haru.promoter.service, projections.postgres
        after = dict(Client.__dict__)
        print(before == after, haru.log.nats_headers.fast_header_parse_enabled())
    """)
    assert out == "True False"


def test_enabling_it_replaces_the_parser_on_the_nats_py_it_was_written_for() -> None:
    out = _in_a_fresh_interpreter("""
        from nats.aio.client import Client
        own = Client.__dict__["_parse_header_lines"]
        from haru.log import nats_headers
        first = nats_headers.enable_fast_header_parse()
        again = nats_headers.enable_fast_header_parse()
        fast = Client._parse_header_lines is nats_headers._parse_header_lines_fast
        kept = Client.__dict__.get("_nats_parse_header_lines") is own
        print(first, again, fast, kept, nats_headers.fast_header_parse_enabled())
    """)
    if WRITTEN_FOR:
        assert out == "True True True True True"
    else:  # the version guard: any other nats-py keeps its own parser
        assert out == "False False False False False"


def test_the_headers_append_writes() -> None:
    raw = b"Nats-Expected-Last-Subject-Sequence: 12345\r\nNats-Msg-Id: 0123456789abcdef0123456789abcdef01234567\r\n\r\n"
    expected = {
        "Nats-Expected-Last-Subject-Sequence": "12345",
        "Nats-Msg-Id": "0123456789abcdef0123456789abcdef01234567",
    }
    assert nats_headers._parse_header_lines_fast(raw) == original(raw) == expected


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(PIECES), st.binary(max_size=4)), max_size=24))
def test_same_result_as_nats_py_on_arbitrary_bytes(pieces: list[bytes]) -> None:
    raw = b"".join(pieces)
    assert nats_headers._parse_header_lines_fast(raw) == original(raw)


def test_name_whitespace_is_str_isspace() -> None:
    # The whole point of the replacement: the regex's \s is exactly str.isspace, code point by code point.
    for i in range(0x110000):
        c = chr(i)
        assert (nats_headers._HEADER_NAME_SPACE.search(c) is not None) == c.isspace(), hex(i)
