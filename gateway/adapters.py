"""LoRA adapters served at run time, as the gateway routes them (pure; docs/adapters.md).

A client sends `<base>:<adapter>` (haru.core.adapters). The gateway sends it where the base model goes (the
active domain, or its split) with `model` set to the runtime name of one version, `<base>:<adapter>@<version>`:
the canary's for `percent` of the requests, the current one's for the rest (`haru.core.adapters.pick`). A
version is sent only to a domain whose runtime holds it (`adapter_state_changed` resident): a canary not yet
loaded there leaves its share to the current version; a current version not loaded there yet is a warming
model (503 + Retry-After), as a model loading is.

`with_model(body, name)` rewrites `model` and nothing else: the other members keep their bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec

from haru.core.adapters import AdapterView, pick, runtime_name
from haru.core.openai_errors import ANSWER_STATUS

__all__ = ["AdapterRoute", "with_model"]

ADAPTER_RETRY_S = 2  # a version loading (seconds) or waiting for its probe: retried soon

_members = msgspec.json.Decoder(dict[str, msgspec.Raw])
_encode = msgspec.json.Encoder()


def with_model(body: bytes, name: str) -> bytes:
    """`body` (a JSON object already read for its `model`) with `model` set to `name`."""
    members = _members.decode(body)
    members["model"] = msgspec.Raw(_encode.encode(name))
    return _encode.encode(members)


class AdapterRoute:
    """One adapter's routes: which version the next request takes, on the domain its base model's goes to."""

    __slots__ = ("av", "_n")

    def __init__(self, av: AdapterView) -> None:
        self.av = av
        self._n = 0

    def version_for(self, domain: str) -> tuple[str, str]:
        """(runtime name, '') of the version the next request to `domain` takes, or ('', why none can)."""
        av = self.av
        n = self._n
        self._n = n + 1
        chosen = pick(av, n)
        for version in (chosen, av.current):
            if not version:
                continue
            copy = av.copy(domain, version)
            if copy is not None and copy.state == "resident":
                return runtime_name(av.model, av.adapter, version), ""
        if not av.current:
            waiting = next(reversed(av.versions), "") if av.versions else ""
            return "", (
                f"adapter {av.served!r} has no version that passed its probe yet"
                + (f" (version {waiting!r} waits for it)" if waiting else "")
            )
        copy = av.copy(domain, av.current)
        state = f"{copy.state}: {copy.detail}" if copy is not None and copy.detail else (copy.state if copy else "")
        return "", (
            f"adapter {av.served!r} version {av.current!r} is not loaded on domain {domain!r} yet"
            + (f" ({state})" if state else "")
        )

    @staticmethod
    def refusal_fields(why: str, domain: str) -> dict[str, Any]:
        status, code = ANSWER_STATUS["warming"]
        return {"status": status, "code": code, "message": f"{why}; retry in {ADAPTER_RETRY_S} s", "domain": domain}
