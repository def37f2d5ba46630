"""Server-sent events, as the gateway reads them (pure): where the last whole event ends, and the
`data:` payloads of whole events."""

from __future__ import annotations

__all__ = ["boundary", "events"]


def boundary(data: bytes) -> int:
    """The end of the last whole SSE event in `data` (0 when none is whole yet)."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def events(data: bytes) -> list[bytes]:
    """The `data:` payloads of whole SSE events (comments and other fields left out)."""
    out = []
    for block in data.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
        if lines:
            out.append(b"\n".join(lines))
    return out
