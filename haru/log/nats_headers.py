"""A faster parse of the headers nats-py reads on every delivered message, enabled explicitly.

    from haru.log.nats_headers import enable_fast_header_parse
    enable_fast_header_parse()      # at a service's start-up; True when it is in effect

Importing this module (or `haru.log.eventlog`) changes nothing in nats-py: a service that wants the
faster parse calls `enable_fast_header_parse()` once when it starts (the projector, the promoter and
the Postgres sink do, in their `haru` commands; so do the replay benchmarks).

Why. nats-py 2.16.0 parses the headers of every delivered message (`Client._process_headers`, in the
read loop, whether or not the subscriber looks at them) with `Client._parse_header_lines`, whose
per-name whitespace check is a generator over the name's characters: ~3.3 us of the ~10 us a
replayed message costs when it carries the two headers every `append` writes (bench/postgres.py).
`_parse_header_lines_fast` is the same function with that check done by one compiled regex: `\\s` on
a str pattern is Py_UNICODE_ISSPACE, exactly what `str.isspace` tests, so it returns the same dict
for every input (tests/unit/test_eventlog_headers.py compares the two on arbitrary bytes); ~1.2 us.

The version guard: it replaces only the exact function it was written against (nats-py 2.16.0,
without fast_mail_parser, which nats-py would use instead); any other nats-py keeps its own parser
and `enable_fast_header_parse()` returns False.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any

__all__ = ["enable_fast_header_parse", "fast_header_parse_enabled", "FOR_NATS_PY"]

FOR_NATS_PY = "2.16.0"  # the nats-py whose Client._parse_header_lines the fast parse equals
_HEADER_NAME_SPACE = re.compile(r"\s")
_CRLF = b"\r\n"


def _parse_header_lines_fast(raw: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in raw.split(_CRLF):
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue
        if _HEADER_NAME_SPACE.search(key) is not None:
            continue
        out[key] = value.strip().decode("utf-8", "replace")
    return out


def _client() -> Any:  # nats-py's client module, imported when asked for
    import nats.aio.client as nats_client

    return nats_client


def fast_header_parse_enabled() -> bool:
    """Whether nats-py's Client parses headers with `_parse_header_lines_fast` in this process."""
    return "_nats_parse_header_lines" in _client().Client.__dict__


def enable_fast_header_parse() -> bool:
    """Make nats-py's Client parse message headers with the faster equivalent, for this process.

    Returns True when it is in effect (now or already), False when this nats-py is not the one it was
    written for (another version, or fast_mail_parser installed): then nats-py keeps its own parser.
    Call it once at start-up, before messages flow; calling it again is harmless.
    """
    nats_client = _client()
    if fast_header_parse_enabled():
        return True
    try:
        version = importlib.metadata.version("nats-py")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - nats-py without metadata
        return False
    original = nats_client.Client.__dict__.get("_parse_header_lines")
    if version != FOR_NATS_PY or getattr(nats_client, "parse_email", None) is not None or original is None:
        return False
    nats_client.Client._nats_parse_header_lines = original  # the original, kept for the equivalence test
    nats_client.Client._parse_header_lines = staticmethod(_parse_header_lines_fast)
    return True
