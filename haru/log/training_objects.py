"""What training keeps outside a host: files as objects in a JetStream object store bucket, by name.

    haru_adapters      published LoRA adapters, one object per version (a tar of the adapter's directory)
    haru_checkpoints   each training slot's newest checkpoint, one object per fleet and slot, replaced

`Objects` is the seam (put, info, get, delete of one bucket's objects); `JsObjects` is the real adapter over
nats-py's public object store API on the log's own JetStream context, `MemoryObjects` its twin. A stored
object's `digest` is `sha256:<hex>` of its bytes (what `adapter_published` names), computed here rather than
taken from the store. The buckets are made by `EventLog.ensure` beside the streams, with their replicas:
an agent may write objects, not create buckets.
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

import msgspec
import nats.js.errors
from nats.js import api

from haru.core.errors import LogError
from haru.log.jetstream import translated

__all__ = ["Objects", "Stored", "JsObjects", "MemoryObjects", "digest_of", "ensure_bucket"]


class Stored(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    digest: str  # sha256:<hex> of the bytes
    size: int
    note: str = ""  # what the writer said of it (a checkpoint's name)


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Objects(Protocol):
    """One bucket's objects."""

    bucket: str

    async def info(self, name: str) -> Stored | None:
        """What is stored under `name` (None: nothing)."""
        ...

    async def put(self, name: str, data: bytes, *, note: str = "") -> Stored:
        """Store `data` as `name`, replacing what was there (readers see the old or the new, whole)."""
        ...

    async def get(self, name: str) -> tuple[Stored, bytes] | None:
        """The object and its bytes (None: nothing under `name`); the bytes are checked against its digest."""
        ...

    async def delete(self, name: str) -> None:
        """Remove `name` (nothing if it is not there)."""
        ...


async def ensure_bucket(js: Any, bucket: str, *, replicas: int, description: str) -> None:
    """Create the object store `bucket` if it does not exist (an existing one keeps its settings)."""
    with translated(f"ensuring the object store {bucket}"):
        try:
            await js.object_store(bucket)
        except nats.js.errors.BucketNotFoundError:
            await js.create_object_store(
                bucket,
                config=api.ObjectStoreConfig(
                    bucket=bucket, description=description, storage=api.StorageType.FILE, replicas=replicas
                ),
            )


class JsObjects:
    def __init__(self, js: Any, bucket: str) -> None:
        self.js = js
        self.bucket = bucket
        self._store: Any = None

    async def _open(self) -> Any:
        if self._store is None:
            with translated(f"opening the object store {self.bucket}"):
                try:
                    self._store = await self.js.object_store(self.bucket)
                except nats.js.errors.BucketNotFoundError as exc:
                    raise LogError(
                        f"the object store {self.bucket} does not exist: an admin makes it with the streams "
                        f"(deploy/nats/ensure_streams.py, or `haru apply` as a user allowed to create streams)"
                    ) from exc
        return self._store

    async def info(self, name: str) -> Stored | None:
        store = await self._open()
        with translated(f"reading object {name!r} of {self.bucket}"):
            try:
                got = await store.get_info(name)
            except nats.js.errors.ObjectNotFoundError:
                return None
        return _stored(got)

    async def put(self, name: str, data: bytes, *, note: str = "") -> Stored:
        store = await self._open()
        with translated(f"storing object {name!r} in {self.bucket}"):
            await store.put(
                name,
                data,
                meta=api.ObjectMeta(name=name, description=note, headers={"Haru-Digest": digest_of(data)}),
            )
        return Stored(name=name, digest=digest_of(data), size=len(data), note=note)

    async def get(self, name: str) -> tuple[Stored, bytes] | None:
        store = await self._open()
        with translated(f"fetching object {name!r} of {self.bucket}"):
            try:
                got = await store.get(name)
            except nats.js.errors.ObjectNotFoundError:
                return None
        data = bytes(got.data or b"")
        stored = _stored(got.info)
        if stored.digest and stored.digest != digest_of(data):
            raise LogError(
                f"object {name!r} of {self.bucket}: its bytes have digest {digest_of(data)}, it was stored as "
                f"{stored.digest}; put it again"
            )
        return msgspec.structs.replace(stored, digest=digest_of(data), size=len(data)), data

    async def delete(self, name: str) -> None:
        store = await self._open()
        with translated(f"deleting object {name!r} of {self.bucket}"):
            try:
                await store.delete(name)
            except nats.js.errors.ObjectNotFoundError:
                return


def _stored(info: Any) -> Stored:
    headers = info.headers or {}
    digest = headers.get("Haru-Digest", "")
    if isinstance(digest, list):
        digest = digest[0] if digest else ""
    return Stored(name=info.name, digest=digest, size=info.size or 0, note=info.description or "")


class MemoryObjects:
    """The in-memory twin: one process's bucket."""

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket
        self.objects: dict[str, tuple[Stored, bytes]] = {}

    async def info(self, name: str) -> Stored | None:
        got = self.objects.get(name)
        return got[0] if got else None

    async def put(self, name: str, data: bytes, *, note: str = "") -> Stored:
        stored = Stored(name=name, digest=digest_of(data), size=len(data), note=note)
        self.objects[name] = (stored, bytes(data))
        return stored

    async def get(self, name: str) -> tuple[Stored, bytes] | None:
        return self.objects.get(name)

    async def delete(self, name: str) -> None:
        self.objects.pop(name, None)


_: Objects = MemoryObjects("x")
__: Objects = JsObjects(None, "x")
