"""Errors of `haru.models` (references, registries, the store, pulls). A leaf: imports only `haru.core.errors`.

ModelsError                      (base; a HaruError, so the CLI prints it in one line)
├── BadReference                 a reference that does not parse, or names nothing usable   (operator)
├── RegistryError                a registry answered with an error: carries url and status  (registry)
│   ├── NotFound                 404: no such repository, tag, revision or file
│   └── Unauthorized             401/403: a token is missing or not allowed
├── FetchError                   a download broke off or sent other bytes than promised    (network)
│   ├── Truncated                fewer (or more) bytes than the resolution said
│   └── DigestMismatch           the bytes do not hash to the expected digest
├── StoreError                   the store under $HARU_HOME cannot be written or read      (host)
└── ConvertError                 `haru convert`: a bad input, a missing tool, a failed step   (operator/host)
"""

from __future__ import annotations

from haru.core.errors import HaruError


class ModelsError(HaruError):
    """Base of every error of references, registries, pulls and the model store."""


class BadReference(ModelsError, ValueError):
    """A model reference that cannot be resolved as written."""


class RegistryError(ModelsError):
    def __init__(self, message: str, *, url: str = "", status: int = 0) -> None:
        self.url = url
        self.status = status
        super().__init__(message)


class NotFound(RegistryError):
    pass


class Unauthorized(RegistryError):
    pass


class FetchError(ModelsError):
    pass


class Truncated(FetchError):
    pass


class DigestMismatch(FetchError):
    pass


class StoreError(ModelsError):
    pass


class ConvertError(ModelsError):
    pass
