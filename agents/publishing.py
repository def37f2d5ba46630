"""Publishing what a training run produced: a finished run leaves `publish.json` (haru.core.publish_manifest)
and its adapter's folder in the slot's checkpoint directory and exits 0; the agent checks the manifest, puts a
tar of the adapter's folder in the adapters bucket (one object per version, never replaced), and returns the
`adapter_published` event for the slot to record on its subject. Then the manifest moves to
`published/<version>.json`, so the next start of the slot begins a new run.

A manifest that cannot be published is left where it is and nothing is stored or recorded: the problem is
logged (`adapter_not_published`, naming the field and the fix) each time the slot exits over it, and the
example trainer exits at once while it is there. Publishing twice (the agent died between the event and the
move) finds the object with the same bytes and the event already on the subject: nothing is repeated.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import tarfile
from collections.abc import Callable, Collection
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from haru.core import publish_manifest as pm
from haru.core import subjects
from haru.core.errors import LogError
from haru.core.events import AdapterPublished
from haru.core.specs import TrainingSpec
from haru.log.seam import EventReader
from haru.log.training_objects import Objects, digest_of

__all__ = ["Publisher", "pack"]


def pack(directory: Path) -> bytes:
    """A tar of `directory`'s regular files, by name, without the folder's own name; the same files give the
    same bytes (no times, owners or modes from the disk), so a retried publish finds the same digest."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(directory.iterdir()):
            if not path.is_file() or path.is_symlink():
                continue
            data = path.read_bytes()
            info = tarfile.TarInfo(path.name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _rank_of(config: Path) -> int | None:
    try:
        r = json.loads(config.read_text(encoding="utf-8")).get("r")
    except (OSError, ValueError, AttributeError):
        return None
    return r if isinstance(r, int) and not isinstance(r, bool) else None


class Publisher:
    def __init__(
        self,
        *,
        fleet: str,
        domain: str,
        objects: Objects,
        log: EventReader,
        models: Callable[[], Collection[str]],
        logger: Any,
    ) -> None:
        """`models`: the declared models an adapter of this domain may adapt (the ones it serves)."""
        self.fleet = fleet
        self.domain = domain
        self.objects = objects
        self.log = log
        self.models = models
        self.logger = logger

    async def publish(self, spec: TrainingSpec) -> tuple[AdapterPublished, Callable[[], None]] | None:
        """The event to record for the slot's finished run, and what to call once it is recorded (None: no
        finished run, an unpublishable one, or one already recorded)."""
        root = Path(os.path.expanduser(spec.checkpoint_dir))
        path = root / pm.MANIFEST
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._refuse(spec, path, [f"cannot read it: {exc}"])
            return None
        try:
            manifest = pm.read(raw)
        except pm.ManifestError as exc:
            self._refuse(spec, path, [str(exc)])
            return None
        folder = root / manifest.adapter_dir
        files = [p.name for p in folder.iterdir() if p.is_file()] if folder.is_dir() else []
        found = pm.problems(
            manifest, models=self.models(), files=files, config_rank=_rank_of(folder / "adapter_config.json")
        )
        if found:
            self._refuse(spec, path, found)
            return None
        data = await asyncio.to_thread(pack, folder)  # off the loop: the heartbeat goes on while it reads
        digest, name = digest_of(data), pm.object_name(self.fleet, manifest)
        try:
            stored = await self.objects.info(name)
            if stored is not None and stored.digest != digest:
                self._refuse(
                    spec,
                    path,
                    [
                        f"version {manifest.version!r} of adapter {manifest.adapter!r} is already published with other "
                        f"bytes ({stored.digest}); a run id names one adapter: give the new run its own"
                    ],
                )
                return None
            if stored is None:
                await self.objects.put(name, data)
        except LogError as exc:
            self.logger.error("adapter_not_published", slot=spec.slot, manifest=str(path), problem=str(exc))
            return None
        done = self._done(path, root / "published" / f"{manifest.version}.json")
        if await self._recorded(spec.slot, manifest):
            done()
            return None
        event = AdapterPublished(
            at=datetime.now(UTC),
            domain=self.domain,
            slot=spec.slot,
            base_model=manifest.base_model,
            adapter=manifest.adapter,
            version=manifest.version,
            object_name=name,
            digest=digest,
            size_bytes=len(data),
            rank=manifest.rank,
            data=f"{manifest.data} {manifest.data_digest}" if manifest.data_digest else manifest.data,
            metrics=dict(manifest.metrics),
        )
        return event, done

    async def _recorded(self, slot: str, m: pm.PublishManifest) -> bool:
        for rec in await self.log.history(subjects.training(self.fleet, self.domain, slot)):
            e = rec.event
            if isinstance(e, AdapterPublished) and e.adapter == m.adapter and e.version == m.version:
                return True
        return False

    def _done(self, path: Path, to: Path) -> Callable[[], None]:
        def done() -> None:
            to.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, to)

        return done

    def _refuse(self, spec: TrainingSpec, path: Path, problems: list[str]) -> None:
        self.logger.error(
            "adapter_not_published",
            slot=spec.slot,
            manifest=str(path),
            problem="; ".join(problems),
            fix=f"correct or remove {path}; the slot's trainer exits at once while it is there",
        )
