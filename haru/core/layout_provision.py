"""A launched domain's `provision` block (SkyPilot, SkyServe) and its `preemption_notice`, checked where
the mistake is made, before anything is launched or paid for.
"""

from __future__ import annotations

import re

from haru.core.errors import LayoutError
from haru.core.layout_doc import DomainDoc, convert_at
from haru.core.specs import READY_PATH, PreemptionNotice, ProvisionSpec

__all__ = ["RESERVED_ENVS", "SERVING_TOKEN", "notice_from", "provision_from"]


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ACCELERATORS = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(:\d+(\.\d+)?)?")
_CLUSTER = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_PLACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# What the default run command reads (haru.provision.skypilot): an operator's env may not shadow it.
RESERVED_ENVS = ("HARU_AGENT_CONFIG",)
SERVING_TOKEN = "HARU_SERVING_TOKEN"  # the bearer token an agent's serving port needs beyond loopback


def provision_from(d: DomainDoc, name: str, dp: str) -> ProvisionSpec:
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
    p: ProvisionSpec = convert_at(raw, ProvisionSpec, pp)
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


def notice_from(notice: PreemptionNotice | None, dp: str) -> PreemptionNotice | None:
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
