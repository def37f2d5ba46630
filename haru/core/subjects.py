"""Every NATS subject, KV key and stream name Haru uses is built here, and only here.

Fleet, domain and slot names are Haru's identifiers: lowercase `[a-z0-9_-]`, 1..64 characters.
Model names are the operator's OpenAI model ids, matched exactly (case and all). Their subject
token is a reversible, readable escape: `[a-z0-9_-]` stay as they are, every other byte of the
UTF-8 id becomes `~xx` (lowercase hex), so `qwen3.6:27b` is `qwen3~2e6~3a27b` and
`Llama` is `~4clama`. No id can put `.`, `*`, `>` or whitespace into a subject, and two ids never
share a token.

    haru.evt.<fleet>.decl                          declarations and admission
    haru.evt.<fleet>.route                         route_moved (the routing pointer)
    haru.evt.<fleet>.op                            promotions and demotions, step by step
    haru.evt.<fleet>.weights                       weights_set: traffic weights and canary rollbacks (promoter)
    haru.evt.<fleet>.checkpoint                    checkpoints: chain heads and the folded view (projector)
    haru.evt.<fleet>.integrity                     log_regressed: the log lost what the promoter was acknowledged
    haru.evt.<fleet>.usage                         tokens_counted: the tokens each gateway served (gateway)
    haru.evt.<fleet>.<domain>.agent                agent started/stopping
    haru.evt.<fleet>.<domain>.liveness             domain unreachable/reachable
    haru.evt.<fleet>.<domain>.model.<model>        residency transitions
    haru.evt.<fleet>.<domain>.gpu.<index>          GPU presence and memory
    haru.evt.<fleet>.<domain>.training.<slot>      training started/stopped
    haru.evt.<fleet>.<domain>.integrity            domain_log_regressed: the log lost what the agent was acknowledged
    haru.hb.<fleet>.<domain>                       heartbeats (core NATS, not history)
    haru.alive.<role>.<id>                         the control plane's own heartbeats (projector, promoter)
    haru.cmd.<fleet>.<domain>.<verb>               commands to an agent (request/reply)
    haru.route.<fleet>                             route intents (stream HARU_ROUTE)
    haru.canary.<fleet>.<gateway>                  a gateway's per-domain request and error counts (core NATS)
    haru.router.<fleet>.<router>                   a router follower's report: the route revision it applied (core NATS)
    haru.routers.ask.<fleet>                       asks a fleet's router followers to report now (`haru status`)

Reading one back is done here too, once: `read(subject)` (memoized) says what an event subject
names (`EventSubject`: its fleet token, its fleet-level kind, the whole `Where` or None), with
`where(subject)` and `fleet_of(subject)` its two common questions, `parse` the strict form that
raises, and `heartbeat_of` for `haru.hb.<fleet>.<domain>`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from haru.core.errors import InvalidName

EVENTS_STREAM = "HARU_EVENTS"
ROUTE_STREAM = "HARU_ROUTE"
VIEWS_BUCKET = "haru_views"
ADAPTERS_BUCKET = "haru_adapters"  # JetStream object store: published LoRA adapters, one object each
CHECKPOINTS_BUCKET = (
    "haru_checkpoints"  # JetStream object store: each training slot's newest checkpoint, per fleet/slot
)

EVT = "haru.evt"
ALL_EVENTS = "haru.evt.>"
ALL_INTENTS = "haru.route.>"

NAME_MAX = 64
MODEL_ID_MAX = 256
_NAME = re.compile(r"[a-z0-9_-]+")
_SAFE = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789_-")

# Reserved words in the fourth token of a domain subject: a domain may not be called these.
_FLEET_LEVEL = frozenset({"decl", "route", "op", "checkpoint", "weights", "integrity", "usage"})


def check_name(kind: str, value: str) -> str:
    """Validate a fleet, domain or slot name; return it. Raises InvalidName saying which and why."""
    if not isinstance(value, str) or not value:
        raise InvalidName(f"{kind} name is empty; use lowercase letters, digits, '_' or '-'")
    if len(value) > NAME_MAX:
        raise InvalidName(f"{kind} name {value!r} is {len(value)} characters; the limit is {NAME_MAX}")
    if not _NAME.fullmatch(value):
        bad = sorted({c for c in value if not _NAME.fullmatch(c)})
        hint = value.lower() if value.lower() != value and _NAME.fullmatch(value.lower()) else None
        fix = f"; did you mean {hint!r}?" if hint else "; use only lowercase letters, digits, '_' and '-'"
        raise InvalidName(f"{kind} name {value!r} has characters Haru names cannot hold: {''.join(bad)!r}{fix}")
    if kind == "domain" and value in _FLEET_LEVEL:
        raise InvalidName(f"domain name {value!r} is reserved (it names a fleet-level subject); choose another")
    return value


def check_model_id(model: str) -> str:
    """A model id may be anything a client sends, except empty, whitespace-bearing or over-long."""
    if not isinstance(model, str) or not model:
        raise InvalidName("model id is empty; use the OpenAI model id clients send, e.g. 'qwen3.6:27b'")
    if any(c.isspace() for c in model):
        raise InvalidName(f"model id {model!r} contains whitespace; clients cannot send it reliably, remove it")
    if len(model.encode()) > MODEL_ID_MAX:
        raise InvalidName(f"model id {model[:40]!r}... is over {MODEL_ID_MAX} bytes; shorten it")
    return model


def model_token(model: str) -> str:
    """The subject token of a model id: a reversible, readable escape."""
    check_model_id(model)
    out: list[str] = []
    for b in model.encode():
        out.append(chr(b) if b in _SAFE else f"~{b:02x}")
    return "".join(out)


def model_from_token(token: str) -> str:
    """The inverse of `model_token`."""
    raw = bytearray()
    i = 0
    while i < len(token):
        c = token[i]
        if c == "~":
            try:
                raw.append(int(token[i + 1 : i + 3], 16))
            except ValueError as exc:
                raise InvalidName(f"bad escape in model token {token!r} at {i}") from exc
            i += 3
        else:
            raw.append(ord(c))
            i += 1
    return raw.decode()


# ------------------------------------------------------------------------------------ event subjects


def decl(fleet: str) -> str:
    return f"{EVT}.{check_name('fleet', fleet)}.decl"


def route(fleet: str) -> str:
    return f"{EVT}.{check_name('fleet', fleet)}.route"


def op(fleet: str) -> str:
    return f"{EVT}.{check_name('fleet', fleet)}.op"


def weights(fleet: str) -> str:
    return f"{EVT}.{check_name('fleet', fleet)}.weights"


def usage(fleet: str) -> str:
    return f"{EVT}.{check_name('fleet', fleet)}.usage"


def checkpoint(fleet: str) -> str:
    return f"{EVT}.{check_name('fleet', fleet)}.checkpoint"


ALL_CHECKPOINTS = "haru.evt.*.checkpoint"


def integrity(fleet: str) -> str:
    """Where the promoter records that the log lost events it was acknowledged on the fleet's subjects."""
    return f"{EVT}.{check_name('fleet', fleet)}.integrity"


def _domain(fleet: str, domain: str) -> str:
    return f"{EVT}.{check_name('fleet', fleet)}.{check_name('domain', domain)}"


def agent(fleet: str, domain: str) -> str:
    return f"{_domain(fleet, domain)}.agent"


def liveness(fleet: str, domain: str) -> str:
    return f"{_domain(fleet, domain)}.liveness"


def domain_integrity(fleet: str, domain: str) -> str:
    """Where a domain's agent records that the log lost events it was acknowledged on its own subjects
    (subject kind `domain_integrity`: the fleet-level `integrity` is the promoter's)."""
    return f"{_domain(fleet, domain)}.integrity"


def model(fleet: str, domain: str, model_id: str) -> str:
    return f"{_domain(fleet, domain)}.model.{model_token(model_id)}"


def gpu(fleet: str, domain: str, index: int) -> str:
    if not isinstance(index, int) or index < 0:
        raise InvalidName(f"GPU index {index!r} must be a non-negative integer")
    return f"{_domain(fleet, domain)}.gpu.{index}"


def training(fleet: str, domain: str, slot: str) -> str:
    return f"{_domain(fleet, domain)}.training.{check_name('slot', slot)}"


# ------------------------------------------------------------------------------------------ filters


def fleet_events(fleet: str) -> str:
    return f"{EVT}.{check_name('fleet', fleet)}.>"


def model_events(fleet: str, model_id: str, domain: str = "*") -> str:
    d = "*" if domain == "*" else check_name("domain", domain)
    return f"{EVT}.{check_name('fleet', fleet)}.{d}.model.{model_token(model_id)}"


# --------------------------------------------------------------------- heartbeats, commands, intents


def heartbeat(fleet: str, domain: str) -> str:
    return f"haru.hb.{check_name('fleet', fleet)}.{check_name('domain', domain)}"


def heartbeats(fleet: str = "*") -> str:
    f = "*" if fleet == "*" else check_name("fleet", fleet)
    return f"haru.hb.{f}.*"


def heartbeat_of(subject: str) -> tuple[str, str] | None:
    """(fleet, domain) of a heartbeat subject `haru.hb.<fleet>.<domain>`; None for anything else."""
    parts = subject.split(".")
    if len(parts) != 4 or parts[0] != "haru" or parts[1] != "hb":
        return None
    return parts[2], parts[3]


CONTROL_ROLES = ("projector", "promoter")
ALL_ALIVE = "haru.alive.>"


def alive(role: str, identity: str = "*") -> str:
    """A control-plane replica's heartbeat subject; its writer id escaped like a model id."""
    if role not in CONTROL_ROLES:
        raise InvalidName(f"unknown control-plane role {role!r}; one of {', '.join(CONTROL_ROLES)}")
    return f"haru.alive.{role}.{'*' if identity == '*' else model_token(identity)}"


def alive_of(subject: str) -> tuple[str, str] | None:
    """(role, id) of a control-plane heartbeat subject `haru.alive.<role>.<token>`; None for anything else."""
    parts = subject.split(".")
    if len(parts) != 4 or parts[:2] != ["haru", "alive"] or parts[2] not in CONTROL_ROLES:
        return None
    try:
        return parts[2], model_from_token(parts[3])
    except (InvalidName, UnicodeDecodeError):
        return None


COMMAND_VERBS = ("status", "sleep", "wake", "probe", "stop_training", "start_training", "verify_gpu", "apply_layout")


def command(fleet: str, domain: str, verb: str) -> str:
    if verb not in COMMAND_VERBS:
        raise InvalidName(f"unknown command verb {verb!r}; one of {', '.join(COMMAND_VERBS)}")
    return f"haru.cmd.{check_name('fleet', fleet)}.{check_name('domain', domain)}.{verb}"


def commands(fleet: str, domain: str) -> str:
    return f"haru.cmd.{check_name('fleet', fleet)}.{check_name('domain', domain)}"


def intent(fleet: str) -> str:
    return f"haru.route.{check_name('fleet', fleet)}"


ALL_CANARY_REPORTS = "haru.canary.*.*"


def canary_report(fleet: str, gateway: str) -> str:
    """Where a gateway reports what it measured of a fleet's weighted domains; its id escaped like a model id."""
    return f"haru.canary.{check_name('fleet', fleet)}.{model_token(gateway)}"


def canary_report_of(subject: str) -> tuple[str, str] | None:
    """(fleet, gateway) of `haru.canary.<fleet>.<gateway>`; None for anything else."""
    parts = subject.split(".")
    if len(parts) != 4 or parts[0] != "haru" or parts[1] != "canary":
        return None
    try:
        return check_name("fleet", parts[2]), model_from_token(parts[3])
    except (InvalidName, UnicodeDecodeError):
        return None


def view_key(fleet: str) -> str:
    return f"fleet.{check_name('fleet', fleet)}"


# -------------------------------------------------------------------------------------------- parse


@dataclass(frozen=True, slots=True)
class Where:
    """What an event subject addresses. `kind` is decl|route|op|weights|checkpoint|integrity|agent|liveness|
    model|gpu|training|domain_integrity (`haru.evt.<fleet>.<domain>.integrity`)."""

    fleet: str
    kind: str
    domain: str = ""
    model: str = ""
    gpu_index: int = -1
    slot: str = ""


def parse(subject: str) -> Where:
    """Parse an event subject back into its parts. Raises InvalidName for anything else."""
    parts = subject.split(".")
    if len(parts) < 4 or parts[0] != "haru" or parts[1] != "evt":
        raise InvalidName(f"{subject!r} is not a Haru event subject (haru.evt.<fleet>...)")
    fleet = parts[2]
    if len(parts) == 4 and parts[3] in _FLEET_LEVEL:
        return Where(fleet=fleet, kind=parts[3])
    domain = parts[3]
    if len(parts) == 5 and parts[4] in ("agent", "liveness"):
        return Where(fleet=fleet, kind=parts[4], domain=domain)
    if len(parts) == 5 and parts[4] == "integrity":
        return Where(fleet=fleet, kind="domain_integrity", domain=domain)
    if len(parts) == 6:
        kind, token = parts[4], parts[5]
        if kind == "model":
            return Where(fleet=fleet, kind="model", domain=domain, model=model_from_token(token))
        if kind == "gpu" and token.isdigit():
            return Where(fleet=fleet, kind="gpu", domain=domain, gpu_index=int(token))
        if kind == "training":
            return Where(fleet=fleet, kind="training", domain=domain, slot=token)
    raise InvalidName(f"{subject!r} is not a Haru event subject")


class EventSubject(NamedTuple):
    """What an event subject names, read once (`read`)."""

    fleet: str  # the <fleet> token of haru.evt.<fleet>.<...>, whether or not the rest is well formed
    level: str  # the kind of a fleet-level subject (its fourth and last token: decl, route, op, checkpoint), else ''
    where: Where | None  # the whole subject parsed; None when it is not a Haru event subject
    problem: str = ""  # why `where` is None


def _read(subject: str) -> EventSubject:
    parts = subject.split(".", 4)
    fleet, level = "", ""
    if len(parts) >= 4 and parts[0] == "haru" and parts[1] == "evt":
        fleet, level = parts[2], parts[3] if len(parts) == 4 else ""
    try:
        return EventSubject(fleet, level, parse(subject))
    except (InvalidName, UnicodeDecodeError) as exc:
        return EventSubject(fleet, level, None, str(exc))


class _Memo(dict[str, EventSubject]):
    """The memo of `read`: a replay meets the same few thousand subjects over and over. A hit is the
    dict's own lookup (no Python call); a miss reads the subject. Bounded: cleared at _READ_MAX."""

    def __missing__(self, subject: str) -> EventSubject:
        if len(self) >= _READ_MAX:
            self.clear()
        got = self[subject] = _read(subject)
        return got


_READ_MAX = 100_000
_READ = _Memo()

read: Callable[[str], EventSubject] = _READ.__getitem__
"""What an event subject names (an empty `fleet` and no `where` for any other subject). Memoized."""


def where(subject: str) -> Where | None:
    """What an event subject addresses (None when it is not a Haru event subject). Memoized."""
    return read(subject).where


def fleet_of(subject: str) -> str:
    """The fleet of an event subject `haru.evt.<fleet>.<...>` ('' for any other subject). Memoized."""
    return read(subject).fleet


ALL_ROUTER_REPORTS = "haru.router.*.*"


def router_report(fleet: str, router: str = "*") -> str:
    """A route follower's report subject (`haru route follow`): the router's name is a Haru identifier."""
    return f"haru.router.{check_name('fleet', fleet)}.{'*' if router == '*' else check_name('router', router)}"


def router_report_of(subject: str) -> tuple[str, str] | None:
    """(fleet, router) of `haru.router.<fleet>.<router>`; None for anything else."""
    parts = subject.split(".")
    if len(parts) != 4 or parts[0] != "haru" or parts[1] != "router":
        return None
    return parts[2], parts[3]


def routers_ask(fleet: str) -> str:
    """Where `haru status` asks a fleet's route followers to report at once, rather than at their next interval."""
    return f"haru.routers.ask.{check_name('fleet', fleet)}"
