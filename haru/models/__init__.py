"""From a model reference to files on disk: parse (`refs`), ask the registry (`resolve`), fetch into the
content-addressed store (`pull`, its transfers in `download`, `store`), and record the fetch (`record`).
See docs/models.md."""

from haru.core.model_errors import (
    BadReference,
    DigestMismatch,
    FetchError,
    ModelsError,
    NotFound,
    RegistryError,
    StoreError,
    Truncated,
    Unauthorized,
)
from haru.core.refs import Blob, Ref, Resolution, is_reference, parse_reference
from haru.models.resolve import Settings
from haru.models.store import Store, default_root

__all__ = [
    "BadReference",
    "Blob",
    "DigestMismatch",
    "FetchError",
    "ModelsError",
    "NotFound",
    "Ref",
    "RegistryError",
    "Resolution",
    "Settings",
    "Store",
    "StoreError",
    "Truncated",
    "Unauthorized",
    "default_root",
    "is_reference",
    "parse_reference",
]
