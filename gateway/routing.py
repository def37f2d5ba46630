"""The gateway's in-memory routing table and the answer for one request. Pure: no I/O, no clock.

`gateway.state` keeps a `RoutingTable` current from the KV watch (FleetViews) and the route-intent
subscription (RouteIntents). Every update compiles the fleet's routes once (`compile_routes`), so a
chat request costs two dict look-ups: `table.resolve(fleet, model, now)` returns either

    Forward(url, fleet, domain, model, revision)   proxy the body to `url + request path`
    Refusal(status, code, message, retry_after)    answer with OpenAI's error shape

The router answers (one per model on the active domain, computed by the projector into the route
intent) map to HTTP exactly as docs/design.md's "What a client is told" table says; `ANSWER_STATUS` (in
`haru.core.openai_errors`, shared with the agent's serving port) is that table, and the tests and docs/gateway.md
read the same one:

    ready              proxied
    warming{for_ms}    503 model_warming       + Retry-After
    asleep             503 model_asleep        + Retry-After
    lost{gpu_detached} 503 gpu_detached        + Retry-After (the provider's doing, not the operator's)
    lost{other}        503 model_lost          + Retry-After (with the reason, in words)
    not_admitted       409 model_not_admitted  (with short_by; never retryable)
    unknown            503 residency_unknown
    no such fleet      404 fleet_not_found
    no such model      404 model_not_found
    no active domain   503 no_active_domain

The route intent is the authority for routing (active target, answers, revision); the FleetView
adds what the intent does not carry: every model declared on every domain, so that a model that
exists only on the standby is told apart from one that does not exist at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final

import msgspec

from haru.core.openai_errors import (
    ANSWER_STATUS,
    FLEET_NOT_FOUND,
    INVALID_REQUEST,
    MODEL_NOT_FOUND,
    NO_ACTIVE_DOMAIN,
    NOT_RETRYABLE,
    UPSTREAM_UNREACHABLE,
    BadBody,
    error_body,
)
from haru.core.openai_errors import model_of as read_model
from haru.core.residency import Answer
from haru.core.sizes import format_gib
from haru.core.specs import as_uuid, fleet_uuid
from haru.core.views import FleetView, RouteIntent, Target
from haru.gateway.adapters import ADAPTER_RETRY_S, AdapterRoute
from haru.gateway.split import Split, apply_splits, carry_rotation

# The status table (`ANSWER_STATUS`) and OpenAI's error shape are `haru.core.openai_errors`, shared with
# the agent's serving port.

# Retry-After bounds (seconds). Warming: a quarter of how long it has been warming, so a level-1
# wake (0.1-6 s) is retried within a second or two and a cold load (20-100 s) is not hammered.
RETRY_MIN_S: Final = 1
RETRY_MAX_S: Final = 30
ASLEEP_RETRY_S: Final = 5
# Lost: it comes back by a failover (a standby's wake and probe: seconds) or a reload in place (the restart
# backoff and a warm-up: seconds to a minute); a client told when to come back neither hammers nor gives up.
LOST_RETRY_S: Final = 10
# What each loss means, in words an operator acts on (hearth's): the reason is the one bit of diagnosis.
LOST_MEANS: Final = {
    "evicted": "evicted: its runtime no longer holds it while the GPU is still there, so this box is "
    "over-committed (something else took the VRAM)",
    "process_exited": "process_exited: its runtime process is gone",
    "unhealthy": "unhealthy: its runtime is up but did not answer the probe",
}


# ------------------------------------------------------------------------------------- outcomes


class Forward(msgspec.Struct, frozen=True):
    """Proxy the request to `url` + the request's path (`url` has no trailing `/` and no `/v1`)."""

    url: str
    fleet: str
    domain: str
    model: str
    revision: int
    body_model: str = ""  # a LoRA adapter's version (gateway.adapters): the `model` the runtime is sent


class Refusal(msgspec.Struct, frozen=True):
    """Answer with this error instead of proxying. `retry_after` is whole seconds (None = no header)."""

    status: int
    code: str
    message: str
    retry_after: int | None = None
    param: str | None = None
    domain: str = ""

    @property
    def retryable(self) -> bool:
        return self.status not in NOT_RETRYABLE

    def body(self) -> bytes:
        return error_body(self.status, self.code, self.message, self.param)


class _Warming(msgspec.Struct, frozen=True):
    """A warming model: the Retry-After and the elapsed time depend on `now`, so they are made late."""

    fleet: str
    domain: str
    model: str
    since: float  # epoch seconds (0 = unknown)
    for_ms: int  # as of the intent
    reason: str

    def at(self, now: float) -> Refusal:
        for_ms = max(self.for_ms, int((now - self.since) * 1000)) if self.since else self.for_ms
        retry = retry_after_warming(for_ms)
        what = f" ({self.reason})" if self.reason else ""
        status, code = ANSWER_STATUS["warming"]
        return Refusal(
            status,
            code,
            f"model {self.model!r} is warming on domain {self.domain!r}{what} for {for_ms / 1000:.1f} s; "
            f"it is not ready yet, retry in {retry} s",
            retry,
            "model",
            self.domain,
        )


def retry_after_warming(for_ms: int) -> int:
    """Seconds to wait before retrying a warming model: a quarter of its warm-up so far, 1..30."""
    return max(RETRY_MIN_S, min(RETRY_MAX_S, math.ceil(for_ms / 4000)))


def refusal_for(fleet: str, domain: str, model: str, answer: Answer, operation: str = "") -> Refusal | _Warming | None:
    """The refusal a router answer asks for (None for `ready`). Reads ANSWER_STATUS."""
    kind = answer.answer
    if kind == "ready":
        return None
    if kind == "warming":
        since = answer.since.timestamp() if answer.since is not None else 0.0
        return _Warming(fleet, domain, model, since, answer.for_ms, answer.reason)
    where = f"model {model!r} on domain {domain!r}"
    if kind == "asleep":
        status, code = ANSWER_STATUS["asleep"]
        doing = f"operation {operation} is in progress; " if operation else ""
        return Refusal(
            status,
            code,
            f"{where} is asleep (vLLM level-1 sleep, weights in CPU RAM); {doing}retry in {ASLEEP_RETRY_S} s",
            ASLEEP_RETRY_S,
            "model",
            domain,
        )
    if kind == "lost":
        reason = LOST_MEANS.get(answer.reason, answer.reason or "unknown reason")
        if answer.detail:
            reason = f"{reason} ({answer.detail})"
        if answer.reason == "gpu_detached":
            status, code = ANSWER_STATUS["lost:gpu_detached"]
            return Refusal(
                status,
                code,
                f"{where} is lost: its GPU was detached by the provider (reclaimed or failed); "
                f"this is not the operator's doing. Haru fails over to the standby when auto-failover is on; "
                f"retry in {LOST_RETRY_S} s",
                LOST_RETRY_S,
                "model",
                domain,
            )
        status, code = ANSWER_STATUS["lost"]
        return Refusal(
            status, code, f"{where} is lost: {reason}; retry in {LOST_RETRY_S} s", LOST_RETRY_S, "model", domain
        )
    if kind == "not_admitted":
        status, code = ANSWER_STATUS["not_admitted"]
        short = answer.short_by_bytes
        by = f"short by {format_gib(short)} ({short} bytes)" if short else "short of VRAM"
        return Refusal(
            status,
            code,
            f"{where} is not admitted: the GPU is {by}; it will never fit there, do not retry "
            f"(change the layout: a bigger GPU, a smaller model, or fewer models on that GPU)",
            None,
            "model",
            domain,
        )
    status, code = ANSWER_STATUS["unknown"]
    said = f" ({answer.reason})" if answer.reason else ""
    return Refusal(
        status,
        code,
        f"residency of {where} is unknown{said}: it has not been probed yet, so Haru does not route to it",
        None,
        "model",
        domain,
    )


# ----------------------------------------------------------------------------- the request body


def model_of(body: bytes) -> str | Refusal:
    """`model` from a JSON body, or the 400 that names what is wrong and where (haru.core.openai_errors)."""
    got = read_model(body)
    if isinstance(got, BadBody):
        status, code = INVALID_REQUEST
        return Refusal(status, code, got.message, None, got.param)
    return got


# ------------------------------------------------------------------------------ compiled routes


def base_url(url: str) -> str:
    """`http://h:p/`, `http://h:p/v1` and `http://h:p` all become `http://h:p` (the path is appended)."""
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    return url


class FleetRoutes(msgspec.Struct, frozen=True):
    """One fleet's routes, compiled from its latest view and route intent."""

    fleet: str
    view: FleetView | None
    intent: RouteIntent | None
    intent_seq: int
    revision: int
    active: str
    entries: dict[str, Forward | Refusal | _Warming | Split[Forward] | AdapterRoute]  # one per model known to the fleet
    declared: dict[str, list[str]]  # model -> domains it is declared on (view order)

    def resolve(self, model: str, now: float) -> Forward | Refusal:
        entry = self.entries.get(model)
        if entry is None:
            return self._missing(model)
        if isinstance(entry, _Warming):
            return entry.at(now)
        if isinstance(entry, Split):  # traffic weights (gateway.split): the next domain in the split's order
            return entry.pick()
        if isinstance(entry, AdapterRoute):  # a LoRA adapter: where its base model goes, as one of its versions
            return self._adapter(entry, now)
        return entry

    def _adapter(self, entry: AdapterRoute, now: float) -> Forward | Refusal:
        base = self.resolve(entry.av.model, now)
        if not isinstance(base, Forward):
            return base
        name, why = entry.version_for(base.domain)
        if not name:
            f = AdapterRoute.refusal_fields(why, base.domain)
            return Refusal(f["status"], f["code"], f["message"], ADAPTER_RETRY_S, "model", base.domain)
        return Forward(base.url, base.fleet, base.domain, entry.av.served, base.revision, name)

    def _missing(self, model: str) -> Refusal:
        if not self.active and (self.view is None or not self.declared):
            return _no_active(self.fleet, self.view, self.intent)
        status, code = MODEL_NOT_FOUND
        known = list(self.declared) or list(self.entries)
        listed = ", ".join(repr(m) for m in known[:20]) + (", ..." if len(known) > 20 else "")
        return Refusal(
            status,
            code,
            f"model {model!r} is not declared in fleet {self.fleet!r}"
            + (f"; it serves {listed}" if known else "; it declares no models")
            + " (model ids are matched exactly)",
            None,
            "model",
        )


def _no_active(fleet: str, view: FleetView | None, intent: RouteIntent | None) -> Refusal:
    status, code = NO_ACTIVE_DOMAIN
    if intent is None and view is not None and view.active:
        status, code = ANSWER_STATUS["unknown"]
        return Refusal(
            status,
            code,
            f"fleet {fleet!r} has no route intent yet (active domain {view.active!r}); is the projector running?",
            None,
            "model",
            view.active,
        )
    return Refusal(
        status,
        code,
        f"fleet {fleet!r} has no active domain: nothing has been promoted yet "
        f"(POST /v1/fleets/{fleet}/promote, or `haru promote`)",
    )


def _target_url(target: Target, model: str) -> str:
    if target.serve == "direct":
        return target.model_urls.get(model, "")
    return target.serving_url


def compile_routes(fleet: str, view: FleetView | None, intent: RouteIntent | None, intent_seq: int = 0) -> FleetRoutes:
    """Every model's outcome for one fleet, computed once per update."""
    declared: dict[str, list[str]] = {}
    if view is not None:
        active_name = intent.active.domain if intent is not None and intent.active is not None else view.active
        order = sorted(view.domains, key=lambda d: d != active_name)  # the active domain's models first
        for dname in order:
            for mname in view.domains[dname].models:
                declared.setdefault(mname, []).append(dname)

    entries: dict[str, Forward | Refusal | _Warming | Split[Forward] | AdapterRoute] = {}
    target = intent.active if intent is not None else None
    revision = intent.revision if intent is not None else (view.route_revision if view is not None else 0)
    active = target.domain if target is not None else ""

    if target is None or intent is None:  # (no intent: no target)
        refusal = _no_active(fleet, view, intent)
        for mname in declared:
            entries[mname] = refusal
    else:
        for mname, answer in intent.answers.items():
            refused = refusal_for(fleet, active, mname, answer, intent.operation)
            if refused is not None:
                entries[mname] = refused
                continue
            url = _target_url(target, mname)
            if not url:
                status, code = UPSTREAM_UNREACHABLE
                what = (
                    f"the route intent has no URL for model {mname!r} on `serve: direct` domain {active!r}"
                    if target.serve == "direct"
                    else f"active domain {active!r} has no serving URL (has its agent started?)"
                )
                entries[mname] = Refusal(status, code, what, None, "model", active)
                continue
            entries[mname] = Forward(base_url(url), fleet, active, mname, revision)
        for mname, domains in declared.items():
            if mname in entries:
                continue
            if active in domains:  # declared on the active domain, but the intent has no answer yet
                status, code = ANSWER_STATUS["unknown"]
                entries[mname] = Refusal(
                    status,
                    code,
                    f"residency of model {mname!r} on domain {active!r} is unknown: "
                    f"the route intent has no answer for it yet",
                    None,
                    "model",
                    active,
                )
            else:
                status, code = MODEL_NOT_FOUND
                entries[mname] = Refusal(
                    status,
                    code,
                    f"model {mname!r} is declared in fleet {fleet!r} only on domain "
                    f"{', '.join(repr(d) for d in domains)}, not on the active domain {active!r}",
                    None,
                    "model",
                    active,
                )
    # Traffic weights: a model whose split gives other domains a share (gateway.split).
    entries = apply_splits(  # type: ignore[assignment]
        intent,
        entries,  # type: ignore[arg-type]
        lambda e: type(e) is Forward,
        lambda url, domain, model: Forward(base_url(url), fleet, domain, model, revision),
    )
    if view is not None:
        # A LoRA adapter is served by its model's runtime under its own name: it routes as its model does
        # (on the active domain; a name that is also a model's stays the model's).
        for dname in order:
            for mname, mv in view.domains[dname].models.items():
                for adapter in mv.adapters:
                    if adapter not in declared and mname in entries:
                        entries[adapter] = entries[mname]
                        declared[adapter] = declared[mname]
        # LoRA adapters loaded at run time (gateway.adapters): `<base>:<adapter>`, routed as its base model
        for served, av in view.adapters.items():
            if served not in declared and av.model in entries:
                entries[served] = AdapterRoute(av)
                declared[served] = declared[av.model]
    return FleetRoutes(fleet, view, intent, intent_seq, revision, active, entries, declared)


# ------------------------------------------------------------------------------------- the table


class RoutingTable:
    """The gateway's routes for every fleet it has seen. Updated by the watchers, read per request.

    Updates replace a fleet's compiled routes in one assignment, so a reader never sees half an
    update, and a pointer move applies to the very next `resolve`.
    """

    def __init__(self) -> None:
        self._fleets: dict[str, FleetRoutes] = {}
        # called with (old, new) after each fleet's routes are replaced (gateway/stranded.py listens)
        self.listeners: list[Callable[[FleetRoutes | None, FleetRoutes], None]] = []

    def resolve(self, fleet: str, model: str, now: float) -> Forward | Refusal:
        routes = self._fleets.get(fleet)
        if routes is None:
            return fleet_not_found(fleet, list(self._fleets))
        return routes.resolve(model, now)

    def fleet_named(self, ident: str) -> str:
        """The fleet a path or header names by its UUID (declared in its layout, or derived from its
        name: `haru.core.specs.fleet_uuid`), as Haru's API took "slug or UUID"; '' when no fleet known
        here has that UUID. Callers look a name up first (`get`): this runs only for what is no known name."""
        wanted = as_uuid(ident)
        if not wanted:
            return ""
        for f, r in self._fleets.items():
            if (r.view is not None and r.view.uuid == wanted) or fleet_uuid(f) == wanted:
                return f
        return ""

    def get(self, fleet: str) -> FleetRoutes | None:
        return self._fleets.get(fleet)

    def fleets(self) -> list[str]:
        return sorted(self._fleets)

    def set_view(self, fleet: str, view: FleetView | None, *, rewound: bool = False) -> bool:
        """Apply a view (None: the key was deleted). Returns False when it was older than the one held,
        unless `rewound` (the log went back behind the one held: that one is what it forgot)."""
        old = self._fleets.get(fleet)
        if not rewound and view is not None and old is not None and old.view is not None and view.seq < old.view.seq:
            return False
        intent = old.intent if old is not None else None
        seq = old.intent_seq if old is not None else 0
        self._store(fleet, view, intent, seq)
        return True

    def set_intent(self, fleet: str, intent: RouteIntent | None, seq: int = 0, *, rewound: bool = False) -> bool:
        """Apply a route intent published at stream sequence `seq`. Older ones are ignored, unless `rewound`
        (the intents' stream went back behind the one held: never route by a pointer the log forgot)."""
        old = self._fleets.get(fleet)
        if not rewound and old is not None and old.intent is not None and seq and seq < old.intent_seq:
            return False
        view = old.view if old is not None else None
        self._store(fleet, view, intent, seq)
        return True

    def _store(self, fleet: str, view: FleetView | None, intent: RouteIntent | None, seq: int) -> None:
        if view is None and intent is None:
            self._fleets.pop(fleet, None)
        else:
            routes = compile_routes(fleet, view, intent, seq)
            old = self._fleets.get(fleet)
            if old is not None:
                carry_rotation(old.entries, routes.entries)  # type: ignore[arg-type]
            self._fleets[fleet] = routes
            for listener in self.listeners:
                listener(old, routes)


def fleet_not_found(fleet: str, known: list[str]) -> Refusal:
    status, code = FLEET_NOT_FOUND
    names = ", ".join(repr(f) for f in sorted(known)[:20])
    return Refusal(
        status,
        code,
        f"no fleet named {fleet!r} (choose one with the X-Haru-Fleet header or HARU_DEFAULT_FLEET"
        + (f"; known fleets: {names})" if names else "; no fleet has been applied yet: `haru apply`)"),
        None,
        None,
    )
