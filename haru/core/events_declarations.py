"""The declaration events (`haru.evt.<fleet>.decl`): the fleet, its policy, domains, models, training
slots, admission verdicts and fetched model files, as `haru apply` and the fetchers write them.
Import them from `haru.core.events`, whose union and codecs they belong to.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from haru.core.events_base import Event
from haru.core.prices import Price
from haru.core.specs import DomainSpec, ModelSpec, Policy, TrainingSpec

__all__ = [
    "AdmissionDecided",
    "DomainChanged",
    "DomainDeclared",
    "DomainRetired",
    "FetchedFile",
    "FleetDeclared",
    "ModelChanged",
    "ModelDeclared",
    "ModelFetched",
    "ModelRetired",
    "PolicyChanged",
    "PriceDeclared",
    "TrainingChanged",
    "TrainingDeclared",
    "TrainingRetired",
]


# ---------------------------------------------------------------- declarations: haru.evt.<fleet>.decl


class FleetDeclared(Event, frozen=True, kw_only=True, tag="fleet_declared"):
    fleet: str
    policy: Policy
    uuid: str = ""  # the fleet's stable UUID (declared, or derived from its name); '' in older logs


class PolicyChanged(Event, frozen=True, kw_only=True, tag="policy_changed"):
    policy: Policy
    previous: Policy | None = None


class DomainDeclared(Event, frozen=True, kw_only=True, tag="domain_declared"):
    spec: DomainSpec


class DomainChanged(Event, frozen=True, kw_only=True, tag="domain_changed"):
    spec: DomainSpec


class DomainRetired(Event, frozen=True, kw_only=True, tag="domain_retired"):
    domain: str


class ModelDeclared(Event, frozen=True, kw_only=True, tag="model_declared"):
    domain: str
    spec: ModelSpec


class ModelChanged(Event, frozen=True, kw_only=True, tag="model_changed"):
    domain: str
    spec: ModelSpec


class ModelRetired(Event, frozen=True, kw_only=True, tag="model_retired"):
    domain: str
    model: str


class TrainingDeclared(Event, frozen=True, kw_only=True, tag="training_declared"):
    domain: str
    spec: TrainingSpec


class TrainingChanged(Event, frozen=True, kw_only=True, tag="training_changed"):
    domain: str
    spec: TrainingSpec


class TrainingRetired(Event, frozen=True, kw_only=True, tag="training_retired"):
    domain: str
    slot: str


class AdmissionDecided(Event, frozen=True, kw_only=True, tag="admission_decided"):
    """The planner's verdict for one model (kind=model) or training slot (kind=training)."""

    domain: str
    kind: Literal["model", "training"] = "model"
    name: str  # the model id, or the training slot name
    gpu_index: int
    admitted: bool
    vram_bytes: int
    short_by_bytes: int = 0
    capacity_bytes: int = 0  # memory - reserve of that GPU (of host RAM, when that is what it was short of)
    resource: Literal["vram", "host_ram"] = "vram"  # what it was short of
    host_ram_bytes: int = 0  # what it books in host RAM while its domain is standby (sleeping weights, trainer)
    gpu_indexes: list[int] = []  # a model across GPUs: every GPU it spans ([] = gpu_index alone)


# ------------------------------------------------- model files: haru.evt.<fleet>.decl (haru.models)


class FetchedFile(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # the file's name in the materialized model
    digest: str  # sha256:<hex> (or gitsha1:<hex> for a small Hugging Face file kept in git)
    size: int
    fetched: bool = True  # False: it was already in the store and re-hashed right


class ModelFetched(Event, frozen=True, kw_only=True, tag="model_fetched"):
    """`haru pull` (or an agent pulling a layout's reference) put a model's files, verified, in a store.

    Where a model's files came from: `haru why` shows it. On the fleet's decl subject: a fetch is a
    fact about what was declared, not about one runtime's residency."""

    reference: str  # canonical: `ollama:library/qwen3:0.6b`, `hf:ORG/REPO:Q4_K_M@<commit>`
    model: str = ""  # the model id (or the reference as typed) it was pulled for
    domain: str = ""  # the agent's domain that pulled it ('' = the CLI)
    origin: str = ""  # the registry's base URL
    revision: str = ""  # the Ollama tag, or the Hugging Face commit
    format: str = ""  # gguf | safetensors
    path: str = ""  # the materialized path on `host`
    host: str = ""
    files: list[FetchedFile] = []
    fetched_bytes: int = 0
    reused_bytes: int = 0
    healed: list[str] = []  # digests found corrupt in the store and fetched again
    took_ms: int = 0


# ------------------------------------------------------- prices: haru.evt.<fleet>.decl (haru.core.prices)


class PriceDeclared(Event, frozen=True, kw_only=True, tag="price_declared"):
    """A domain's hourly price from `at` on (`haru apply` writes it when the layout's price differs from the
    recorded one); `price` None: the domain is unpriced from then on. docs/cost.md."""

    domain: str
    price: Price | None = None
