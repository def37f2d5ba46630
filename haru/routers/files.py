"""Writing a router's file so that a reader never sees half of it: a temporary file beside it, flushed,
then renamed over it (rename is atomic within one filesystem, and it is what Envoy's file watch reacts to)."""

from __future__ import annotations

import os
from pathlib import Path

from haru.routers.errors import NotApplied


def replace_atomically(path: Path, text: str) -> bool:
    """Write `text` to `path` by rename; False (nothing written) when the file already holds it."""
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise NotApplied(f"cannot read {path}: {exc}") from exc
    tmp = path.with_name(f".{path.name}.haru-tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise NotApplied(f"cannot write {path}: {exc}; check the directory exists and is writable") from exc
    return True
