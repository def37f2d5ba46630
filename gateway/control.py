"""The control API: fleet views, route intents, promote/demote, history, residency, models, health.

    GET  /healthz[?strict=1]                    ok or degraded, naming what is down (no auth); strict: 503 when degraded
    GET  /metrics                               Prometheus text
    GET  /residency[?fleet=]                    the whole truth table
    GET  /v1/models                             the fleet's models with their router answers
    GET  /v1/fleets                             fleets the gateway knows, with active and revision
    GET  /v1/fleets/{fleet}                     the FleetView (as stored in KV haru_views)
    GET  /v1/fleets/{fleet}/route-intent        the last RouteIntent (as published on haru.route.<fleet>)
    POST /v1/fleets/{fleet}/reconcile           what the continuous promoter has decided (runs nothing)
    POST /v1/fleets/{fleet}/promote             {"domain": "<name>"}  (or Haru's "targetDomainId")
    POST /v1/fleets/{fleet}/demote              {"domain": "<name>"}
    POST /v1/fleets/{fleet}/weights             {"weights": {"b": 10}, "model": ""} or {"reset": true}
                                                (gateway.weights_api)
    POST /v1/fleets/{fleet}/provision           {"domain": "<name>", "dry_run": false}  (skypilot/skyserve domains)
    POST /v1/fleets/{fleet}/teardown            {"domain": "<name>", "dry_run": false}
    POST /v1/fleets/{fleet}/replace             {"domain": "<name>", "dry_run": false}
                                                dry_run: 200 {"submit": <the YAML / sky commands>}, nothing requested
    GET  /v1/fleets/{fleet}/history?model=&domain=&limit=   events, newest first

Views and intents are read fresh from NATS here (the control API is not the hot path); when NATS is
away they come from the gateway's in-memory copy, marked with `X-Haru-Stale: true`.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TypeVar

import msgspec
import structlog
from aiohttp import web

from haru.core import subjects
from haru.core.authority import misplaced
from haru.core.errors import HaruError, InvalidName, LogDamaged, LogError, LogUnavailable
from haru.core.events import payload, tag_of
from haru.core.openai_errors import TOO_DEEP
from haru.core.specs import fleet_uuid
from haru.core.views import view_encoder
from haru.gateway.errors import ApiError
from haru.gateway.metrics import GatewayMetrics
from haru.gateway.routing import RoutingTable, fleet_not_found
from haru.gateway.truth import models_list, truth_table
from haru.host import alive
from haru.host.httpguard import continue_if_expected
from haru.log.requests import request_operation

log = structlog.get_logger("haru.gateway")

HISTORY_DEFAULT_LIMIT = 100
HISTORY_MAX_LIMIT = 10_000

_json = msgspec.json.Encoder()

# request_operation's status -> HTTP status (Haru's semantics: 200 no-op, 202 accepted or joined,
# 409 conflicting, 409 refused (demoting the active), 404 no such fleet or domain)
OPERATION_STATUS: dict[str, int] = {
    "noop": 200,
    "accepted": 202,
    "joined": 202,
    "conflict": 409,
    "refused": 409,
    "not_found": 404,
}


T = TypeVar("T")


class _OperationBody(msgspec.Struct, forbid_unknown_fields=False):
    domain: str | None = None
    targetDomainId: str | None = None  # noqa: N815 - Haru's own field name, accepted for compatibility
    dry_run: bool = False  # provision/teardown/replace: answer with what would be submitted, request nothing


_decode_operation = msgspec.json.Decoder(_OperationBody).decode


def json_response(value: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=_json.encode(value), status=status, content_type="application/json", headers=headers)


async def requested(call: Awaitable[T], *, invalid: str) -> T:
    """An operation request's result, the log's failures answered as API errors (503 when the log is away,
    400 `invalid` when the request itself is wrong)."""
    try:
        return await call
    except LogUnavailable as exc:
        raise ApiError(503, "log_unavailable", f"the event log is unreachable: {exc}") from None
    except LogError as exc:
        raise ApiError(503, "log_error", str(exc)) from None
    except HaruError as exc:
        raise ApiError(400, invalid, str(exc)) from None


async def request_body(
    request: web.BaseRequest, decode: Callable[[bytes], T], empty: T, *, hint: str = "", param: str | None = None
) -> T:
    """A write's JSON body (`empty` when there is none), read after answering `Expect: 100-continue`;
    a body that does not decode is a 400 naming what was wrong (`hint`: what a valid one looks like)."""
    await continue_if_expected(request)
    raw = await request.read()
    try:
        return decode(raw) if raw.strip() else empty
    except msgspec.ValidationError as exc:
        raise ApiError(400, "invalid_request", f"invalid request body: {exc}{hint}", param=param) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, "invalid_request", f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "invalid_request", TOO_DEEP) from None


def raw_json(data: bytes, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=data, content_type="application/json", headers=headers)


def check_fleet(fleet: str) -> str:
    try:
        return subjects.check_name("fleet", fleet)
    except InvalidName as exc:
        raise ApiError(400, "invalid_request", str(exc), param="fleet") from None


def _op_summary(op) -> dict | None:
    if op is None:
        return None
    return {
        "op_id": op.op_id,
        "kind": op.kind,
        "target": op.target,
        "source": op.source,
        "reason": op.reason,
        "state": op.state,
        "error": op.error,
        "steps": [{"step": s.step, "state": s.state, "detail": s.detail, "error": s.error} for s in op.steps],
    }


class Control:
    """The control API's handlers. `events` is the EventLog (None: only in-memory answers)."""

    def __init__(
        self, events, table: RoutingTable, metrics: GatewayMetrics, *, default_fleet: str, follower=None
    ) -> None:
        self.events = events
        self.table = table
        self.metrics = metrics
        self.default_fleet = default_fleet
        self.follower = follower
        self.started = time.time()
        self.writer = f"gateway:{socket.gethostname()}:{os.getpid()}"
        # Whether a request carries the API token (the gateway sets it; /healthz is served without one)
        self.authorized = lambda request: True

    # ------------------------------------------------------------------------- read-only

    def fleet_named(self, ident: str) -> str:
        """The fleet a UUID names ('' when none): the routing table's lookup, one for chat and the API."""
        return self.table.fleet_named(ident)

    def _fleet(self, ident: str) -> str:
        if ident in self.table.fleets():
            return ident
        return self.fleet_named(ident) or check_fleet(ident)

    def control_plane(self) -> tuple[list[str], dict[str, object]]:
        """What is down (in a fixed order: nats, projector, promoter) and what was heard of each.

        NATS is down when this gateway's connection is; the projector and the promoter are down
        when no replica of them has been heard on haru.alive.> for alive.SILENT_AFTER_S (a gateway
        that has listened for less than that gives them the benefit of the doubt)."""
        if self.events is None or self.follower is None:
            return [], {}
        down: list[str] = []
        connected = self.events.connected
        if not connected:
            down.append("nats")
        detail: dict[str, object] = {"nats": {"connected": connected}}
        heard = self.follower.alive
        for role in subjects.CONTROL_ROLES:
            replicas = heard.alive(role)
            last = heard.last_heard_s(role)
            if not replicas and heard.listening_s() >= alive.SILENT_AFTER_S:
                down.append(role)
            detail[role] = {"alive": len(replicas), "last_heard_s": None if last is None else round(last, 1)}
        return down, detail

    async def healthz(self, request: web.BaseRequest) -> web.Response:
        nats_ok = None
        if self.events is not None:
            nats_ok = self.events.connected
        down, detail = self.control_plane()
        strict = request.query.get("strict", "0").lower() not in ("0", "false", "no")
        status = 503 if strict and down else 200
        body = {
            "status": "degraded" if down else "ok",
            "down": down,
            "control_plane": detail,
            "uptime_s": round(time.time() - self.started, 3),
            "nats_connected": nats_ok,
            "fleets": {
                f: {"active": r.active, "route_revision": r.revision}
                for f in self.table.fleets()
                if (r := self.table.get(f)) is not None
            },
        }
        if self.follower is not None:
            body["views_seen"] = self.follower.views_seen
            body["intents_seen"] = self.follower.intents_seen
            body["route_moves_seen"] = self.follower.moves_seen
        if not self.authorized(request):
            body.pop("fleets", None)  # /healthz needs no token: without one it names no fleet
        return json_response(body, status=status)

    async def metrics_text(self, request: web.BaseRequest) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": self.metrics.content_type})

    async def residency(self, request: web.BaseRequest) -> web.Response:
        now = time.time()
        wanted = request.query.get("fleet")
        if wanted:
            wanted = self.fleet_named(wanted) or wanted
            routes = self.table.get(wanted)
            if routes is None:
                raise _refused(fleet_not_found(wanted, self.table.fleets()))
            return json_response(truth_table([routes], now))
        all_routes = [r for f in self.table.fleets() if (r := self.table.get(f)) is not None]
        return json_response(truth_table(all_routes, now))

    async def models(self, request: web.BaseRequest) -> web.Response:
        fleet = request.headers.get("X-Haru-Fleet") or self.default_fleet
        fleet = self.fleet_named(fleet) or fleet
        routes = self.table.get(fleet)
        if routes is None:
            raise _refused(fleet_not_found(fleet, self.table.fleets()))
        return json_response(models_list(routes, time.time()))

    async def fleets(self, request: web.BaseRequest) -> web.Response:
        data = []
        for f in self.table.fleets():
            r = self.table.get(f)
            if r is not None:
                data.append(
                    {
                        "fleet": f,
                        "uuid": r.view.uuid if r.view is not None and r.view.uuid else fleet_uuid(f),
                        "active": r.active,
                        "route_revision": r.revision,
                        "models": len(r.entries),
                        "operation": r.intent.operation if r.intent else "",
                    }
                )
        return json_response({"object": "list", "data": data})

    async def fleet_view(self, request: web.BaseRequest, fleet: str) -> web.Response:
        fleet = self._fleet(fleet)
        if self._nats_up():
            try:
                got = await self.events.get_view(subjects.view_key(fleet))
            except LogUnavailable as exc:
                log.warning("gateway.view_read_failed", fleet=fleet, error=str(exc))
            else:
                if got is None:
                    raise _refused(fleet_not_found(fleet, self.table.fleets()))
                return raw_json(got[0], {"X-Haru-View-Revision": str(got[1])})
        routes = self.table.get(fleet)
        if routes is None or routes.view is None:
            raise _refused(fleet_not_found(fleet, self.table.fleets()))
        return raw_json(view_encoder.encode(routes.view), {"X-Haru-Stale": "true"})

    async def route_intent(self, request: web.BaseRequest, fleet: str) -> web.Response:
        fleet = self._fleet(fleet)
        if self._nats_up():
            try:
                got = await self.events.last_intent(fleet)
            except LogUnavailable as exc:
                log.warning("gateway.intent_read_failed", fleet=fleet, error=str(exc))
            else:
                if got is None:
                    if self.table.get(fleet) is None:
                        raise _refused(fleet_not_found(fleet, self.table.fleets()))
                    raise ApiError(
                        404,
                        "route_intent_not_found",
                        f"fleet {fleet!r} has no route intent yet (is the projector running?)",
                    )
                return raw_json(got[0], {"X-Haru-Intent-Seq": str(got[1])})
        routes = self.table.get(fleet)
        if routes is None or routes.intent is None:
            raise _refused(fleet_not_found(fleet, self.table.fleets()))
        return raw_json(view_encoder.encode(routes.intent), {"X-Haru-Stale": "true"})

    async def history(self, request: web.BaseRequest, fleet: str) -> web.Response:
        fleet = self._fleet(fleet)
        q = request.query
        model, domain = q.get("model", ""), q.get("domain", "")
        raw_limit = q.get("limit", "")
        try:
            limit = int(raw_limit) if raw_limit else HISTORY_DEFAULT_LIMIT
        except ValueError:
            raise ApiError(400, "invalid_request", f"limit={raw_limit!r} is not an integer", param="limit") from None
        if not 1 <= limit <= HISTORY_MAX_LIMIT:
            raise ApiError(400, "invalid_request", f"limit must be 1..{HISTORY_MAX_LIMIT}, got {limit}", param="limit")
        try:
            if model:
                subject_filter = subjects.model_events(fleet, model, domain or "*")
            elif domain:
                subject_filter = f"{subjects.EVT}.{fleet}.{subjects.check_name('domain', domain)}.>"
            else:
                subject_filter = subjects.fleet_events(fleet)
        except InvalidName as exc:
            raise ApiError(400, "invalid_request", str(exc), param="model" if model else "domain") from None
        events = self._need_log()
        try:
            records = await events.tail(subject_filter, limit)
            known = (
                bool(records)
                or self.table.get(fleet) is not None
                or bool(await events.subject_counts(subjects.fleet_events(fleet)))
            )
        except LogUnavailable as exc:
            raise ApiError(503, "log_unavailable", f"the event log is unreachable: {exc}") from None
        except LogDamaged as exc:
            raise ApiError(500, "log_damaged", str(exc)) from None
        if not known:
            raise _refused(fleet_not_found(fleet, self.table.fleets()))
        out = []
        for rec in reversed(records[-limit:]):
            item = {"seq": rec.seq, "time": rec.time.isoformat(), "subject": rec.subject}
            ev = rec.event
            if ev is not None:
                item.update(
                    type=tag_of(ev),
                    at=ev.at.isoformat(),
                    by=ev.by,
                    cause=ev.cause,
                    payload=payload(ev),
                    misplaced=misplaced(rec.subject, ev) or None,
                )
            else:
                item.update(type=None, error=rec.error, payload=None)
            out.append(item)
        return json_response({"fleet": fleet, "filter": subject_filter, "count": len(out), "events": out})

    async def reconcile(self, request: web.BaseRequest, fleet: str) -> web.Response:
        """Haru's `POST /v1/fleets/:id/reconcile` ran one reconcile tick. Here the promoter reconciles
        continuously (heartbeats, auto-failover, every operation step, as they happen), so this runs
        nothing: it answers with what the promoter has decided, from the view this gateway follows."""
        fleet = self._fleet(fleet)
        routes = self.table.get(fleet)
        if routes is None or routes.view is None:
            raise _refused(fleet_not_found(fleet, self.table.fleets()))
        view = routes.view
        _, detail = self.control_plane()
        op = view.operation
        last = view.last_operation
        return json_response(
            {
                "fleet": fleet,
                "uuid": view.uuid or fleet_uuid(fleet),
                "reconciled_by": "promoter",
                "note": "the promoter reconciles continuously; this request ran nothing and answers with what it has "
                "decided (the view as of view_seq)",
                "promoter": detail.get("promoter"),
                "view_seq": view.seq,
                "active": view.active,
                "route_revision": view.route_revision,
                "operation": _op_summary(op),
                "last_operation": _op_summary(last),
                "declined": {
                    "why": view.declined,
                    "domain": view.declined_domain,
                    "at": view.declined_at.isoformat() if view.declined_at else None,
                }
                if view.declined
                else None,
                "ineligible": {d.name: d.ineligible_why for d in view.domains.values() if not d.eligible},
            }
        )

    # ---------------------------------------------------------------------------- writes

    async def operation(self, request: web.BaseRequest, fleet: str, kind: str) -> web.Response:
        fleet = self._fleet(fleet)
        body = await request_body(request, _decode_operation, _OperationBody(), param="domain")
        target = body.domain or body.targetDomainId
        if not target:
            raise ApiError(
                400,
                "invalid_request",
                'the domain to act on is required: {"domain": "<name>"} - at `$.domain`',
                param="domain",
            )
        events = self._need_log()
        if body.dry_run:
            return await self._dry_run(events, fleet, kind, target)
        result = await requested(
            request_operation(events, fleet, kind, target, by=self.writer, now=datetime.now(UTC)),
            invalid="invalid_request",
        )  # kind checked against the route above
        status = OPERATION_STATUS.get(result.status, 500)
        log.info(
            "gateway.operation_requested",
            fleet=fleet,
            kind=kind,
            target=target,
            status=result.status,
            op_id=result.op_id,
        )
        body_out = {
            "op_id": result.op_id,
            "status": result.status,
            "message": result.message,
            "fleet": fleet,
            "kind": kind,
            "target": target,
        }
        headers = {"x-should-retry": "false"} if status >= 400 else None
        return json_response(body_out, status, headers)

    async def _dry_run(self, events, fleet: str, kind: str, target: str) -> web.Response:
        """What a provisioning operation would submit to `sky`, from the fleet's declarations."""
        from haru.core.apply import fold_declarations
        from haru.provision import NotProvisionable, dry_run_text

        if kind not in ("provision", "teardown", "replace"):
            raise ApiError(
                400, "invalid_request", f"dry_run is for provision, teardown and replace, not {kind}", param="dry_run"
            )
        try:
            records = await events.history(subjects.decl(fleet))
        except LogUnavailable as exc:
            raise ApiError(503, "log_unavailable", f"the event log is unreachable: {exc}") from None
        declared = fold_declarations(
            r.event for r in records if r.event is not None and not misplaced(r.subject, r.event)
        )
        spec = declared.domains.get(target)
        if spec is None:
            known = ", ".join(declared.domains) or "none"
            raise ApiError(
                404, "not_found", f"no domain {target!r} in fleet {fleet} (declared: {known})", param="domain"
            )
        try:
            text = dry_run_text(kind, fleet, spec)
        except NotProvisionable as exc:
            raise ApiError(409, "not_provisionable", str(exc), param="domain") from None
        return json_response(
            {"fleet": fleet, "kind": kind, "target": target, "provider": spec.provider, "dry_run": True, "submit": text}
        )

    def _nats_up(self) -> bool:
        """Connected now: while NATS is away, answer from memory at once instead of timing out."""
        return self.events is not None and self.events.connected

    def _need_log(self):
        if self.events is None:
            raise ApiError(503, "log_unavailable", "this gateway runs without an event log")
        return self.events


def _refused(refusal) -> ApiError:
    return ApiError(refusal.status, refusal.code, refusal.message, param=refusal.param, retry_after=refusal.retry_after)
