"""The publish manifest: what a training run leaves in its checkpoint directory when it has an adapter to
publish (`publish.json`), and the checks an agent makes before it publishes anything.

    {"base_model": "m1", "adapter": "support", "version": "<run id>", "adapter_dir": "adapter", "rank": 8,
     "data": "/data/support.jsonl", "data_digest": "sha256:<hex>",
     "metrics": {"steps": 2000, "loss": 0.41, "held_out_loss": 0.52}}

`read(raw)` decodes it (a bad field is named with its path); `problems(manifest, ...)` says what keeps it from
being published, in words that name the field, the value and the fix. Pure: the agent reads the files and
passes what it found (agents/publishing.py).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Annotated

import msgspec
from msgspec import Meta

__all__ = ["MANIFEST", "ADAPTER_FILES", "ManifestError", "PublishManifest", "read", "problems", "object_name"]

MANIFEST = "publish.json"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")

Name = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
Version = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")]
Digest = Annotated[str, Meta(pattern=r"^sha256:[0-9a-f]{64}$")]


class ManifestError(ValueError):
    """A publish manifest that cannot be published: the trainer's (or the operator's) to fix."""


class PublishManifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    base_model: str
    adapter: Name
    version: Version
    adapter_dir: str
    rank: Annotated[int, Meta(ge=1, le=1024)]
    data: str = ""
    data_digest: Digest | None = None
    metrics: dict[str, float] = {}


_decoder = msgspec.json.Decoder(PublishManifest)


def read(raw: bytes) -> PublishManifest:
    try:
        return _decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise ManifestError(f"{MANIFEST}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ManifestError(f"{MANIFEST} is not JSON ({exc}); the trainer writes it whole, last") from exc


def problems(
    m: PublishManifest, *, models: Collection[str], files: Collection[str], config_rank: int | None
) -> list[str]:
    """Why `m` may not be published: `models` are the declared models it may adapt, `files` what its
    adapter_dir holds, `config_rank` the `r` of its adapter_config.json (None: unreadable)."""
    out = []
    if m.base_model not in models:
        out.append(
            f"base_model {m.base_model!r} is not a model this domain serves ({', '.join(sorted(models)) or 'none'}); "
            f"pass the declared model id the adapter was trained on"
        )
    if m.adapter_dir.startswith("/") or ".." in m.adapter_dir.split("/") or not m.adapter_dir:
        out.append(f"adapter_dir {m.adapter_dir!r} must be a folder inside the checkpoint directory")
    missing = [f for f in ADAPTER_FILES if f not in files]
    if missing:
        out.append(f"adapter_dir {m.adapter_dir!r} has no {', '.join(missing)} (PEFT's save_pretrained writes them)")
    elif config_rank is None:
        out.append("adapter_config.json is not a PEFT LoRA config with an integer `r`")
    elif config_rank != m.rank:
        out.append(f"rank {m.rank} disagrees with adapter_config.json's r = {config_rank}")
    return out


def object_name(fleet: str, m: PublishManifest) -> str:
    """The adapter version's object in the adapters bucket."""
    return f"{fleet}/{m.base_model}:{m.adapter}/{m.version}"
