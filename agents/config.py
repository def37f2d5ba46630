"""The agent's configuration file, and what this host runs (its slots), resolved from the layout.

    {
      "nats_url": "nats://10.0.0.5:4222",        (a string, comma-separated, or a list)
      "nats_creds": "/etc/haru/agent-a.creds",   (optional)
      "fleet": "default",
      "domain": "a",
      "gpus": "nvml",                            ("nvml" | "sim")
      "sim_dir": "",                             (with "gpus": "sim": the simulated host's directory)
      "serving": {"host": "0.0.0.0", "port": 18601},   (port 0/absent: the domain's serving_url port)
      "layout": "/etc/haru/fleet.json",          (optional: read the slots from this layout file)
      "host": { ...one domain, as a layout declares it... },  (optional: a host not declared yet)
      "policy": { ...policy values... },         (optional, with "host")
      "role": "auto",                            ("auto" | "active" | "standby")
      "state_dir": "/var/lib/haru/agent-a",      (runtime/trainer logs and the child pid file)
      "heartbeat_ms": 1000,
      "auto_training": true,                     (a standby starts its training slots by itself)
      "backlog": 1000,                           (appends kept while the log is away; agents/appender.py)
      "majority_check_ms": 1000                  (how often the agent checks its NATS node has a majority; 0 = off)
    }

Where the slots come from, in order: the `layout` file when given; else the fleet's declarations
(`haru.evt.<fleet>.decl`, written by `haru apply`): the last declaration of this domain, its models
and training slots, and the planner's verdicts; else the `host` entry of this file. Only models (and
training slots) the planner admitted are run. The pure part is `fold_declarations`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from haru.core import planner
from haru.core.apply import fold_declarations as fold_decl
from haru.core.errors import ConfigError, LayoutError
from haru.core.layout import load_layout, parse_layout
from haru.core.sizes import format_gib
from haru.core.specs import Domain, Layout, ModelSpec, Policy, TrainingSpec
from haru.core.subjects import check_name

__all__ = [
    "AgentConfig",
    "ServingConfig",
    "HostSlots",
    "load_config",
    "parse_config",
    "fold_declarations",
    "slots_from_layout",
    "slots_from_host_entry",
]

Role = Literal["auto", "active", "standby"]


class ServingConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 0  # 0: the port of the domain's serving_url; no serving_url either: a free port
    enabled: bool = True


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    fleet: str
    domain: str
    nats_url: str | list[str] = "nats://127.0.0.1:4222"
    nats_creds: str | None = None
    gpus: Literal["nvml", "sim"] = "nvml"
    sim_dir: str = ""
    serving: ServingConfig = ServingConfig()
    layout: str = ""
    host: dict | None = None
    policy: dict | None = None
    role: Role = "auto"
    state_dir: str = ""
    heartbeat_ms: int = 1000
    auto_training: bool = True
    # What the agent keeps of its own appends while the log does not take them (agents/backlog.py), in events.
    backlog: Annotated[int, msgspec.Meta(ge=1)] = 1000
    # How often the agent checks that its NATS node reaches a stream majority (agents/majority.py); 0 = never.
    majority_check_ms: Annotated[int, msgspec.Meta(ge=0)] = 1000
    # Prometheus metrics at http://<metrics_host>:<metrics_port>/metrics (agents/metrics.py); None = off
    # unless --metrics-port / HARU_METRICS_PORT say otherwise, 0 = a free port.
    metrics_port: int | None = None
    metrics_host: str = ""

    def servers(self) -> list[str]:
        urls = self.nats_url if isinstance(self.nats_url, list) else self.nats_url.split(",")
        return [u.strip() for u in urls if u.strip()]

    def state_path(self) -> Path:
        if self.state_dir:
            return Path(os.path.expanduser(self.state_dir))
        base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
        return Path(base) / "haru" / f"agent-{self.fleet}-{self.domain}"


_config_decoder = msgspec.json.Decoder(AgentConfig)


def parse_config(data: bytes | str, *, origin: str = "the agent config") -> AgentConfig:
    try:
        config = _config_decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{origin} is not valid: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{origin} is not valid JSON: {exc}") from None
    try:
        check_name("fleet", config.fleet)
        check_name("domain", config.domain)
    except ValueError as exc:
        raise ConfigError(f"{origin}: {exc}") from None
    if config.gpus == "sim" and not config.sim_dir:
        raise ConfigError(f'{origin}: "gpus": "sim" needs "sim_dir", the simulated host\'s directory')
    if config.heartbeat_ms <= 0:
        raise ConfigError(f"{origin}: heartbeat_ms must be positive (got {config.heartbeat_ms})")
    return config


# Where `haru agent` finds its config when --config is not given, in order: Haru's own name, then the
# supervisor's name from the system Haru grew from (it takes inline JSON or a path, as here).
CONFIG_ENVS = ("HARU_AGENT_CONFIG", "HARU_SUPERVISOR_CONFIG")


def config_from_env(environ: Mapping[str, str] = os.environ) -> str:
    """The agent config named by the environment (inline JSON or a path; '' when none is set)."""
    for name in CONFIG_ENVS:
        value = environ.get(name, "").strip()
        if value:
            return value
    return ""


def is_inline(config: str | os.PathLike[str]) -> bool:
    """Inline JSON (an object), not a path: what `--config` and HARU_AGENT_CONFIG both accept."""
    return isinstance(config, str) and config.lstrip().startswith("{")


def load_config(path: str | os.PathLike[str]) -> AgentConfig:
    """The agent config from a file, or from inline JSON (a string that starts with `{`); a relative
    `layout` is read beside the file (the working directory for inline JSON)."""
    if is_inline(path):
        return parse_config(str(path).encode(), origin="inline agent config")
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"cannot read the agent config {os.fspath(path)!r}: {exc.strerror}; pass --config <file> or inline JSON"
        ) from None
    config = parse_config(data, origin=f"agent config {os.fspath(path)!r}")
    if config.layout and not os.path.isabs(config.layout):
        config = msgspec.structs.replace(config, layout=str(Path(path).parent / config.layout))
    return config


# ----------------------------------------------------------------------------------- host slots


class HostSlots(msgspec.Struct, frozen=True, kw_only=True):
    """What this agent runs: its domain as declared, the planner's verdicts, and the fleet facts it needs."""

    fleet: str
    domain: Domain
    policy: Policy
    admitted_models: list[ModelSpec]
    admitted_training: list[TrainingSpec]
    not_admitted: dict[str, int] = {}  # model or slot -> short_by_bytes
    first_domain: str = ""  # the first declared domain: active until a route_moved says otherwise
    source: str = ""  # layout:<path> | declared | config

    def retire_why(self, name: str) -> str:
        """Why a model this host runs is stopped under these slots: declared but refused by the planner
        (`no longer admitted: short by …`), or gone from the layout."""
        short = self.not_admitted.get(name)
        if short is not None:
            return f"no longer admitted: short by {format_gib(short)} (the layout still declares it)"
        return "the layout no longer has this model"

    def model(self, name: str) -> ModelSpec | None:
        for m in self.admitted_models:
            if m.name == name:
                return m
        return None

    def gpu_indexes(self) -> list[int]:
        seen: list[int] = [g.index for g in self.domain.spec.gpus]
        items: list[ModelSpec | TrainingSpec] = [*self.admitted_models, *self.admitted_training]
        for item in items:
            if item.gpu_index not in seen:
                seen.append(item.gpu_index)
        return seen


def _from_plan(layout_fleet: str, domain: Domain, policy: Policy, first: str, source: str) -> HostSlots:
    dplan = planner.plan_domain(domain, policy)
    admitted_models = {v.name for g in dplan.gpus for v in g.models if v.admitted}
    admitted_training = {v.name for g in dplan.gpus for v in g.training if v.admitted}
    short = {v.name: v.short_by_bytes for v in dplan.verdicts() if not v.admitted}
    return HostSlots(
        fleet=layout_fleet,
        domain=domain,
        policy=policy,
        admitted_models=[m for m in domain.models if m.name in admitted_models],
        admitted_training=[t for t in domain.training if t.slot in admitted_training],
        not_admitted=short,
        first_domain=first,
        source=source,
    )


def slots_from_layout(layout: Layout, domain: str, *, source: str = "layout") -> HostSlots:
    d = layout.domain(domain)
    if d is None:
        names = ", ".join(x.spec.name for x in layout.domains)
        raise ConfigError(
            f'the layout declares no domain {domain!r} (it declares {names}); fix "domain" in the agent config'
        )
    first = layout.domains[0].spec.name if layout.domains else domain
    return _from_plan(layout.fleet, d, layout.policy, first, source)


def slots_from_host_entry(fleet: str, domain: str, host: dict, policy: dict | None) -> HostSlots:
    """The config's own `host` entry (one domain in layout form), validated by the layout parser."""
    entry = dict(host)
    entry.setdefault("name", domain)
    if entry["name"] != domain:
        raise ConfigError(f'the config\'s "host" entry names domain {entry["name"]!r} but "domain" is {domain!r}')
    mirror = dict(entry, name=f"{domain}-mirror" if not domain.endswith("-mirror") else f"{domain}-x")
    doc: dict = {"fleet": fleet, "domains": [entry, mirror]}
    if policy:
        doc["policy"] = policy
    try:
        layout = parse_layout(doc)
    except LayoutError as exc:
        raise ConfigError(f'the config\'s "host" entry: {str(exc).replace("$.domains[0]", "$.host")}') from None
    return slots_from_layout(msgspec.structs.replace(layout, domains=layout.domains[:1]), domain, source="config")


def load_layout_slots(path: str, fleet: str, domain: str) -> HostSlots:
    layout = load_layout(path)
    if layout.fleet != fleet:
        raise ConfigError(f"the layout {path!r} is for fleet {layout.fleet!r}, the agent config says {fleet!r}")
    return slots_from_layout(layout, domain, source=f"layout:{path}")


def fold_declarations(fleet: str, domain: str, events: list[object]) -> HostSlots | None:
    """Fold a fleet's declaration events into this domain's slots. None when the domain is not declared.

    The fold is `haru apply`'s own (`haru.core.apply.fold_declarations`), so the agent and `apply` read the
    decl subject the same way. Admission is what the planner said at apply time (`admission_decided`);
    a model declared without an admitting verdict is not run.
    """
    d = fold_decl(events)  # type: ignore[arg-type]
    spec = d.domains.get(domain)
    if spec is None:
        return None
    dom = Domain(
        spec=spec,
        models=[m for (dn, _), m in d.models.items() if dn == domain],
        training=[t for (dn, _), t in d.training.items() if dn == domain],
    )

    def admitted(kind: str, name: str) -> bool:
        v = d.admissions.get((domain, kind, name))
        return v is not None and v.admitted

    return HostSlots(
        fleet=fleet,
        domain=dom,
        policy=d.policy or Policy(),
        admitted_models=[m for m in dom.models if admitted("model", m.name)],
        admitted_training=[t for t in dom.training if admitted("training", t.slot)],
        not_admitted={
            name: v.short_by_bytes for (dn, _kind, name), v in d.admissions.items() if dn == domain and not v.admitted
        },
        first_domain=next(iter(d.domains), domain),
        source="declared",
    )


class ModelsDiff(msgspec.Struct, frozen=True, kw_only=True):
    """How one host's admitted models change from one layout to the next (by name)."""

    added: list[ModelSpec] = []
    removed: list[str] = []
    changed: list[ModelSpec] = []  # same name, another spec (source, VRAM, context, args, ...): replaced
    unchanged: list[str] = []


def diff_models(old: list[ModelSpec], new: list[ModelSpec]) -> ModelsDiff:
    """Pure: what a live apply does to each model. A model whose spec is equal is untouched."""
    before = {m.name: m for m in old}
    after = {m.name: m for m in new}
    return ModelsDiff(
        added=[m for n, m in after.items() if n not in before],
        removed=[n for n in before if n not in after],
        changed=[m for n, m in after.items() if n in before and before[n] != m],
        unchanged=[n for n, m in after.items() if n in before and before[n] == m],
    )
