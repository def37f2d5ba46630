"""SkyServe: a `provider: skyserve` domain as a service YAML, and `sky serve up / status / down`.

The service is the SkyPilot task of the domain (`haru.provision.skypilot.task_config`) with a
`service` section: the replica count and a readiness probe on the agent's serving port. SkyServe then
owns the replicas (placement, recovery, load balancing); Haru owns the domain's role in the fleet.
`sky serve status` has no machine-readable output in SkyPilot 0.14, so its table is read by its
header (NAME, VERSION, UPTIME, STATUS, REPLICAS, ENDPOINT), colours stripped.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping

import msgspec

from haru.core.specs import DomainSpec
from haru.provision import yamltext
from haru.provision.errors import SkyFailed, TeardownFailed
from haru.provision.execs import Exec, SubprocessExec
from haru.provision.skypilot import cluster_name, placements, provision_of, secret_env, serving_port, task_config

__all__ = ["ServiceStatus", "ServeResult", "SkyServe", "service_config", "service_yaml", "parse_service_table"]

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class ServiceStatus(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    status: str  # SkyServe's: CONTROLLER_INIT | REPLICA_INIT | READY | NO_REPLICA | FAILED | SHUTTING_DOWN ...
    replicas: str = ""  # "1/1": ready / total
    endpoint: str = ""


class ServeResult(msgspec.Struct, frozen=True, kw_only=True):
    service: str
    found: bool  # the service already existed: nothing was submitted
    duration_s: float
    endpoint: str = ""


def service_config(fleet: str, spec: DomainSpec, *, generation: str = "") -> dict:
    """The SkyServe service: the domain's task plus replicas and a readiness probe on the agent's port.

    SkyServe places (and re-places) replicas itself, so where the domain declares several placements
    they go in as `any_of`, in the declared order, instead of Haru trying them one by one."""
    p = provision_of(spec)
    options = placements(spec)
    task = task_config(fleet, spec, options[0], generation=generation)
    resources = task["resources"]
    resources["ports"] = serving_port(spec)  # SkyServe load-balances one port: the agent's serving port
    if len(options) > 1:
        for key in ("cloud", "region", "zone"):
            resources.pop(key, None)
        resources["any_of"] = [
            {k: v for k, v in (("cloud", o.cloud), ("region", o.region), ("zone", o.zone)) if v} for o in options
        ]
    service = {
        "readiness_probe": {"path": p.service.readiness_path, "initial_delay_seconds": p.service.initial_delay_s},
        "replicas": p.service.replicas,
    }
    return {"service": service, **task}


def service_yaml(fleet: str, spec: DomainSpec, *, generation: str = "") -> str:
    return yamltext.dump(service_config(fleet, spec, generation=generation))


def parse_service_table(text: str) -> dict[str, ServiceStatus]:
    """The Services table of `sky serve status`, by name. Columns are found by the header's words;
    a row's cells are split on runs of two or more spaces (SkyPilot pads columns that way)."""
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    out: dict[str, ServiceStatus] = {}
    header: list[str] | None = None
    for line in lines:
        if not line.strip():
            if header is not None and out:
                break  # the Services table ends at a blank line; the Replicas table follows
            continue
        cells = re.split(r"\s{2,}", line.strip())
        if cells and cells[0] == "NAME" and "STATUS" in cells:
            if header is not None and out:
                break
            header = cells
            continue
        if header is None or len(cells) < 2:
            continue
        row = dict(zip(header, cells, strict=False))
        name = row.get("NAME", "")
        if name:
            endpoint = row.get("ENDPOINT", "")
            out[name] = ServiceStatus(
                name=name,
                status=row.get("STATUS", ""),
                replicas=row.get("REPLICAS", ""),
                endpoint="" if endpoint == "-" else endpoint,
            )
    return out


class SkyServe:
    """`sky serve up / status / down` through one injectable `Exec`, every command bounded."""

    def __init__(
        self,
        exec: Exec | None = None,
        *,
        sky: str | list[str] = "sky",
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.exec = exec or SubprocessExec()
        self.sky = [sky] if isinstance(sky, str) else list(sky)
        self.environ = os.environ if environ is None else environ
        self.clock = clock

    async def services(self, *, timeout_s: float = 120) -> list[ServiceStatus]:
        """Every service SkyServe knows (`sky serve status`)."""
        argv = [*self.sky, "serve", "status"]
        result = await self.exec(argv, timeout_s=timeout_s)
        if result.returncode != 0:
            raise SkyFailed(
                result.summary("sky serve status"), argv=argv, returncode=result.returncode, output=result.output
            )
        return list(parse_service_table(result.stdout).values())

    async def status(self, service: str, *, timeout_s: float = 120) -> ServiceStatus | None:
        argv = [*self.sky, "serve", "status", service]
        result = await self.exec(argv, timeout_s=timeout_s)
        if result.returncode != 0:
            if "not found" in result.output.lower() or "no existing service" in result.output.lower():
                return None
            raise SkyFailed(
                result.summary("sky serve status"), argv=argv, returncode=result.returncode, output=result.output
            )
        return parse_service_table(result.stdout).get(service)

    async def up(self, fleet: str, spec: DomainSpec, *, generation: str = "") -> ServeResult:
        """Submit the service; found, not repeated, when SkyServe already has it (and it is not going away)."""
        p = provision_of(spec)
        name = cluster_name(fleet, spec, generation)
        started = self.clock()
        existing = await self.status(name, timeout_s=p.status_timeout_s)
        if existing is not None and existing.status not in ("SHUTTING_DOWN", "FAILED", "FAILED_CLEANUP"):
            return ServeResult(service=name, found=True, duration_s=self.clock() - started, endpoint=existing.endpoint)
        secrets = secret_env(p, self.environ)
        text = service_yaml(fleet, spec, generation=generation)
        with tempfile.TemporaryDirectory(prefix="haru-serve-") as tmp:
            path = os.path.join(tmp, f"{name}.yaml")
            with open(path, "w") as fh:
                fh.write(text)
            argv = [*self.sky, "serve", "up", "--yes", "--service-name", name]
            for secret in secrets:
                argv += ["--secret", secret]
            argv.append(path)
            result = await self.exec(argv, timeout_s=p.launch_timeout_s, env=secrets)
        if result.returncode != 0:
            raise SkyFailed(
                result.summary("sky serve up"), argv=argv, returncode=result.returncode, output=result.output
            )
        after = await self.status(name, timeout_s=p.status_timeout_s)
        return ServeResult(
            service=name, found=False, duration_s=self.clock() - started, endpoint=after.endpoint if after else ""
        )

    async def down(self, service: str, *, timeout_s: float = 900, status_timeout_s: float = 120) -> bool:
        if await self.status(service, timeout_s=status_timeout_s) is None:
            return False
        argv = [*self.sky, "serve", "down", "--yes", service]
        result = await self.exec(argv, timeout_s=timeout_s)
        if result.returncode != 0:
            raise TeardownFailed(
                result.summary("sky serve down") + f"; service {service} may still be running: "
                f"check `sky serve status {service}`",
                argv=argv,
                returncode=result.returncode,
                output=result.output,
            )
        return True
