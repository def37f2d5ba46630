"""Local stand-ins for the clouds' metadata services, answering the preemption-notice paths the way
each provider documents them, strict where the provider is strict:

- AWS (EC2 IMDSv2, "Use the Instance Metadata Service to access instance metadata", "Spot Instance
  interruption notices", "EC2 instance rebalance recommendations"): `PUT /latest/api/token` needs the
  TTL header and answers a token; every `/latest/meta-data/...` read without a valid token is 401 (an
  instance that requires IMDSv2); `spot/instance-action` and `events/recommendations/rebalance` are 404
  until announced. `imdsv1=True` plays an old instance with no token API (the PUT answers 405).
- GCP (Compute Engine, "About VM metadata", "Detect if a VM was preempted", "Getting live migration
  notices"): every request needs `Metadata-Flavor: Google` (else 403); `instance/preempted` says
  `FALSE`/`TRUE`, `instance/maintenance-event` `NONE` or the event; each answer has an ETag, and
  `?wait_for_change=true&last_etag=E&timeout_sec=N` answers at once when the value's ETag is not E,
  otherwise at the next change or after N seconds.
- Azure (Azure Instance Metadata Service, "Scheduled Events"): every request needs `Metadata: true`
  (else 400); `/metadata/scheduledevents` answers `{"DocumentIncarnation": n, "Events": [...]}`, the
  list usually empty; `/metadata/instance/compute/name` answers the VM's name.

    async with FakeMetadata("aws") as md:           # md.endpoint: http://127.0.0.1:<port>
        md.announce()                               # the interruption notice from now on
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

from aiohttp import web

AZURE_VM = "haru-vm-a"


class FakeMetadata:
    def __init__(self, provider: str, *, imdsv1: bool = False, vm_name: str = AZURE_VM) -> None:
        assert provider in ("aws", "gcp", "azure"), provider
        self.provider = provider
        self.imdsv1 = imdsv1
        self.vm_name = vm_name
        self.tokens: set[str] = set()
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # (method, path_qs, headers) as received
        # AWS
        self.instance_action: dict[str, str] | None = None
        self.rebalance: dict[str, str] | None = None
        # GCP: value and ETag per path, and a condition that wakes long polls
        self.values = {"instance/preempted": "FALSE", "instance/maintenance-event": "NONE"}
        self.etags = {path: secrets.token_hex(8) for path in self.values}
        self.changed = asyncio.Condition()
        # Azure
        self.incarnation = 1
        self.events: list[dict[str, Any]] = []
        self._runner: web.AppRunner | None = None
        self.endpoint = ""

    # -- what the provider says ---------------------------------------------------------------------

    def announce(self, kind: str = "") -> None:
        """The provider's notice that the host goes: AWS's instance-action (or `rebalance`), GCP's
        preempted (or `maintenance`), Azure's Preempt event for this VM (or another `EventType`)."""
        if self.provider == "aws":
            if kind == "rebalance":
                self.rebalance = {"noticeTime": "2026-12-06T06:00:00Z"}
            else:
                self.instance_action = {"action": "terminate", "time": "2026-12-06T06:02:00Z"}
        elif self.provider == "gcp":
            path = "instance/maintenance-event" if kind == "maintenance" else "instance/preempted"
            self._set(path, "TERMINATE_ON_HOST_MAINTENANCE" if kind == "maintenance" else "TRUE")
        else:
            self.add_event(kind or "Preempt", [self.vm_name])

    def add_event(self, event_type: str, resources: list[str]) -> None:
        self.events.append(
            {
                "EventId": secrets.token_hex(4),
                "EventStatus": "Scheduled",
                "EventType": event_type,
                "ResourceType": "VirtualMachine",
                "Resources": resources,
                "NotBefore": "Sun, 06 Dec 2026 06:00:30 GMT",
                "Description": "",
                "EventSource": "Platform",
                "DurationInSeconds": -1,
            }
        )
        self.incarnation += 1

    def withdraw(self) -> None:
        self.instance_action = self.rebalance = None
        if self.provider == "gcp":
            self._set("instance/preempted", "FALSE")
            self._set("instance/maintenance-event", "NONE")
        self.events.clear()
        self.incarnation += 1

    def expire_tokens(self) -> None:
        self.tokens.clear()

    def _set(self, path: str, value: str) -> None:
        if self.values[path] != value:
            self.values[path] = value
            self.etags[path] = secrets.token_hex(8)

            async def wake() -> None:
                async with self.changed:
                    self.changed.notify_all()

            asyncio.get_running_loop().create_task(wake())

    # -- the HTTP side ------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path_qs, dict(request.headers)))
        return await getattr(self, f"_{self.provider}")(request)

    async def _aws(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/latest/api/token":
            if request.method != "PUT":
                return web.Response(status=405)
            if self.imdsv1:
                return web.Response(status=405)
            if "X-aws-ec2-metadata-token-ttl-seconds" not in request.headers:
                return web.Response(status=400, text="Missing X-aws-ec2-metadata-token-ttl-seconds")
            token = secrets.token_urlsafe(24)
            self.tokens.add(token)
            return web.Response(text=token)
        if not request.path.startswith("/latest/meta-data/"):
            return web.Response(status=404)
        if not self.imdsv1 and request.headers.get("X-aws-ec2-metadata-token") not in self.tokens:
            return web.Response(status=401)
        doc = {
            "/latest/meta-data/spot/instance-action": self.instance_action,
            "/latest/meta-data/events/recommendations/rebalance": self.rebalance,
        }.get(request.path)
        if doc is None:
            return web.Response(status=404, text="<?xml ...><title>404 - Not Found</title>")
        return web.Response(text=json.dumps(doc))

    async def _gcp(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Metadata-Flavor") != "Google":
            return web.Response(status=403, text="Missing Metadata-Flavor:Google header.")
        path = request.path.removeprefix("/computeMetadata/v1/")
        if path not in self.values:
            return web.Response(status=404)
        if request.query.get("wait_for_change") == "true":
            last = request.query.get("last_etag", "")
            timeout = float(request.query.get("timeout_sec", "3600"))
            if self.etags[path] == last:
                async with self.changed:
                    try:
                        await asyncio.wait_for(self.changed.wait_for(lambda: self.etags[path] != last), timeout)
                    except TimeoutError:
                        pass
        return web.Response(text=self.values[path], headers={"ETag": self.etags[path]})

    async def _azure(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Metadata") != "true":
            return web.Response(status=400, text=json.dumps({"error": "Bad request. Required metadata header"}))
        if request.path == "/metadata/instance/compute/name":
            return web.Response(text=self.vm_name)
        if request.path == "/metadata/scheduledevents":
            if "api-version" not in request.query:
                return web.Response(status=400, text=json.dumps({"error": "Bad request. api-version is missing"}))
            doc = {"DocumentIncarnation": self.incarnation, "Events": self.events}
            return web.Response(text=json.dumps(doc), content_type="application/json")
        return web.Response(status=404)

    async def __aenter__(self) -> FakeMetadata:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.endpoint = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
