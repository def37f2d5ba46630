"""The layout file as written: the raw document structs, the keys each object may hold, and the helpers
every section's check shares (sizes, names, msgspec's errors turned into a `LayoutError` with a path).

`clean` drops `_comment`-style keys and refuses unknown ones with the keys allowed; `convert_at` reads
the cleaned document into `LayoutDoc`. The checks that make a `haru.core.specs.Layout` of it are in
`haru.core.layout` (the fleet), `layout_domains`, `layout_models` and `layout_provision`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec

from haru.core.errors import InvalidName, LayoutError
from haru.core.sizes import parse_size
from haru.core.specs import AdapterProbe, NonNegative, Policy, PreemptionNotice, ProvisionSpec, ServiceSpec
from haru.core.subjects import check_name

__all__ = [
    "DomainDoc",
    "GpuDoc",
    "LayoutDoc",
    "ModelDoc",
    "SlotDoc",
    "checked_name",
    "clean",
    "convert_at",
    "size_at",
]


_T = TypeVar("_T")


# ----------------------------------------------------------------------------- allowed keys

_TOP_KEYS = ("fleet", "uuid", "policy", "domains", "gpu_prices")
_DOMAIN_KEYS = (
    "name",
    "provider",
    "region",
    "serving_url",
    "serve",
    "network",
    "expose_dev_endpoints",
    "gpus",
    "slots",
    "provision",
    "preemption_notice",
    "host_ram",
    "host_ram_reserve",
    "price",
)
_PROVISION_KEYS = tuple(ProvisionSpec.__struct_fields__)
_SERVICE_KEYS = tuple(ServiceSpec.__struct_fields__)
_GPU_KEYS = ("index", "memory", "reserve", "name")
_INFERENCE_SLOT_KEYS = ("name", "kind", "gpu", "models")
_TRAINING_SLOT_KEYS = ("name", "kind", "gpu", "command", "checkpoint_dir", "vram", "grace_ms", "host_ram")
_MODEL_KEYS = (
    "name",
    "runtime",
    "vram",
    "context_length",
    "port",
    "source",
    "url",
    "binary",
    "args",
    "env",
    "adapters",
    "gpu_layers",
    "gpus",
    "host_ram",
    "max_loras",
    "max_lora_rank",
    "adapter_probes",
)
_POLICY_KEYS = tuple(Policy.__struct_fields__)

Size = int | str


class GpuDoc(msgspec.Struct, forbid_unknown_fields=True):
    index: NonNegative  # the NVML index
    memory: Size
    reserve: Size = 0
    name: str = ""


class ModelDoc(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    runtime: Literal["vllm", "llama_server", "external", ""] = ""  # "": follows the source's format
    vram: Size = 0
    context_length: NonNegative = 0  # 0: the runtime's default
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0  # 0: unset
    source: str = ""
    url: str = ""
    binary: list[str] | str = []
    args: list[str] = []
    env: dict[str, str] = {}
    adapters: dict[str, str] = {}
    gpu_layers: int = -1
    gpus: list[NonNegative] = []  # tensor parallel: every GPU it spans, the slot's among them
    host_ram: Size = 0  # host RAM its sleep keeps (its weights); 0 = its VRAM per GPU, an upper bound
    max_loras: NonNegative = 0  # adapters its runtime may hold at once, loaded at run time (0 = none)
    max_lora_rank: Annotated[int, msgspec.Meta(ge=1, le=512)] = 16
    adapter_probes: dict[str, list[AdapterProbe]] = {}  # adapter -> the cases its versions must pass


class SlotDoc(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    kind: Literal["inference", "training"] = "inference"
    gpu: NonNegative = 0
    models: list[ModelDoc] = []
    command: list[str] = []
    checkpoint_dir: str = ""
    vram: Size = 0
    grace_ms: NonNegative = 0
    host_ram: Size = 0


class DomainDoc(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    provider: Literal["static", "skypilot", "skyserve"] = "static"
    region: str = ""
    serving_url: str = ""
    serve: Literal["agent", "direct"] = "agent"
    # `serve: direct` puts the runtimes on `serving.host`, vLLM's development-mode /sleep and /wake_up
    # with them: allowed only where the layout says the network is private and that is acceptable.
    network: Literal["", "private"] = ""
    expose_dev_endpoints: bool = False
    gpus: list[GpuDoc] = []
    slots: list[SlotDoc] = []
    provision: dict[str, Any] | None = None
    preemption_notice: PreemptionNotice | None = None
    host_ram: Size = 0  # 0 = not declared: host RAM is not planned
    host_ram_reserve: Size = 0
    price: dict[str, Any] | None = None  # {"per_hour": 2.49, "currency": "USD"} (haru.core.prices)


class LayoutDoc(msgspec.Struct, forbid_unknown_fields=True):
    fleet: str
    uuid: str = ""
    policy: dict[str, Any] = {}
    domains: list[DomainDoc] = []
    gpu_prices: dict[str, Any] = {}  # GPU name -> a price (haru.core.prices)


# ---------------------------------------------------------------------------------- sizes


def size_at(value: object, path: str, what: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise LayoutError(
            f"bad {what}: {exc}", path=path, fix="write bytes (20000000000) or a size like '20GiB'"
        ) from None


# ---------------------------------------------------------------------------- unknown keys


def _check_keys(obj: object, allowed: tuple[str, ...], path: str, what: str) -> dict[str, Any]:
    """Refuse keys that are not in `allowed`; drop `_comment`-style keys. Returns the cleaned dict."""
    if not isinstance(obj, dict):
        raise LayoutError(
            f"{what} must be a JSON object, got {type(obj).__name__}",
            path=path,
            fix=f"write {what} as {{...}} with keys {', '.join(allowed)}",
        )
    out = {}
    for key, value in obj.items():
        if isinstance(key, str) and key.startswith("_"):
            continue  # comments
        if key not in allowed:
            raise LayoutError(
                f"unknown key {key!r} in {what}",
                path=f"{path}.{key}",
                fix=f"remove it or use one of: {', '.join(allowed)} (keys starting with '_' are comments)",
            )
        out[key] = value
    return out


def clean(raw: object) -> dict[str, Any]:
    top = _check_keys(raw, _TOP_KEYS, "$", "the layout")
    if "policy" in top:
        top["policy"] = _check_keys(top["policy"], _POLICY_KEYS, "$.policy", "policy")
    domains = top.get("domains")
    if isinstance(domains, list):
        clean_domains = []
        for i, d in enumerate(domains):
            dp = f"$.domains[{i}]"
            d = _check_keys(d, _DOMAIN_KEYS, dp, "a domain")
            if isinstance(d.get("gpus"), list):
                d["gpus"] = [_check_keys(g, _GPU_KEYS, f"{dp}.gpus[{j}]", "a GPU") for j, g in enumerate(d["gpus"])]
            if isinstance(d.get("slots"), list):
                slots = []
                for j, s in enumerate(d["slots"]):
                    sp = f"{dp}.slots[{j}]"
                    kind = s.get("kind", "inference") if isinstance(s, dict) else "inference"
                    if kind == "training":
                        s = _check_keys(s, _TRAINING_SLOT_KEYS, sp, "a training slot")
                    else:
                        s = _check_keys(s, _INFERENCE_SLOT_KEYS, sp, "an inference slot")
                        if isinstance(s.get("models"), list):
                            s["models"] = [
                                _check_keys(m, _MODEL_KEYS, f"{sp}.models[{k}]", "a model")
                                for k, m in enumerate(s["models"])
                            ]
                    slots.append(s)
                d["slots"] = slots
            if "provision" in d:
                d["provision"] = _check_keys(d["provision"], _PROVISION_KEYS, f"{dp}.provision", "provision")
                if "service" in d["provision"]:
                    d["provision"]["service"] = _check_keys(
                        d["provision"]["service"], _SERVICE_KEYS, f"{dp}.provision.service", "provision.service"
                    )
            clean_domains.append(d)
        top["domains"] = clean_domains
    return top


def convert_at(obj: object, typ: type[_T], path_prefix: str = "") -> _T:
    try:
        return msgspec.convert(obj, typ)
    except msgspec.ValidationError as exc:
        text = str(exc)
        message, sep, where = text.rpartition(" - at `")
        if sep:
            path = where.rstrip("`")
            if path_prefix:
                path = path_prefix + path[1:]
        else:
            message, path = text, path_prefix or "$"
        fix = (
            "give a value in the range named"
            if any(op in message for op in (">=", "<=", "> ", "< "))
            else "give the value the type named"
        )
        raise LayoutError(message, path=path, fix=f"{fix}; see docs/residency.md") from None


def checked_name(kind: str, value: str, path: str) -> str:
    try:
        return check_name(kind, value)
    except InvalidName as exc:
        raise LayoutError(
            str(exc), path=path, fix=f"name the {kind} with lowercase letters, digits, '_' or '-'"
        ) from None
