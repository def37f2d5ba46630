"""A published adapter's bytes on this host: checked against the digest its event names, then unpacked into the
agent's store (agents/adapters.py). The bytes come from the adapters bucket (haru.log.training_objects);
the tar is the publisher's (agents/publishing.py `pack`): the adapter directory's regular files, by name."""

from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path

from haru.agents.errors import AgentError
from haru.log.training_objects import Objects, digest_of

__all__ = ["AdapterUnusable", "fetch"]

NEEDED = ("adapter_config.json",)


class AdapterUnusable(AgentError):
    """A published adapter this host will not load: missing, not the bytes its event names, or not an adapter."""


async def fetch(objects: Objects, name: str, digest: str, into: Path) -> Path:
    """`name`'s files in `into` (fetched, checked and unpacked once: an existing unpacked copy is reused)."""
    if (into / "adapter_config.json").exists():
        return into
    got = await objects.get(name)
    if got is None:
        raise AdapterUnusable(f"object {name!r} is not in the {objects.bucket} bucket")
    data = got[1]
    if digest_of(data) != digest:
        raise AdapterUnusable(f"object {name!r} has digest {digest_of(data)}, its event says {digest}: not loaded")
    part = into.with_name(into.name + ".part")
    if part.exists():
        shutil.rmtree(part)
    unpack(data, part)
    part.rename(into)
    return into


def unpack(data: bytes, into: Path) -> Path:
    """Write the tar's regular files into `into`; refuses links, absolute paths and `..`."""
    into.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            for m in tar.getmembers():
                name = Path(m.name)
                if not m.isfile() or name.is_absolute() or ".." in name.parts:
                    raise AdapterUnusable(f"member {m.name!r} is not a plain file inside the adapter's directory")
            tar.extractall(into, filter="data")
    except tarfile.TarError as exc:
        raise AdapterUnusable(f"not a tar of an adapter's directory: {exc}") from exc
    missing = [n for n in NEEDED if not (into / n).is_file()]
    if missing:
        raise AdapterUnusable(f"the adapter has no {', '.join(missing)}")
    return into
