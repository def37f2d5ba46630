"""The web console at /ui: static files from the package, and live fleet state over server-sent events.

    GET /ui, /ui/app.js, /ui/app.css       the page (plain HTML/CSS/JS in gateway/ui/, no build, no CDN);
                                           no token needed: they hold no data
    GET /ui/events                         SSE: `event: fleet` with one fleet's snapshot, at once for every
                                           fleet and then on every change; `: keepalive` every 15 s
    GET /ui/api/operations?fleet=          past and running operations with their steps and durations
    GET /ui/api/why?fleet=&model=          a model's story (haru why), newest first
    GET /ui/api/verify?fleet=              haru verify over the fleet's subjects
    GET /ui/api/cost?fleet=&hours=24       the accounting of the last `hours` (haru cost --json, docs/cost.md)

Everything but the static files sits behind the same bearer token as the control API (the page asks
for it and keeps it in the tab's sessionStorage); promote/demote go through the control API itself.

One fan-out, no watch per client: the gateway's `RouteFollower` calls `changed(fleet)` when it
applies a view or an intent. With no console open that is one length check. With consoles open,
changes are coalesced for `coalesce_s` and each fleet's snapshot is encoded once per flush; every
subscriber keeps only the newest snapshot per fleet, so a slow browser costs one pending snapshot
per fleet, never a growing queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from importlib import resources

import msgspec
import structlog
from aiohttp import web

from haru.core import subjects
from haru.core.errors import InvalidName, LogUnavailable
from haru.gateway.console_core import hello, operations, snapshot, story_items
from haru.gateway.errors import ApiError
from haru.log.router_reports import RouterReports
from haru.log.seam import Log

log = structlog.get_logger("haru.gateway")

KEEPALIVE_S = 15.0
_STATIC = {
    "/ui": ("index.html", "text/html; charset=utf-8"),
    "/ui/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/app.css": ("app.css", "text/css; charset=utf-8"),
}
_json = msgspec.json.Encoder()


class _Subscriber:
    __slots__ = ("pending", "wake")

    def __init__(self) -> None:
        self.pending: dict[str, bytes] = {}
        self.wake = asyncio.Event()

    def offer(self, fleet: str, frame: bytes) -> None:
        self.pending[fleet] = frame  # the newest snapshot replaces an unsent older one
        self.wake.set()


def _frame(data: dict) -> bytes:
    return b"event: fleet\ndata: " + _json.encode(data) + b"\n\n"


class Console:
    def __init__(self, table, events: Log | None, *, coalesce_s: float = 0.05) -> None:
        self.table = table
        self.events = events
        self.coalesce_s = coalesce_s
        self.subscribers: set[_Subscriber] = set()
        self.frames_sent = 0
        self._dirty: set[str] = set()
        self._flush: asyncio.TimerHandle | None = None
        self._closing = False
        self._static: dict[str, tuple[bytes, str]] = {}
        self.routers: RouterReports | None = None  # the route followers' reports, heard by the gateway
        ui = resources.files(__package__ or "haru.gateway") / "ui"
        for path, (name, ctype) in _STATIC.items():
            self._static[path] = ((ui / name).read_bytes(), ctype)

    # ------------------------------------------------------------------------------ the fan-out

    def changed(self, fleet: str) -> None:
        """Called by the route follower for every view or intent it applies."""
        if not self.subscribers:
            return
        self._dirty.add(fleet)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(self.coalesce_s, self._send)

    def _send(self) -> None:
        self._flush = None
        dirty, self._dirty = self._dirty, set()
        now = time.time()
        for fleet in dirty:
            frame = _frame(snapshot(fleet, self.table.get(fleet), now))
            for sub in self.subscribers:
                sub.offer(fleet, frame)

    def close(self) -> None:
        """Let every open stream end (the server is stopping)."""
        self._closing = True
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        for sub in self.subscribers:
            sub.wake.set()

    # ------------------------------------------------------------------------------- handlers

    def static(self, path: str) -> web.Response | None:
        got = self._static.get(path)
        if got is None:
            return None
        body, ctype = got
        return web.Response(
            body=body,
            headers={
                "Content-Type": ctype,
                "Cache-Control": "no-cache",
                "X-Content-Type-Options": "nosniff",
                # the page loads only its own files and talks only to this gateway
                "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
            },
        )

    async def handle(self, request: web.BaseRequest, path: str, method: str) -> web.StreamResponse:
        if method not in ("GET", "HEAD"):
            raise ApiError(405, "method_not_allowed", f"{path} accepts GET only")
        if path == "/ui/events":
            if method == "HEAD":
                return web.Response(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache, no-store"}
                )
            return await self.stream(request)
        if path == "/ui/api/operations":
            return await self.operations(request)
        if path == "/ui/api/why":
            return await self.why(request)
        if path == "/ui/api/verify":
            return await self.verify(request)
        if path == "/ui/api/routers":
            return self.routers_behind(request)
        if path == "/ui/api/cost":
            return await self.cost(request)
        raise ApiError(404, "not_found", f"no such console endpoint: {path} (the console is at /ui)")

    async def stream(self, request: web.BaseRequest) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache, no-store",
                "X-Accel-Buffering": "no",
            }
        )
        await resp.prepare(request)
        await resp.write(b"event: hello\ndata: " + _json.encode(hello()) + b"\n\n")
        sub = _Subscriber()
        now = time.time()
        for fleet in self.table.fleets():
            sub.offer(fleet, _frame(snapshot(fleet, self.table.get(fleet), now)))
        if not sub.pending:
            await resp.write(b"event: empty\ndata: {}\n\n")
        self.subscribers.add(sub)
        try:
            while not self._closing:
                if not sub.pending:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(KEEPALIVE_S):
                            await sub.wake.wait()
                    sub.wake.clear()
                    if not sub.pending:
                        await resp.write(b": keepalive\n\n")
                        continue
                frames, sub.pending = list(sub.pending.values()), {}
                await resp.write(b"".join(frames))
                self.frames_sent += len(frames)
        except ConnectionResetError:
            pass  # the browser went away mid-write (a disconnect otherwise cancels this handler)
        finally:
            self.subscribers.discard(sub)
        return resp

    def _fleet(self, request: web.BaseRequest) -> str:
        fleet = request.query.get("fleet", "")
        try:
            return subjects.check_name("fleet", fleet)
        except InvalidName as exc:
            raise ApiError(400, "invalid_request", f"{exc} (pass ?fleet=<name>)", param="fleet") from None

    async def _records(self, subject_filter: str):
        if self.events is None:
            raise ApiError(503, "log_unavailable", "this gateway runs without an event log")
        try:
            return await self.events.history(subject_filter)
        except LogUnavailable as exc:
            raise ApiError(503, "log_unavailable", f"the event log is unreachable: {exc}") from None

    async def operations(self, request: web.BaseRequest) -> web.Response:
        fleet = self._fleet(request)
        records = await self._records(subjects.op(fleet))
        return _json_response({"fleet": fleet, "operations": operations(records)})

    def routers_behind(self, request: web.BaseRequest) -> web.Response:
        """The routers that follow the fleet (`haru route follow`): what each applied against the route."""
        fleet = self._fleet(request)
        routes = self.table.get(fleet)
        revision = routes.revision if routes is not None else 0
        rows = self.routers.lag(fleet, revision) if self.routers is not None else []
        return _json_response({"fleet": fleet, "revision": revision, "routers": rows})

    async def why(self, request: web.BaseRequest) -> web.Response:

        fleet = self._fleet(request)
        model = request.query.get("model", "")
        if not model:
            raise ApiError(400, "invalid_request", "the model is required: ?model=<id>", param="model")
        from haru.log.reads import why_records

        if self.events is None:
            raise ApiError(503, "log_unavailable", "this gateway runs without an event log")
        try:
            subjects.check_model_id(model)
            have = await why_records(self.events, fleet, model, request.query.get("domain", ""), [])
        except InvalidName as exc:
            raise ApiError(400, "invalid_request", str(exc), param="model") from None
        except LogUnavailable as exc:
            raise ApiError(503, "log_unavailable", f"the event log is unreachable: {exc}") from None
        picked = [have[seq] for seq in sorted(have)]
        return _json_response({"fleet": fleet, "model": model, "events": story_items(picked)})

    async def cost(self, request: web.BaseRequest) -> web.Response:
        """The fleet's accounting over the last `hours` (24 by default), as `haru cost --json` prints it."""
        from datetime import UTC, datetime, timedelta

        from haru.core.cost import account

        fleet = self._fleet(request)
        try:
            hours = float(request.query.get("hours", "24"))
        except ValueError:
            hours = -1.0
        if not 0 < hours <= 24 * 366:
            raise ApiError(
                400, "invalid_request", "hours must be a number of hours, above 0, a year at most", param="hours"
            )
        records = await self._records(subjects.fleet_events(fleet))
        until = datetime.now(UTC)
        acct = account(records, fleet, since=until - timedelta(hours=hours), until=until)
        return _json_response(acct.to_builtins())

    async def verify(self, request: web.BaseRequest) -> web.Response:
        from haru.log.history import Verifier
        from haru.log.reads import fleet_checkpoint

        fleet = self._fleet(request)
        verifier = Verifier()
        if self.events is None:
            raise ApiError(503, "log_unavailable", "this gateway runs without an event log")
        try:  # from the fleet's newest checkpoint (its heads checked against the store), not from 1
            upto, heads, bad = await fleet_checkpoint(self.events, fleet)
            verifier.tips.update(heads)
            verifier.breaks.extend(bad)
            records = await self.events.history(subjects.fleet_events(fleet), from_seq=upto + 1)
        except LogUnavailable as exc:
            raise ApiError(503, "log_unavailable", f"the event log is unreachable: {exc}") from None
        for rec in records:
            verifier.add(rec)
        return _json_response(
            {
                "fleet": fleet,
                "ok": verifier.ok,
                "summary": verifier.summary(),
                "since_checkpoint": upto,
                "subjects": verifier.subjects,
                "events": verifier.events,
                "breaks": [str(b) for b in verifier.breaks[:50]],
                "misplaced": [str(m) for m in verifier.misplaced[:50]],
            }
        )


def _json_response(value: object) -> web.Response:
    return web.Response(body=_json.encode(value), content_type="application/json")
