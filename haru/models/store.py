"""The content-addressed model store under `$HARU_HOME/models` (default `~/.haru/models`).

    blobs/sha256-<hex>          verified files, read-only, named by what they hash to
    blobs/gitsha1-<hex>         small Hugging Face files known only by git's blob id
    partial/<digest>.part       a download in progress (resumed from its length); `.lock` beside it
    snapshots/<id>/             a materialized model: symlinks named as the model's files -> ../../blobs/…
                                (<id> = sha256 of its manifest), built in a temporary directory and renamed
    refs/<registry>/<host>/<repo>/<tag or commit>   a symlink to its snapshot, replaced atomically
    manifests/<id>.json         the resolution a snapshot was built from

Nothing a runtime reads is ever half written: a blob appears under `blobs/` only by rename after its
digest matched, a snapshot only by rename once every blob is in place, a ref only by rename of a
symlink. A blob found corrupt (re-hashed on every pull) is removed and fetched again.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import msgspec

from haru.core.model_errors import StoreError
from haru.core.refs import Resolution

CHUNK = 1 << 20


def default_root(home: str | os.PathLike | None = None) -> Path:
    base = home or os.environ.get("HARU_HOME") or "~/.haru"
    return Path(os.path.expanduser(str(base))) / "models"


class Hasher:
    """sha256 of the bytes, or git's blob id (sha1 of `blob <size>\\0` + bytes) for `gitsha1:` digests."""

    def __init__(self, digest: str, size: int) -> None:
        algo, _, self.expected = digest.partition(":")
        self.algo = algo
        if algo == "sha256":
            self._h = hashlib.sha256()
        elif algo == "gitsha1":
            self._h = hashlib.sha1(f"blob {size}\0".encode())
        else:
            raise StoreError(
                f"digest {digest!r} has an algorithm Haru cannot check ({algo!r}); "
                "only sha256: and gitsha1: are accepted"
            )

    def update(self, data: bytes | memoryview) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def ok(self) -> bool:
        return self._h.hexdigest() == self.expected


def file_name(digest: str) -> str:
    algo, _, hexd = digest.partition(":")
    if not hexd or not all(c in "0123456789abcdef" for c in hexd):
        raise StoreError(f"digest {digest!r} is not <algorithm>:<lowercase hex>")
    return f"{algo}-{hexd}"


def hash_file(path: Path, digest: str, size: int, *, limit: int | None = None) -> Hasher:
    h = Hasher(digest, size)
    remaining = limit
    with open(path, "rb") as f:
        while True:
            n = CHUNK if remaining is None else min(CHUNK, remaining)
            if n == 0:
                break
            chunk = f.read(n)
            if not chunk:
                break
            h.update(chunk)
            if remaining is not None:
                remaining -= len(chunk)
    return h


class Store:
    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()

    def blob(self, digest: str) -> Path:
        return self.root / "blobs" / file_name(digest)

    def partial(self, digest: str) -> Path:
        return self.root / "partial" / f"{file_name(digest)}.part"

    def ensure_dirs(self) -> None:
        try:
            for d in ("blobs", "partial", "snapshots", "refs", "manifests"):
                (self.root / d).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(
                f"cannot create the model store at {self.root}: {exc.strerror}; set HARU_HOME to a writable directory"
            ) from exc

    def verified(self, digest: str, size: int) -> bool | None:
        """True: the blob is present and hashes right. None: absent. False: present but corrupt."""
        path = self.blob(digest)
        try:
            if path.stat().st_size != size:
                return False
        except FileNotFoundError:
            return None
        return hash_file(path, digest, size).ok()

    def discard_blob(self, digest: str) -> None:
        path = self.blob(digest)
        try:
            path.unlink()
        except FileNotFoundError:
            pass

    def commit_blob(self, part: Path, digest: str) -> Path:
        """Rename a verified partial file into `blobs/`, read-only, durably."""
        final = self.blob(digest)
        with open(part, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(part, 0o444)
        os.replace(part, final)
        _fsync_dir(final.parent)
        return final

    def snapshot_path(self, res: Resolution) -> Path:
        return self.root / "snapshots" / _snapshot_id(res)

    def ref_path(self, res: Resolution) -> Path:
        return self.root / "refs" / res.key

    def materialize(self, res: Resolution) -> Path:
        """The directory (or, for GGUF, the entry file in it) a runtime serves; every blob must be in place."""
        sid = _snapshot_id(res)
        snap = self.root / "snapshots" / sid
        if not snap.is_dir():
            tmp = Path(tempfile.mkdtemp(prefix=f".{sid[:12]}-", dir=self.root / "snapshots"))
            for b in res.blobs:
                link = tmp / b.name
                link.parent.mkdir(parents=True, exist_ok=True)
                target = os.path.relpath(self.blob(b.digest), link.parent)
                os.symlink(target, link)
            os.chmod(tmp, 0o755)
            try:
                os.replace(tmp, snap)
            except OSError:  # another puller made the same snapshot first: it is the same by construction
                _rmtree(tmp)
            manifest = self.root / "manifests" / f"{sid}.json"
            _atomic_write(manifest, msgspec.json.format(msgspec.json.encode(res)))
        ref = self.ref_path(res)
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp_link = ref.parent / f".{ref.name}.{os.getpid()}.tmp"
        tmp_link.unlink(missing_ok=True)
        os.symlink(os.path.relpath(snap, ref.parent), tmp_link)
        os.replace(tmp_link, ref)
        return snap / res.entry if res.entry else snap


def _snapshot_id(res: Resolution) -> str:
    spec = msgspec.json.encode(
        [
            res.registry,
            res.origin,
            res.repository,
            res.revision,
            res.format,
            res.entry,
            [(b.name, b.digest, b.size) for b in res.blobs],
        ]
    )
    return hashlib.sha256(spec).hexdigest()[:32]


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
