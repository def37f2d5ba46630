"""Published adapters' bytes: one object per adapter version in the JetStream object store `haru_adapters`
(haru.core.subjects.ADAPTERS_BUCKET), so every domain in every region fetches the same bytes, and the
checks a reader makes on them (haru.core's digest: `sha256:<hex>` of the object's bytes).

    objects = AdapterObjects(log.js)        # the log's own JetStream context
    digest = await objects.put(name, data)  # the trainer's side: the bucket is made on first use
    data = await objects.get(name, digest)  # an agent's side: raises ObjectMissing / DigestMismatch

`unpack(data, into)` writes the tar's regular files (adapter_config.json, adapter_model.safetensors) into a
directory, refusing links, absolute paths and `..`.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path
from typing import Any

import nats.js.errors

from haru.core import subjects
from haru.core.errors import LogError, LogUnavailable
from haru.log.jetstream import translated

__all__ = ["AdapterObjects", "BadAdapter", "DigestMismatch", "ObjectMissing", "digest_of", "pack", "unpack"]

NEEDED = ("adapter_config.json",)


class ObjectMissing(LogError):
    """The adapter's object is not in the bucket (the publisher's fault, or a purge)."""


class DigestMismatch(LogError):
    """The object's bytes are not the ones its event names: refused, never loaded."""


class BadAdapter(LogError):
    """The object is not a tar of an adapter's directory."""


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class AdapterObjects:
    def __init__(self, js: Any, bucket: str = subjects.ADAPTERS_BUCKET) -> None:
        self.js = js
        self.bucket = bucket
        self._store: Any = None

    async def _open(self, create: bool) -> Any:
        if self._store is None:
            with translated(f"opening the object store {self.bucket}"):
                try:
                    self._store = await self.js.object_store(self.bucket)
                except nats.js.errors.BucketNotFoundError as exc:
                    if not create:
                        raise ObjectMissing(
                            f"the object store {self.bucket} does not exist: no adapter was ever published"
                        ) from exc
                    self._store = await self.js.create_object_store(self.bucket)
        return self._store

    async def put(self, name: str, data: bytes) -> str:
        """Store `data` as `name`; returns its digest."""
        store = await self._open(create=True)
        with translated(f"storing adapter object {name}"):
            await store.put(name, data)
        return digest_of(data)

    async def get(self, name: str, digest: str) -> bytes:
        """The bytes of `name`, checked against `digest`."""
        store = await self._open(create=False)
        with translated(f"fetching adapter object {name}"):
            try:
                result = await store.get(name)
            except nats.js.errors.ObjectNotFoundError as exc:
                raise ObjectMissing(f"object {name!r} is not in {self.bucket}") from exc
        data = bytes(result.data or b"")
        if not data and result.info is None:
            raise LogUnavailable(f"object {name!r} came back empty")
        got = digest_of(data)
        if got != digest:
            raise DigestMismatch(f"object {name!r} has digest {got}, its event says {digest}: not loaded")
        return data


def pack(directory: Path) -> bytes:
    """A tar of `directory`'s regular files (no directory prefix): what a publisher puts."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(directory.iterdir()):
            if path.is_file():
                tar.add(path, arcname=path.name)
    return buf.getvalue()


def unpack(data: bytes, into: Path) -> Path:
    """Write the tar's regular files into `into` (made if missing); refuses anything else."""
    into.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            members = tar.getmembers()
            for m in members:
                name = Path(m.name)
                if not m.isfile() or name.is_absolute() or ".." in name.parts:
                    raise BadAdapter(f"member {m.name!r} is not a plain file inside the adapter's directory")
            tar.extractall(into, filter="data")
    except tarfile.TarError as exc:
        raise BadAdapter(f"not a tar of an adapter's directory: {exc}") from exc
    files = {p.name for p in into.rglob("*") if p.is_file()}
    missing = [n for n in NEEDED if n not in files]
    if missing:
        raise BadAdapter(f"the adapter has no {', '.join(missing)}")
    return into
