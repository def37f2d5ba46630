"""Checkpoints travel with the slot: after a failover a training slot resumes on another domain, whose host
never had its checkpoint. The agent uploads each new checkpoint the trainer completes, replacing the previous,
to one object per fleet and slot in the `haru_checkpoints` bucket, and before starting the slot fetches that
object when it is newer than what the host has.

What the agent reads of the trainer's checkpoint directory (the example trainer keeps it; a trainer that does
not simply has nothing carried):

    latest               the name of the newest complete checkpoint (replaced by a rename, never half-written)
    checkpoints/<name>/  that checkpoint: plain files (weights, optimizer, state), no subfolders

and what it keeps there itself: `.haru-travel.json`, the checkpoint it last uploaded or fetched and that
object's digest. `choose` (pure) decides between the host's and the bucket's: the bucket's wins unless it is
the very object this host last uploaded or fetched (then the host's is as new or newer). A host killed
mid-run loses at most what it had not uploaded yet: one poll interval after the trainer's last checkpoint.
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import msgspec

from haru.agents.publishing import pack
from haru.core.errors import LogError
from haru.core.specs import TrainingSpec
from haru.log.training_objects import Objects, Stored

__all__ = ["CheckpointTravel", "Synced", "choose"]

LATEST = "latest"
CHECKPOINTS = "checkpoints"
MARK = ".haru-travel.json"


class Synced(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # the checkpoint (what `latest` named)
    digest: str  # the object's digest when it was uploaded or fetched


def choose(local: str | None, synced: Synced | None, remote: Stored | None) -> Literal["local", "remote"]:
    """Which checkpoint the slot resumes from: the host's (`local`, what its `latest` names; None: none) or the
    bucket's (`remote`). `synced`: the object this host last uploaded or fetched."""
    if remote is None:
        return "local"
    if synced is not None and synced.digest == remote.digest:
        return "local"  # nobody uploaded since this host did: what it has is as new or newer
    if local is not None and local == remote.note:
        return "local"  # the same checkpoint
    return "remote"


def _read_latest(root: Path) -> str | None:
    try:
        name = (root / LATEST).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return name if name and (root / CHECKPOINTS / name).is_dir() else None


def _read_mark(root: Path) -> Synced | None:
    try:
        return msgspec.json.decode((root / MARK).read_bytes(), type=Synced)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _unpack_flat(data: bytes, into: Path) -> None:
    """The tar's plain files into `into`; anything else (a link, a folder, a path) is refused."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for m in tar.getmembers():
            if not m.isfile() or "/" in m.name or m.name in ("", ".", ".."):
                raise LogError(f"checkpoint object member {m.name!r} is not a plain file: refused")
        tar.extractall(into, filter="data")


class CheckpointTravel:
    def __init__(self, *, fleet: str, objects: Objects, interval_s: float, logger: Any) -> None:
        self.fleet = fleet
        self.objects = objects
        self.interval_s = interval_s
        self.logger = logger
        self._problems: dict[str, str] = {}  # slot -> the upload problem last logged

    def object_name(self, spec: TrainingSpec) -> str:
        return f"{self.fleet}/{spec.slot}"

    @staticmethod
    def root(spec: TrainingSpec) -> Path:
        return Path(os.path.expanduser(spec.checkpoint_dir))

    async def fetch(self, spec: TrainingSpec) -> str | None:
        """Before the slot starts: bring the bucket's checkpoint here when it is the newer; the name the slot
        will resume from (None: none). The store being away is logged; the slot starts from what it has."""
        root = self.root(spec)
        local = _read_latest(root)
        try:
            remote = await self.objects.info(self.object_name(spec))
            if choose(local, _read_mark(root), remote) == "local" or remote is None:
                return local
            got = await self.objects.get(self.object_name(spec))
        except LogError as exc:
            self.logger.warning("checkpoint_not_fetched", slot=spec.slot, problem=str(exc))
            return local
        if got is None:
            return local
        stored, data = got
        name = stored.note
        if not name or "/" in name or name.startswith("."):
            self.logger.warning(
                "checkpoint_not_fetched", slot=spec.slot, problem=f"object names no checkpoint: {name!r}"
            )
            return local
        ckpts = root / CHECKPOINTS
        tmp = ckpts / f".tmp-fetched-{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            await asyncio.to_thread(_unpack_flat, data, tmp)
        except (LogError, tarfile.TarError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            self.logger.warning("checkpoint_not_fetched", slot=spec.slot, problem=str(exc))
            return local
        shutil.rmtree(ckpts / name, ignore_errors=True)
        os.replace(tmp, ckpts / name)
        _write_atomic(root / LATEST, (name + "\n").encode())
        _write_atomic(root / MARK, msgspec.json.encode(Synced(name=name, digest=stored.digest)))
        self.logger.info("checkpoint_fetched", slot=spec.slot, checkpoint=name, was=local, bytes=len(data))
        return name

    async def upload(self, spec: TrainingSpec) -> bool:
        """Upload the slot's newest checkpoint if it is not the one last uploaded or fetched; True if it did."""
        root = self.root(spec)
        name = _read_latest(root)
        mark = _read_mark(root)
        if name is None or (mark is not None and mark.name == name):
            return False
        try:
            data = await asyncio.to_thread(pack, root / CHECKPOINTS / name)  # off the loop
        except OSError:
            return False  # the trainer replaced it while it was read: the next poll takes the new one
        stored = await self.objects.put(self.object_name(spec), data, note=name)
        _write_atomic(root / MARK, msgspec.json.encode(Synced(name=name, digest=stored.digest)))
        self.logger.info("checkpoint_uploaded", slot=spec.slot, checkpoint=name, bytes=len(data))
        return True

    async def forget(self, spec: TrainingSpec) -> None:
        """The run is over (its adapter is published): nothing of it is to be resumed anywhere."""
        await self.objects.delete(self.object_name(spec))
        (self.root(spec) / MARK).unlink(missing_ok=True)

    async def run(self, specs: Iterable[TrainingSpec]) -> None:
        """Upload every slot's new checkpoints, every `interval_s`, until cancelled."""
        specs = list(specs)
        while True:
            await self.sync(specs)
            await asyncio.sleep(self.interval_s)

    async def sync(self, specs: Iterable[TrainingSpec]) -> None:
        """One upload attempt per slot; a problem is logged when it first appears (not once a second)."""
        for spec in specs:
            try:
                await self.upload(spec)
            except LogError as exc:
                if self._problems.get(spec.slot) != str(exc):
                    self.logger.warning("checkpoint_not_uploaded", slot=spec.slot, problem=str(exc))
                self._problems[spec.slot] = str(exc)
            else:
                self._problems.pop(spec.slot, None)
