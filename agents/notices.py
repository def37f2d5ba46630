"""A cloud's own word that it takes the host back, read the way each provider documents it.

    notices = provider_notices(spec.preemption_notice)      # AwsNotices, GcpNotices or AzureNotices
    said = await notices.poll(session, wait_s=5.0)          # '' while there is no notice

Each provider has its own protocol, and a generic "a 200 with a body" rule reads at least one of them
wrong, so each is spelled out here:

- **AWS** (EC2 instance metadata, IMDSv2): a session token first (`PUT /latest/api/token` with
  `X-aws-ec2-metadata-token-ttl-seconds`), then every read carries it in `X-aws-ec2-metadata-token`;
  a read without one is refused with 401 on instances that require IMDSv2 (the default on new ones).
  `/latest/meta-data/spot/instance-action` answers 404 until the spot instance is to be interrupted,
  then `{"action": "terminate"|"stop"|"hibernate", "time": ...}`, two minutes ahead.
  `/latest/meta-data/events/recommendations/rebalance` answers 404 until EC2 sees an elevated risk of
  interruption, then `{"noticeTime": ...}`: earlier than the interruption notice, and a good moment
  to move. An expired token (401) is renewed once; a host whose metadata service has no token API
  (404 or 405 on the PUT) is read the IMDSv1 way.
- **GCP** (Compute Engine metadata server): every request carries `Metadata-Flavor: Google` (without
  it: 403). `/computeMetadata/v1/instance/preempted` says `FALSE`, then `TRUE` about 30 s before a
  spot or preemptible VM stops; `/computeMetadata/v1/instance/maintenance-event` says `NONE`, or
  `TERMINATE_ON_HOST_MAINTENANCE` / `MIGRATE_ON_HOST_MAINTENANCE` ahead of host maintenance (a GPU
  VM cannot be live-migrated, so either means the host goes). Both are read as long polls:
  `?wait_for_change=true&last_etag=<ETag>&timeout_sec=<n>` answers at once when the value differs
  from the one seen, otherwise at the first change or after `n` seconds.
- **Azure** (Scheduled Events): `GET /metadata/scheduledevents?api-version=2020-07-01` with
  `Metadata: true` (without it: 400) answers a JSON document whose `Events` list is usually empty.
  Only `Preempt` (spot eviction, at least 30 s ahead) and `Terminate` events are notices, and only
  those whose `Resources` name this VM (read once from `/metadata/instance/compute/name`): a `Freeze`
  or a `Reboot` is a pause the host survives, and an event for another VM of the set is not ours.

The readers (`aws_instance_action`, `gcp_preempted`, `azure_events`, ...) are pure: status and body
in, the notice's words out ('' = none). The pollers hold only the protocol's state (a token, an ETag,
the VM's name). An endpoint that does not answer is not a notice: the poll says '' and the next one
tries again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Protocol

import aiohttp

from haru.core.specs import PreemptionNotice

__all__ = [
    "AWS_ENDPOINT",
    "AZURE_ENDPOINT",
    "GCP_ENDPOINT",
    "AwsNotices",
    "AzureNotices",
    "GcpNotices",
    "ProviderNotices",
    "aws_instance_action",
    "aws_rebalance",
    "azure_events",
    "gcp_maintenance",
    "gcp_preempted",
    "provider_notices",
]

AWS_ENDPOINT = "http://169.254.169.254"
GCP_ENDPOINT = "http://metadata.google.internal"
AZURE_ENDPOINT = "http://169.254.169.254"

AWS_TOKEN_TTL_S = 21_600  # the longest IMDSv2 allows; renewed when a read says 401
AZURE_API_VERSION = "2020-07-01"
AZURE_NOTICE_TYPES = frozenset({"Preempt", "Terminate"})
_DETAIL_MAX = 300


# -- what an answer means (pure) -------------------------------------------------------------------


def _json(body: str) -> object:
    try:
        return json.loads(body)
    except ValueError:
        return None


def aws_instance_action(status: int, body: str) -> str:
    """`spot/instance-action`: 404 until an interruption is scheduled, then `{"action", "time"}`."""
    if status != 200:
        return ""
    doc = _json(body)
    if isinstance(doc, dict) and doc.get("action"):
        return f"AWS spot instance-action: {doc['action']} at {doc.get('time', '?')}"[:_DETAIL_MAX]
    return ""


def aws_rebalance(status: int, body: str) -> str:
    """`events/recommendations/rebalance`: 404 until EC2 recommends a move, then `{"noticeTime"}`."""
    if status != 200:
        return ""
    doc = _json(body)
    if isinstance(doc, dict) and doc.get("noticeTime"):
        return f"AWS rebalance recommendation since {doc['noticeTime']}"[:_DETAIL_MAX]
    return ""


def gcp_preempted(status: int, body: str) -> str:
    """`instance/preempted`: `TRUE` once the VM is being preempted, `FALSE` before."""
    if status == 200 and body.strip().upper() == "TRUE":
        return "GCP instance/preempted: TRUE (the VM stops in about 30 s)"
    return ""


def gcp_maintenance(status: int, body: str) -> str:
    """`instance/maintenance-event`: `NONE`, or the maintenance about to happen to the host."""
    said = body.strip().upper()
    if status == 200 and said and said != "NONE":
        return f"GCP instance/maintenance-event: {said}"[:_DETAIL_MAX]
    return ""


def azure_events(status: int, body: str, vm_name: str) -> str:
    """Scheduled Events: the first `Preempt` or `Terminate` event whose `Resources` name this VM
    ('' = none; an empty `Events` list is the usual answer). With no VM name known, any such event counts."""
    if status != 200:
        return ""
    doc = _json(body)
    events = doc.get("Events") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        return ""
    for e in events:
        if not isinstance(e, dict) or e.get("EventType") not in AZURE_NOTICE_TYPES:
            continue
        resources = e.get("Resources")
        if vm_name and isinstance(resources, list) and vm_name not in resources:
            continue
        said = f"Azure scheduled event {e['EventType']} {e.get('EventId', '?')} not before {e.get('NotBefore', '?')}"
        return said[:_DETAIL_MAX]
    return ""


# -- the protocols -----------------------------------------------------------------------------------


class ProviderNotices(Protocol):
    """One provider's notice, read with its protocol; '' while there is none."""

    async def poll(self, session: aiohttp.ClientSession, wait_s: float) -> str: ...


async def _get(
    session: aiohttp.ClientSession, url: str, headers: Mapping[str, str], timeout_s: float
) -> tuple[int, str, Mapping[str, str]]:
    async with session.get(url, headers=dict(headers), timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
        return r.status, await r.text(errors="replace"), r.headers


class AwsNotices:
    """IMDSv2: a token, then the interruption notice and the rebalance recommendation."""

    def __init__(self, endpoint: str = "") -> None:
        self.endpoint = (endpoint or AWS_ENDPOINT).rstrip("/")
        self.token: str | None = None
        self.imdsv1 = False  # the metadata service has no token API: read without one

    async def _token(self, session: aiohttp.ClientSession, timeout_s: float) -> str | None:
        if self.token is None and not self.imdsv1:
            async with session.put(
                f"{self.endpoint}/latest/api/token",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)},
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as r:
                if r.status == 200:
                    self.token = (await r.text()).strip()
                elif r.status in (404, 405):
                    self.imdsv1 = True
        return self.token

    async def _read(self, session: aiohttp.ClientSession, path: str, timeout_s: float) -> tuple[int, str]:
        for _ in range(2):  # once more with a new token when the one held expired
            token = await self._token(session, timeout_s)
            headers = {"X-aws-ec2-metadata-token": token} if token else {}
            status, body, _h = await _get(session, f"{self.endpoint}/latest/meta-data/{path}", headers, timeout_s)
            if status != 401 or token is None:
                return status, body
            self.token = None
        return status, body

    async def poll(self, session: aiohttp.ClientSession, wait_s: float) -> str:
        timeout_s = max(0.1, min(2.0, wait_s))
        said = aws_instance_action(*await self._read(session, "spot/instance-action", timeout_s))
        return said or aws_rebalance(*await self._read(session, "events/recommendations/rebalance", timeout_s))


class GcpNotices:
    """The metadata server's `preempted` and `maintenance-event`, each a long poll on its ETag."""

    PATHS = {"instance/preempted": gcp_preempted, "instance/maintenance-event": gcp_maintenance}

    def __init__(self, endpoint: str = "") -> None:
        self.endpoint = (endpoint or GCP_ENDPOINT).rstrip("/")
        self.etags: dict[str, str] = {}
        self.said: dict[str, str] = {}

    async def _watch(self, session: aiohttp.ClientSession, path: str, wait_s: float) -> str:
        url = f"{self.endpoint}/computeMetadata/v1/{path}"
        etag = self.etags.get(path)
        if etag is None:  # the first read: the value as it is
            query, timeout_s = "", max(0.1, min(2.0, wait_s))
        else:  # then: at once if it changed since, else at the first change or after wait_s
            wait = max(1, int(wait_s))
            query, timeout_s = f"?wait_for_change=true&last_etag={etag}&timeout_sec={wait}", wait + 2.0
        status, body, headers = await _get(session, url + query, {"Metadata-Flavor": "Google"}, timeout_s)
        if status == 200:
            self.etags[path] = headers.get("ETag", "")
            self.said[path] = self.PATHS[path](status, body)
        return self.said.get(path, "")

    async def poll(self, session: aiohttp.ClientSession, wait_s: float) -> str:
        # One long poll at a time, the notice first: a maintenance event is read when preempted says nothing.
        for path in self.PATHS:
            said = await self._watch(session, path, wait_s / len(self.PATHS))
            if said:
                return said
        return ""


class AzureNotices:
    """Scheduled Events for this VM: `Preempt` and `Terminate`, nothing else."""

    def __init__(self, endpoint: str = "") -> None:
        self.endpoint = (endpoint or AZURE_ENDPOINT).rstrip("/")
        self.vm_name: str | None = None

    async def poll(self, session: aiohttp.ClientSession, wait_s: float) -> str:
        timeout_s = max(0.1, min(2.0, wait_s))
        headers = {"Metadata": "true"}
        if self.vm_name is None:
            status, body, _h = await _get(
                session,
                f"{self.endpoint}/metadata/instance/compute/name?api-version=2021-02-01&format=text",
                headers,
                timeout_s,
            )
            if status == 200:
                self.vm_name = body.strip()
        status, body, _h = await _get(
            session, f"{self.endpoint}/metadata/scheduledevents?api-version={AZURE_API_VERSION}", headers, timeout_s
        )
        return azure_events(status, body, self.vm_name or "")


def provider_notices(notice: PreemptionNotice) -> ProviderNotices | None:
    """The poller for a notice that names its provider (None for a `url` or `command` notice)."""
    if notice.provider == "aws":
        return AwsNotices(notice.endpoint)
    if notice.provider == "gcp":
        return GcpNotices(notice.endpoint)
    if notice.provider == "azure":
        return AzureNotices(notice.endpoint)
    return None
