"""LoRA adapters served at run time, as the view holds them (pure; docs/adapters.md).

A training run publishes a version of an adapter for a base model (`adapter_published`); the promoter's
probe gate decides which version takes the adapter's traffic (`adapter_routed`); each domain's agent says
what its runtime of the base model holds (`adapter_state_changed`). `haru.core.fold_adapters` folds the three
into `FleetView.adapters`, one `AdapterView` per served id:

    <base>:<adapter>              the OpenAI model id clients send (the base model's id, a colon, the name)
    <base>:<adapter>@<version>    the name one version is loaded under in a runtime (`runtime_name`)

The gateway sends `<base>:<adapter>` to the base model's domain with `model` set to the runtime name of the
version it picked (`pick`: the canary takes `percent` of the requests, the current version the rest).
"""

from __future__ import annotations

from datetime import datetime

import msgspec

__all__ = [
    "AdapterCopy",
    "AdapterVersion",
    "AdapterView",
    "pending",
    "pick",
    "runtime_name",
    "served_id",
    "split_runtime_name",
    "wanted",
]


class AdapterVersion(msgspec.Struct, frozen=True, kw_only=True):
    """One published version: where its bytes are and what produced it (`adapter_published`)."""

    version: str
    object_name: str
    digest: str
    size_bytes: int = 0
    rank: int = 0
    domain: str = ""  # the domain whose training slot ran it
    slot: str = ""
    data: str = ""
    metrics: dict[str, float] = {}
    published_at: datetime | None = None
    seq: int = 0  # the adapter_published event


class AdapterCopy(msgspec.Struct, frozen=True, kw_only=True):
    """One version in one domain's runtime (`adapter_state_changed`)."""

    domain: str
    version: str
    state: str  # loading | resident | failed | unloaded | not_admitted
    detail: str = ""
    runtime_name: str = ""
    took_ms: int = 0
    probe: str = ""  # its evaluation probe on load: passed | failed | '' (none declared)
    probe_detail: str = ""
    at: datetime | None = None
    seq: int = 0


class AdapterChange(msgspec.Struct, frozen=True, kw_only=True):
    """The last `adapter_routed`: what changed the adapter's routing, about which version, and why."""

    reason: str
    version: str = ""
    detail: str = ""
    by: str = ""
    at: datetime | None = None
    seq: int = 0


class AdapterView(msgspec.Struct, frozen=True, kw_only=True):
    """One adapter of one base model: its versions in publication order, which one serves."""

    model: str  # the base model
    adapter: str
    versions: dict[str, AdapterVersion] = {}  # in publication order
    current: str = ""  # '' = nothing serves yet (its first version waits for its probe)
    canary: str = ""
    percent: int = 0  # the canary's share of the requests
    previous: str = ""  # what a rollback returns to; kept loaded
    routed_seq: int = 0  # the last adapter_routed (0 = never)
    change: AdapterChange | None = None
    rolled_back: dict[str, str] = {}  # version -> why it was rolled back
    copies: dict[str, AdapterCopy] = {}  # `<domain>/<version>` -> what that domain's runtime holds

    @property
    def served(self) -> str:
        return served_id(self.model, self.adapter)

    def copy(self, domain: str, version: str) -> AdapterCopy | None:
        return self.copies.get(f"{domain}/{version}")


def served_id(model: str, adapter: str) -> str:
    """The OpenAI model id of `adapter` on `model`."""
    return f"{model}:{adapter}"


def runtime_name(model: str, adapter: str, version: str) -> str:
    """The name one version is loaded under in its runtime (unique per version, so two load side by side)."""
    return f"{model}:{adapter}@{version}"


def split_runtime_name(name: str) -> tuple[str, str] | None:
    """(`<base>:<adapter>`, version) of a runtime name, None for a name that is not one."""
    served, at, version = name.rpartition("@")
    if not at or not version or ":" not in served:
        return None
    return served, version


def pending(av: AdapterView) -> str:
    """The newest published version nobody has decided on yet ('' = none): what the probe gate asks next."""
    if not av.versions:
        return ""
    newest = next(reversed(av.versions))
    decided = {av.current, av.canary, av.previous, *av.rolled_back}
    return "" if newest in decided else newest


def wanted(av: AdapterView) -> list[str]:
    """The versions a runtime of the base model should hold, most important first: the current one, the
    canary, the one waiting for its probe, then the previous one (what a rollback returns to)."""
    out: list[str] = []
    for v in (av.current, av.canary, pending(av), av.previous):
        if v and v not in out and v in av.versions:
            out.append(v)
    return out


def pick(av: AdapterView, n: int) -> str:
    """The version the `n`th request goes to: the canary for `percent` of every 100, else the current one
    ('' = none serves). Deterministic, so a split is exact over any 100 consecutive requests."""
    if av.canary and av.percent and n % 100 < av.percent:
        return av.canary
    return av.current or (av.canary if av.percent else "")
