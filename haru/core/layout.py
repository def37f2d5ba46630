"""The declarative fleet layout: JSON in, a validated `haru.core.specs.Layout` out.

Pure: no I/O except `load_layout`, which only reads the file. Every error is a
`haru.core.errors.LayoutError` carrying the JSON path of the offending value (`$.domains[1].gpus[0].memory`)
and the fix. The shape (documented with examples in docs/residency.md):

    {
      "_comment": "...",                       keys starting with "_" are comments, anywhere
      "fleet": "default",
      "policy": {"auto_failover": true, "sleep_residual_bytes": "512MiB", ...},
      "domains": [                             2..N, mirroring the same model ids (or one: no failover)
        {"name": "a", "provider": "static", "region": "local-1",
         "serving_url": "http://127.0.0.1:18601", "serve": "agent",
         "gpus": [{"index": 0, "memory": "24GiB", "reserve": "2GiB", "name": "L4"}],
         "slots": [
           {"name": "chat", "gpu": 0, "models": [
              {"name": "qwen3.6:27b", "runtime": "vllm", "vram": "20GiB", "context_length": 32768,
               "port": 18100, "source": "Qwen/...", "url": "", "binary": [...], "args": [...], "env": {}}]},
           {"name": "lora", "kind": "training", "gpu": 0, "command": ["python", "train.py"],
            "checkpoint_dir": "~/ckpt", "vram": "8GiB", "grace_ms": 10000}]}]
    }

Sizes are integers (bytes) or strings with a unit: binary `KiB MiB GiB TiB`, decimal `KB MB GB TB`,
or `B`; `20GiB`, `44.2 GiB`, `512MiB`, `1.5GB`. Fractions are rounded to the nearest byte.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from haru.core.errors import InvalidName, LayoutError
from haru.core.launch import ArgConflict, BadBinary, check_args, format_refusal, runtime_for
from haru.core.sizes import parse_size
from haru.core.specs import (
    Domain,
    DomainSpec,
    GpuSpec,
    Layout,
    ModelSpec,
    NonNegative,
    Policy,
    READY_PATH,
    PreemptionNotice,
    ProvisionSpec,
    ServiceSpec,
    TrainingSpec,
    as_uuid,
    model_gpus,
)
from haru.core.subjects import check_model_id, check_name

__all__ = ["parse_layout", "load_layout"]

_T = TypeVar("_T")


# ----------------------------------------------------------------------------- allowed keys

_TOP_KEYS = ("fleet", "uuid", "policy", "domains")
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
)
_POLICY_KEYS = tuple(Policy.__struct_fields__)

Size = int | str


class _Gpu(msgspec.Struct, forbid_unknown_fields=True):
    index: NonNegative  # the NVML index
    memory: Size
    reserve: Size = 0
    name: str = ""


class _Model(msgspec.Struct, forbid_unknown_fields=True):
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


class _Slot(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    kind: Literal["inference", "training"] = "inference"
    gpu: NonNegative = 0
    models: list[_Model] = []
    command: list[str] = []
    checkpoint_dir: str = ""
    vram: Size = 0
    grace_ms: NonNegative = 0
    host_ram: Size = 0


class _Domain(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    provider: Literal["static", "skypilot", "skyserve"] = "static"
    region: str = ""
    serving_url: str = ""
    serve: Literal["agent", "direct"] = "agent"
    # `serve: direct` puts the runtimes on `serving.host`, vLLM's development-mode /sleep and /wake_up
    # with them: allowed only where the layout says the network is private and that is acceptable.
    network: Literal["", "private"] = ""
    expose_dev_endpoints: bool = False
    gpus: list[_Gpu] = []
    slots: list[_Slot] = []
    provision: dict[str, Any] | None = None
    preemption_notice: PreemptionNotice | None = None
    host_ram: Size = 0  # 0 = not declared: host RAM is not planned
    host_ram_reserve: Size = 0


class _Layout(msgspec.Struct, forbid_unknown_fields=True):
    fleet: str
    uuid: str = ""
    policy: dict[str, Any] = {}
    domains: list[_Domain] = []


# ---------------------------------------------------------------------------------- sizes


def _size(value: object, path: str, what: str) -> int:
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


def _clean(raw: object) -> dict[str, Any]:
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


def _convert(obj: object, typ: type[_T], path_prefix: str = "") -> _T:
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


# ------------------------------------------------------------------------------------- parse


def parse_layout(data: bytes | str | dict[str, Any]) -> Layout:
    """Parse and validate a layout. Raises LayoutError(message, path=..., fix=...)."""
    if isinstance(data, (bytes, bytearray, str)):
        try:
            raw = msgspec.json.decode(data)
        except msgspec.DecodeError as exc:
            raise LayoutError(
                f"the layout is not valid JSON: {exc}", path="$", fix="check the file with `python -m json.tool`"
            ) from None
    else:
        raw = data
    cleaned = _clean(raw)
    doc: _Layout = _convert(cleaned, _Layout)
    try:
        fleet = check_name("fleet", doc.fleet)
    except InvalidName as exc:
        raise LayoutError(
            str(exc), path="$.fleet", fix="name the fleet with lowercase letters, digits, '_' or '-'"
        ) from None
    fleet_id = as_uuid(doc.uuid) if doc.uuid else ""
    if doc.uuid and not fleet_id:
        raise LayoutError(
            f"uuid {doc.uuid!r} is not a UUID",
            path="$.uuid",
            fix="write it like 6f1c9d2e-1b7a-4c3e-9f00-2a5d8c7b6e41, or leave it out (it is then derived "
            "from the fleet's name)",
        )
    policy = _policy(doc.policy)
    domains = [_domain(d, i) for i, d in enumerate(doc.domains)]
    _check_fleet(domains, policy)
    return Layout(fleet=fleet, uuid=fleet_id, policy=policy, domains=domains)


def load_layout(path: str | os.PathLike[str]) -> Layout:
    """Read and parse a layout file. A missing file is a LayoutError naming it."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise LayoutError(
            f"cannot read layout file {os.fspath(path)!r}: {exc.strerror}",
            path="$",
            fix="pass the path of a layout JSON file, e.g. deploy/examples/demo-fleet.json",
        ) from None
    return parse_layout(data)


def _policy(raw: dict[str, Any]) -> Policy:
    values = dict(raw)
    for key in values:
        if key.endswith("_bytes"):
            values[key] = _size(values[key], f"$.policy.{key}", key)
    policy = _convert(values, Policy, "$.policy")
    return policy


def _name(kind: str, value: str, path: str) -> str:
    try:
        return check_name(kind, value)
    except InvalidName as exc:
        raise LayoutError(
            str(exc), path=path, fix=f"name the {kind} with lowercase letters, digits, '_' or '-'"
        ) from None


def _domain(d: _Domain, i: int) -> Domain:
    dp = f"$.domains[{i}]"
    name = _name("domain", d.name, f"{dp}.name")
    if d.serving_url and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", d.serving_url):
        raise LayoutError(
            f"serving_url {d.serving_url!r} is not an http(s) URL",
            path=f"{dp}.serving_url",
            fix="write it like 'http://10.0.0.5:8600'",
        )
    if d.serve == "direct" and (d.network != "private" or not d.expose_dev_endpoints):
        raise LayoutError(
            f"domain {name!r} serves direct: its runtimes would listen on the agent's serving host, and vLLM's "
            f"development-mode endpoints (/sleep, /wake_up, /is_sleeping: anyone who reaches them can put a model "
            f"to sleep) with them, with no token in front",
            path=f"{dp}.serve",
            fix='use "serve": "agent" (one authenticated port, sleep and wake never leave the host), or say the '
            'network is private and that this is acceptable there: "network": "private", "expose_dev_endpoints": true',
        )
    gpus = _gpus(d, name, dp)
    gpu_memory = {g.index: g.memory_bytes for g in gpus}
    models: list[ModelSpec] = []
    training: list[TrainingSpec] = []
    seen_slots: dict[str, str] = {}
    seen_models: dict[str, str] = {}
    seen_ports: dict[int, str] = {}
    for j, s in enumerate(d.slots):
        sp = f"{dp}.slots[{j}]"
        slot = _name("slot", s.name, f"{sp}.name")
        if slot in seen_slots:
            raise LayoutError(
                f"slot {slot!r} is declared twice on domain {name!r}",
                path=f"{sp}.name",
                fix=f"give each slot its own name (first at {seen_slots[slot]})",
            )
        seen_slots[slot] = sp
        if s.gpu not in gpu_memory:
            raise LayoutError(
                f"slot {slot!r} is on GPU {s.gpu}, which domain {name!r} does not declare",
                path=f"{sp}.gpu",
                fix=f"use one of the domain's GPU indexes ({', '.join(map(str, sorted(gpu_memory)))}) or declare GPU {s.gpu}",
            )
        if s.kind == "training":
            training.append(_training(s, slot, sp))
            continue
        if not s.models:
            raise LayoutError(
                f"inference slot {slot!r} has no models",
                path=f"{sp}.models",
                fix='add "models": [{"name": "...", "vram": "..."}] or remove the slot',
            )
        for k, m in enumerate(s.models):
            mp = f"{sp}.models[{k}]"
            if m.name in seen_models:
                raise LayoutError(
                    f"model {m.name!r} is declared twice on domain {name!r}",
                    path=f"{mp}.name",
                    fix=f"declare each model once per domain (first at {seen_models[m.name]})",
                )
            seen_models[m.name] = mp
            model = _model(m, slot, s.gpu, mp, direct=d.serve == "direct", domain=name)
            model = msgspec.structs.replace(
                model,
                gpu_indexes=_model_gpus(m, s.gpu, model.runtime, gpu_memory, mp),
                host_ram_bytes=_size(m.host_ram, f"{mp}.host_ram", "model host RAM"),
            )
            if model.port and model.runtime != "external":
                if model.port in seen_ports:
                    raise LayoutError(
                        f"port {m.port} is used twice on domain {name!r}",
                        path=f"{mp}.port",
                        fix=f"give each runtime its own port (first used by {seen_ports[m.port]})",
                    )
                seen_ports[model.port] = mp
            _check_launch(model, m.runtime, mp, max(gpu_memory.get(i, 0) for i in model_gpus(model)))
            models.append(model)
    provision = _provision(d, name, dp) if d.provision is not None else None
    host_ram, host_ram_reserve = _host_ram(d, name, dp)
    spec = DomainSpec(
        name=name,
        provider=d.provider,
        region=d.region,
        serving_url=d.serving_url,
        serve=d.serve,
        gpus=gpus,
        provision=provision,
        preemption_notice=_notice(d.preemption_notice, dp),
        host_ram_bytes=host_ram,
        host_ram_reserve_bytes=host_ram_reserve,
    )
    return Domain(spec=spec, models=models, training=training)


def _notice(notice: PreemptionNotice | None, dp: str) -> PreemptionNotice | None:
    if notice is not None and sum((notice.provider is not None, bool(notice.url), bool(notice.command))) != 1:
        raise LayoutError(
            "preemption_notice needs exactly one of `provider`, `url` and `command`",
            path=f"{dp}.preemption_notice",
            fix='e.g. {"provider": "aws"} (or "gcp", "azure") to read the cloud\'s own metadata service',
        )
    if notice is not None and notice.endpoint and notice.provider is None:
        raise LayoutError(
            "preemption_notice.endpoint goes with `provider` (it overrides the metadata service's address)",
            path=f"{dp}.preemption_notice.endpoint",
            fix="remove `endpoint`, or name the `provider` whose metadata service it is",
        )
    if notice is not None and notice.interval_ms < 100:
        raise LayoutError(
            "preemption_notice.interval_ms is under 100",
            path=f"{dp}.preemption_notice.interval_ms",
            fix="poll every 100 ms or slower (5000 is the default)",
        )
    return notice


def _host_ram(d: _Domain, name: str, dp: str) -> tuple[int, int]:
    """The domain's host RAM and its reserve (0, 0: not declared, not planned)."""
    host_ram = _size(d.host_ram, f"{dp}.host_ram", "host RAM")
    reserve = _size(d.host_ram_reserve, f"{dp}.host_ram_reserve", "host RAM reserve")
    if reserve and not host_ram:
        raise LayoutError(
            f"domain {name!r} declares a host RAM reserve but no host RAM",
            path=f"{dp}.host_ram",
            fix='declare the host\'s RAM too, e.g. "host_ram": "256GiB", or remove the reserve',
        )
    if reserve > host_ram:
        raise LayoutError(
            f"domain {name!r} host RAM reserve ({reserve} bytes) exceeds its host RAM ({host_ram} bytes)",
            path=f"{dp}.host_ram_reserve",
            fix="lower the reserve below the host's RAM",
        )
    return host_ram, reserve


def _model_gpus(m: _Model, slot_gpu: int, runtime: str, declared: dict[int, int], mp: str) -> list[int]:
    """A tensor-parallel model's GPUs, the slot's first ([] for one GPU). Each declared on the domain, once."""
    if not m.gpus:
        return []
    gp = f"{mp}.gpus"
    if runtime == "external":
        raise LayoutError(
            f"external model {m.name!r} declares gpus; Haru does not place an external endpoint",
            path=gp,
            fix="remove gpus",
        )
    seen: list[int] = []
    for k, index in enumerate(m.gpus):
        if index not in declared:
            raise LayoutError(
                f"model {m.name!r} spans GPU {index}, which the domain does not declare",
                path=f"{gp}[{k}]",
                fix=f"use the domain's GPU indexes ({', '.join(map(str, sorted(declared)))}) or declare GPU {index}",
            )
        if index in seen:
            raise LayoutError(
                f"GPU {index} is listed twice in model {m.name!r}'s gpus", path=f"{gp}[{k}]", fix="list each GPU once"
            )
        seen.append(index)
    if slot_gpu not in seen:
        raise LayoutError(
            f"model {m.name!r} spans GPUs {seen} but its slot is on GPU {slot_gpu}",
            path=gp,
            fix=f"include the slot's GPU {slot_gpu} in gpus, or move the slot to one of them",
        )
    if len(seen) == 1:
        return []
    return [slot_gpu, *(i for i in seen if i != slot_gpu)]


def _gpus(d: _Domain, name: str, dp: str) -> list[GpuSpec]:
    gpus: list[GpuSpec] = []
    seen_gpus: dict[int, int] = {}
    for j, g in enumerate(d.gpus):
        gp = f"{dp}.gpus[{j}]"
        if g.index in seen_gpus:
            raise LayoutError(
                f"GPU index {g.index} is declared twice on domain {name!r}",
                path=f"{gp}.index",
                fix=f"remove the duplicate or change its index (first at {dp}.gpus[{seen_gpus[g.index]}])",
            )
        seen_gpus[g.index] = j
        memory = _size(g.memory, f"{gp}.memory", "GPU memory")
        reserve = _size(g.reserve, f"{gp}.reserve", "GPU reserve")
        if memory <= 0:
            raise LayoutError(
                f"GPU {g.index} memory is {memory} bytes",
                path=f"{gp}.memory",
                fix="declare the card's memory, e.g. '24GiB'",
            )
        if reserve > memory:
            raise LayoutError(
                f"GPU {g.index} reserve ({reserve} bytes) exceeds its memory ({memory} bytes)",
                path=f"{gp}.reserve",
                fix="lower the reserve below the card's memory",
            )
        gpus.append(GpuSpec(index=g.index, memory_bytes=memory, reserve_bytes=reserve, name=g.name))
    if not gpus:
        raise LayoutError(
            f"domain {name!r} declares no GPUs",
            path=f"{dp}.gpus",
            fix='add "gpus": [{"index": 0, "memory": "24GiB", "reserve": "2GiB"}]',
        )
    return gpus


def _training(s: _Slot, slot: str, sp: str) -> TrainingSpec:
    if not s.command:
        raise LayoutError(
            f"training slot {slot!r} has no command",
            path=f"{sp}.command",
            fix='give the argv to run, e.g. ["python", "train.py"]',
        )
    if not s.checkpoint_dir.strip():
        raise LayoutError(
            f"training slot {slot!r} has no checkpoint_dir",
            path=f"{sp}.checkpoint_dir",
            fix="give the directory it checkpoints to (passed as HARU_CHECKPOINT_DIR)",
        )
    vram = _size(s.vram, f"{sp}.vram", "training VRAM")
    if vram <= 0:
        raise LayoutError(
            f"training slot {slot!r} declares no VRAM budget",
            path=f"{sp}.vram",
            fix='declare what it may use, e.g. "vram": "8GiB"',
        )
    return TrainingSpec(
        slot=slot,
        gpu_index=s.gpu,
        command=list(s.command),
        checkpoint_dir=s.checkpoint_dir,
        vram_bytes=vram,
        grace_ms=s.grace_ms,
        host_ram_bytes=_size(s.host_ram, f"{sp}.host_ram", "training host RAM"),
    )


def _model(m: _Model, slot: str, gpu: int, mp: str, *, direct: bool, domain: str) -> ModelSpec:
    try:
        check_model_id(m.name)
    except InvalidName as exc:
        raise LayoutError(
            str(exc), path=f"{mp}.name", fix="use the exact OpenAI model id clients send, with no whitespace"
        ) from None
    runtime = m.runtime or runtime_for(m.source, m.url)
    vram = _size(m.vram, f"{mp}.vram", "model VRAM")
    if runtime != "external" and vram <= 0:
        raise LayoutError(
            f"model {m.name!r} declares no VRAM",
            path=f"{mp}.vram",
            fix='declare what its runtime holds on the GPU, e.g. "vram": "20GiB"',
        )
    if runtime == "external" and not m.url:
        raise LayoutError(
            f"external model {m.name!r} has no url",
            path=f"{mp}.url",
            fix='give the base URL of the running endpoint, e.g. "http://10.0.0.5:8000"',
        )
    if direct and runtime != "external" and not m.port:
        raise LayoutError(
            f"model {m.name!r} has no port, and domain {domain!r} serves direct",
            path=f"{mp}.port",
            fix="give each runtime the port routers reach it on, or use serve: agent",
        )
    binary = [m.binary] if isinstance(m.binary, str) else list(m.binary)
    return ModelSpec(
        name=m.name,
        slot=slot,
        gpu_index=gpu,
        runtime=runtime,
        vram_bytes=vram,
        context_length=m.context_length,
        port=m.port,
        source=m.source,
        url=m.url,
        binary=binary,
        args=list(m.args),
        env=dict(m.env),
        adapters=dict(m.adapters),
        gpu_layers=m.gpu_layers,
    )


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ACCELERATORS = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(:\d+(\.\d+)?)?")
_CLUSTER = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_PLACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# What the default run command reads (haru.provision.skypilot): an operator's env may not shadow it.
RESERVED_ENVS = ("HARU_AGENT_CONFIG",)
SERVING_TOKEN = "HARU_SERVING_TOKEN"  # the bearer token an agent's serving port needs beyond loopback


def _provision(d: _Domain, name: str, dp: str) -> ProvisionSpec:
    """The `provision` block of a skypilot/skyserve domain, checked where the mistake is made."""
    pp = f"{dp}.provision"
    if d.provider == "static":
        raise LayoutError(
            f"domain {name!r} is static but declares provision",
            path=pp,
            fix='set "provider": "skypilot" (or "skyserve") to launch it, or remove provision',
        )
    raw = dict(d.provision or {})
    service_given = "service" in raw
    p: ProvisionSpec = _convert(raw, ProvisionSpec, pp)
    if service_given and d.provider != "skyserve":
        raise LayoutError(
            f"domain {name!r} declares provision.service but its provider is {d.provider}",
            path=f"{pp}.service",
            fix='use "provider": "skyserve", or remove service',
        )
    if p.accelerators and not _ACCELERATORS.fullmatch(p.accelerators):
        raise LayoutError(
            f"accelerators {p.accelerators!r} is not SkyPilot's NAME[:COUNT]",
            path=f"{pp}.accelerators",
            fix='write it like "L4:1" or "A100-80GB:8"',
        )
    for key in ("regions", "zones"):
        for i, value in enumerate(getattr(p, key)):
            if not _PLACE.fullmatch(value):
                raise LayoutError(
                    f"{key[:-1]} {value!r} is not a region or zone name",
                    path=f"{pp}.{key}[{i}]",
                    fix="write the cloud's name for it, e.g. us-east-1 or us-east-1a",
                )
    if p.regions and p.zones:
        raise LayoutError(
            "provision gives both regions and zones",
            path=f"{pp}.zones",
            fix="give zones (tried in order) or regions (tried in order), not both",
        )
    if d.region and p.regions and d.region not in p.regions:
        raise LayoutError(
            f"the domain's region {d.region!r} is not among provision.regions {p.regions}",
            path=f"{pp}.regions",
            fix=f"add {d.region!r} to regions or change the domain's region",
        )
    for key in p.envs:
        if not _ENV_NAME.fullmatch(key) or key in RESERVED_ENVS:
            raise LayoutError(
                f"env name {key!r} cannot be used",
                path=f"{pp}.envs.{key}",
                fix="use letters, digits and '_', not starting with a digit, and not "
                + ", ".join(RESERVED_ENVS)
                + " (the run command reads it)",
            )
    for i, key in enumerate(p.secrets):
        if not _ENV_NAME.fullmatch(key) or key in RESERVED_ENVS:
            raise LayoutError(
                f"secret name {key!r} cannot be used",
                path=f"{pp}.secrets[{i}]",
                fix="name an environment variable of the launching process (letters, digits, '_')",
            )
        if key in p.envs:
            raise LayoutError(
                f"{key!r} is both an env and a secret",
                path=f"{pp}.secrets[{i}]",
                fix="declare it once: as a secret when it is a credential",
            )
    if p.cluster and not _CLUSTER.fullmatch(p.cluster):
        raise LayoutError(
            f"cluster name {p.cluster!r} is not a valid SkyPilot cluster name",
            path=f"{pp}.cluster",
            fix="use lowercase letters, digits and '-', starting with a letter",
        )
    if not p.run and SERVING_TOKEN not in p.secrets:
        # The launched agent serves on every address (haru/provision's agent config), which it refuses to do
        # without a serving token: refused here, before anything is launched or paid for.
        raise LayoutError(
            f"domain {name!r} launches an agent that serves on every address of its host, and "
            f"{SERVING_TOKEN} is not among its secrets: the agent would refuse to start",
            path=f"{pp}.secrets",
            fix=f'add "{SERVING_TOKEN}" to provision.secrets, export it where `haru provision` or the promoter '
            "runs, and give the gateway the same value (docs/security.md)",
        )
    if not p.run and not p.nats_url:
        raise LayoutError(
            f"domain {name!r} launches an agent but gives no NATS URL for it",
            path=f"{pp}.nats_url",
            fix='add "nats_url": "nats://<control plane>:4222", the address the launched host reaches',
        )
    if p.service.replicas < 1:
        raise LayoutError(
            f"service replicas is {p.service.replicas}", path=f"{pp}.service.replicas", fix="use 1 or more"
        )
    if p.service.readiness_path != READY_PATH:
        raise LayoutError(
            f"readiness_path {p.service.readiness_path!r} is not the agent's readiness path: SkyServe's probe sends "
            f"no token, and the agent's serving port answers only {READY_PATH} without one, so the replica would "
            "never be ready and SkyServe would tear it down after initial_delay_s",
            path=f"{pp}.service.readiness_path",
            fix=f'remove readiness_path, or write "{READY_PATH}"',
        )
    return p


def _check_launch(spec: ModelSpec, named: str, mp: str, gpu_memory_bytes: int) -> None:
    """The runtime can serve the model's format, and the model's args do not contradict its plan."""
    why = format_refusal(spec.runtime, spec.source, spec.name)
    if why:
        other = runtime_for(spec.source, spec.url) if spec.source else ""
        if spec.runtime == "vllm" and not spec.source:
            fix = "set source to the model directory or Hugging Face repository id vLLM loads"
        elif other and other != spec.runtime:
            fix = f'use "runtime": "{other}", or a source that {spec.runtime} serves'
        else:
            fix = (
                "set source to the .gguf file llama-server loads"
                if spec.runtime == "llama_server"
                else "set source to a model directory or a Hugging Face repository id"
            )
        path = f"{mp}.runtime" if named and spec.source else f"{mp}.source"
        raise LayoutError(f"model {spec.name!r} cannot run on {spec.runtime}: {why}", path=path, fix=fix)
    if spec.gpu_layers < -1:
        raise LayoutError(
            f"gpu_layers {spec.gpu_layers} is negative",
            path=f"{mp}.gpu_layers",
            fix="use -1 (every layer, the default), 0 (CPU only) or a layer count",
        )
    if spec.gpu_layers >= 0 and spec.runtime != "llama_server":
        raise LayoutError(
            f"gpu_layers is a llama-server setting; model {spec.name!r} runs on {spec.runtime}",
            path=f"{mp}.gpu_layers",
            fix="remove it",
        )
    for adapter, path in spec.adapters.items():
        if spec.runtime not in ("vllm", "llama_server"):
            raise LayoutError(
                f"model {spec.name!r} runs on {spec.runtime}, which Haru does not launch, so it cannot load adapters",
                path=f"{mp}.adapters",
                fix="remove them",
            )
        if not adapter.strip() or not path.strip() or "=" in adapter or " " in adapter:
            raise LayoutError(
                f"adapter {adapter!r} -> {path!r} needs a name without spaces or '=' and a path",
                path=f"{mp}.adapters",
                fix='write "adapters": {"sql-lora": "/srv/loras/sql"}',
            )
    visible = spec.env.get("CUDA_VISIBLE_DEVICES")
    listed = [v.strip() for v in visible.split(",")] if visible is not None else []
    missing = [i for i in model_gpus(spec) if str(i) not in listed]
    if visible is not None and spec.runtime != "external" and missing:
        # The plan's GPUs (the slot's, or a tensor-parallel model's every one) must all be visible.
        raise LayoutError(
            f"env CUDA_VISIBLE_DEVICES={visible!r} does not include the plan's GPU "
            f"{', '.join(map(str, missing))} (the slot's gpu, or the model's gpus)",
            path=f"{mp}.env.CUDA_VISIBLE_DEVICES",
            fix="remove it (the agent pins the runtime to its GPUs), or move the slot to the GPU it names",
        )
    try:
        check_args(spec, gpu_memory_bytes)
    except ArgConflict as exc:
        raise LayoutError(f"model {spec.name!r}: {exc}", path=f"{mp}.args[{exc.index}]", fix=exc.fix) from None
    except BadBinary as exc:
        raise LayoutError(
            f"model {spec.name!r}: {exc}",
            path=f"{mp}.binary",
            fix='name vllm itself ("binary": ["/opt/vllm/bin/vllm"]), or its interpreter with '
            '"-m", "vllm.entrypoints.openai.api_server"; or remove binary (the managed vLLM, '
            "else vllm from PATH)",
        ) from None


def _check_fleet(domains: list[Domain], policy: Policy | None = None) -> None:
    """A fleet has one domain (no failover) or 2..N that mirror each other: every domain declares the
    same model ids as the first, so whichever standby is promoted serves what the active serves.
    `policy.standby_order`, when given, names declared domains, each once."""
    if not domains:
        raise LayoutError(
            "a fleet has at least one failure domain; this layout declares 0",
            path="$.domains",
            fix="declare a domain with its GPUs and models (and more that mirror it, for failover)",
        )
    seen: dict[str, int] = {}
    for i, d in enumerate(domains):
        if d.spec.name in seen:
            raise LayoutError(
                f"domains {seen[d.spec.name]} and {i} are both named {d.spec.name!r}",
                path=f"$.domains[{i}].name",
                fix="give every domain of a fleet its own name",
            )
        seen[d.spec.name] = i
    if policy is not None:
        listed: set[str] = set()
        for i, name in enumerate(policy.standby_order):
            if name not in seen:
                raise LayoutError(
                    f"standby_order names {name!r}, which is not a domain of this fleet",
                    path=f"$.policy.standby_order[{i}]",
                    fix="name declared domains (" + ", ".join(seen) + "), most preferred first",
                )
            if name in listed:
                raise LayoutError(
                    f"standby_order names {name!r} twice",
                    path=f"$.policy.standby_order[{i}]",
                    fix="name each domain once",
                )
            listed.add(name)
    if len(domains) == 1:
        return  # a single-domain fleet (`haru serve`): routed to its one domain, with nothing to fail over to
    first = domains[0]
    mf = [m.name for m in first.models]
    for i, other in enumerate(domains[1:], start=1):
        mo = [m.name for m in other.models]
        if set(mf) == set(mo):
            continue
        only_first = [m for m in mf if m not in set(mo)]
        only_other = [m for m in mo if m not in set(mf)]
        if only_first:
            message = (
                f"domain {other.spec.name!r} does not mirror {', '.join(map(repr, only_first))} "
                f"declared on {first.spec.name!r}"
            )
            path = f"$.domains[{i}].slots"
        else:
            message = (
                f"domain {first.spec.name!r} does not mirror {', '.join(map(repr, only_other))} "
                f"declared on {other.spec.name!r}"
            )
            path = "$.domains[0].slots"
        raise LayoutError(
            message,
            path=path,
            fix="declare the same model ids on every domain: any standby must be able to serve what the active serves",
        )
