"""SkyPilot: a domain's declaration as a task YAML, and `sky launch / status / down` behind `Exec`.

The pure half (`placements`, `agent_config`, `task_config`) turns a `DomainSpec` with a provision
block into the task SkyPilot runs: the resources (cloud, region or zone, accelerators, spot, disk,
image, ports) and the agent (the operator's setup installs Haru, run starts `haru agent` with its config in
`$HARU_AGENT_CONFIG` and its credentials as SkyPilot secrets). The shell half (`SkyPilot`) runs the
CLI, one bounded command at a time:

- `launch` first asks `sky status` whether the cluster is already there (a launch that happened
  before a crash is found, not repeated; one still under way, INIT, is waited for; a STOPPED one is
  taken down), then tries each placement in order: a capacity error or a
  timeout moves to the next (after taking down whatever the failed attempt left), any other failure
  stops. Every attempt is returned, with its duration.
- `status` reads `sky status -o json` (SkyPilot's machine-readable output).
- `down` is idempotent: a cluster SkyPilot no longer knows is already down.
- `cost_report` (and `cost`, its total) reads `sky cost-report -o json`: a cluster's `total_cost` and `duration`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

import msgspec

from haru.core.events import ClusterCost
from haru.core.specs import DomainSpec, ProvisionSpec
from haru.provision import yamltext
from haru.provision.errors import (
    CapacityError,
    LaunchFailed,
    NotProvisionable,
    SecretMissing,
    SkyFailed,
    SkyTimeout,
    TeardownFailed,
)
from haru.provision.execs import Exec, SubprocessExec

__all__ = [
    "Placement",
    "Attempt",
    "ClusterStatus",
    "LaunchResult",
    "SkyPilot",
    "placements",
    "cluster_name",
    "agent_config",
    "task_config",
    "task_yaml",
    "provision_of",
    "serving_port",
    "is_capacity_error",
    "DEFAULT_SETUP",
    "DEFAULT_RUN",
    "DEFAULT_AGENT_PORT",
]

DEFAULT_AGENT_PORT = 8600
# Checks the agent is there. Haru is not installed from PyPI by name (the name `haru` there is another
# project's): the operator's `provision.setup` installs it (a wheel or a git checkout), or the image has it.
DEFAULT_SETUP = """command -v haru >/dev/null 2>&1 || {
  echo "haru is not installed on this host: set the domain's provision.setup to install it, or use an image with it" >&2
  exit 1
}
"""
# Writes the agent config (from $HARU_AGENT_CONFIG; "__HOME__" becomes the host's $HOME) and the
# NATS credentials (from the secret $HARU_AGENT_NATS_CREDS, when declared), then becomes the agent.
DEFAULT_RUN = """set -eu
mkdir -p "$HOME/.haru"
printf '%s\\n' "$HARU_AGENT_CONFIG" | sed "s|__HOME__|$HOME|g" > "$HOME/.haru/agent.json"
if [ -n "${HARU_AGENT_NATS_CREDS:-}" ]; then
  (umask 077 && printf '%s\\n' "$HARU_AGENT_NATS_CREDS" > "$HOME/.haru/agent.creds")
fi
exec haru agent --config "$HOME/.haru/agent.json" --log-format json
"""
CREDS_SECRET = "HARU_AGENT_NATS_CREDS"

_CAPACITY = re.compile(
    r"ResourcesUnavailableError|Failed to provision all possible launchable resources|InsufficientInstanceCapacity"
    r"|ZONE_RESOURCE_POOL_EXHAUSTED|insufficient capacity|out of capacity|capacity not available|quota exceeded"
    r"|QUOTA_EXCEEDED|not enough capacity",
    re.IGNORECASE,
)


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Where one launch attempt is pinned; empty fields are left to SkyPilot."""

    cloud: str = ""
    region: str = ""
    zone: str = ""

    def describe(self) -> str:
        return "/".join(p for p in (self.cloud, self.region, self.zone) if p) or "anywhere"


class Attempt(msgspec.Struct, frozen=True, kw_only=True):
    placement: Placement
    outcome: str  # launched | found | capacity | timeout | failed
    duration_s: float
    message: str = ""


class ClusterStatus(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    status: str  # SkyPilot's: INIT | UP | STOPPED
    region: str = ""
    resources: str = ""
    launched_at: int = 0


class LaunchResult(msgspec.Struct, frozen=True, kw_only=True):
    cluster: str
    placement: Placement
    attempts: list[Attempt]
    found: bool  # the cluster was already up: nothing was launched
    duration_s: float


def provision_of(spec: DomainSpec) -> ProvisionSpec:
    """The domain's provision block, or NotProvisionable saying what to declare."""
    if spec.provider == "static":
        raise NotProvisionable(
            f"domain {spec.name!r} is a static host: Haru does not launch or tear it down; "
            'set "provider": "skypilot" (or "skyserve") with a provision block to have it launched'
        )
    if spec.provision is None:
        raise NotProvisionable(
            f"domain {spec.name!r} is provider {spec.provider} but declares no provision block; "
            'add "provision": {"accelerators": "L4:1", "nats_url": "nats://...:4222", ...} '
            "(docs/provisioning.md) and `haru apply` the layout"
        )
    return spec.provision


def cluster_name(fleet: str, spec: DomainSpec, generation: str = "") -> str:
    """The cluster (or service) name: declared, else haru-<fleet>-<domain>; a replacement's ends in
    -r<generation> (six hex digits: the replace operation's)."""
    base = spec.provision.cluster if spec.provision and spec.provision.cluster else f"haru-{fleet}-{spec.name}"
    base = re.sub(r"[^a-z0-9-]", "-", base.lower()).strip("-")
    return f"{base}-r{generation}" if generation else base


def owns(fleet: str, spec: DomainSpec, name: str) -> bool:
    """Whether a cluster (or service) name is one of this domain's: its base name or a replacement's."""
    return re.fullmatch(re.escape(cluster_name(fleet, spec)) + r"(-r[0-9a-f]{6})?", name) is not None


def placements(spec: DomainSpec, *, avoid: tuple[str, ...] = ()) -> list[Placement]:
    """The placements a launch tries, in order: the declared zones, else the regions, else the domain's
    region, else anywhere. `avoid` (a failed domain's region) goes last rather than away."""
    p = provision_of(spec)
    if p.zones:
        out = [Placement(cloud=p.cloud, zone=z) for z in p.zones]
    elif p.regions:
        out = [Placement(cloud=p.cloud, region=r) for r in p.regions]
    elif spec.region:
        out = [Placement(cloud=p.cloud, region=spec.region)]
    else:
        out = [Placement(cloud=p.cloud)]
    if avoid:
        out = [x for x in out if x.region not in avoid and x.zone not in avoid] + [
            x for x in out if x.region in avoid or x.zone in avoid
        ]
    return out


def serving_port(spec: DomainSpec) -> int:
    p = provision_of(spec)
    if p.ports:
        return p.ports[0]
    if spec.serving_url:
        parsed = urlsplit(spec.serving_url)
        if parsed.port:
            return parsed.port
    return DEFAULT_AGENT_PORT


def agent_config(fleet: str, spec: DomainSpec) -> dict:
    """The agent config the launched host runs with (agents/config.py's shape)."""
    p = provision_of(spec)
    config: dict = {
        "fleet": fleet,
        "domain": spec.name,
        "nats_url": p.nats_url,
        "gpus": "nvml",
        "serving": {"host": "0.0.0.0", "port": serving_port(spec)},
        "role": "auto",
        "state_dir": "__HOME__/.haru/state",
    }
    if CREDS_SECRET in p.secrets:
        config["nats_creds"] = "__HOME__/.haru/agent.creds"
    return config


def task_config(fleet: str, spec: DomainSpec, placement: Placement | None = None, *, generation: str = "") -> dict:
    """The SkyPilot task for the domain, pinned to `placement` (default: the first one)."""
    p = provision_of(spec)
    placement = placement or placements(spec)[0]
    resources: dict = {}
    for key, value in (
        ("cloud", placement.cloud),
        ("region", placement.region),
        ("zone", placement.zone),
        ("accelerators", p.accelerators),
        ("cpus", p.cpus),
        ("memory", p.memory),
    ):
        if value:
            resources[key] = value
    resources["use_spot"] = p.use_spot
    if p.disk_size_gb:
        resources["disk_size"] = p.disk_size_gb
    if p.image_id:
        resources["image_id"] = p.image_id
    resources["ports"] = list(p.ports) or [serving_port(spec)]
    envs = dict(p.envs)
    envs["HARU_AGENT_CONFIG"] = json.dumps(agent_config(fleet, spec), separators=(",", ":"))
    task: dict = {
        "name": cluster_name(fleet, spec, generation),
        "resources": resources,
        "envs": envs,
    }
    if p.secrets:
        # Named, never valued: the values reach SkyPilot as `--secret NAME` from the launching environment.
        task["secrets"] = {name: None for name in p.secrets}
    task["setup"] = p.setup or DEFAULT_SETUP
    task["run"] = p.run or DEFAULT_RUN
    return task


def task_yaml(fleet: str, spec: DomainSpec, placement: Placement | None = None, *, generation: str = "") -> str:
    return yamltext.dump(task_config(fleet, spec, placement, generation=generation))


def is_capacity_error(output: str) -> bool:
    return bool(_CAPACITY.search(output))


def secret_env(p: ProvisionSpec, environ: Mapping[str, str]) -> dict[str, str]:
    """The declared secrets' values from the launching environment; SecretMissing names any absent."""
    missing = [name for name in p.secrets if name not in environ]
    if missing:
        raise SecretMissing(
            f"secret{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
            f"{'are' if len(missing) > 1 else 'is'} not set in the environment of the process that "
            "launches (the promoter, or this shell); export it there: the layout names secrets, "
            "it never holds their values"
        )
    return {name: environ[name] for name in p.secrets}


class SkyPilot:
    """`sky launch / status / down` through one injectable `Exec`, every command bounded."""

    def __init__(
        self,
        exec: Exec | None = None,
        *,
        sky: str | list[str] = "sky",
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 10.0,
    ) -> None:
        self.exec = exec or SubprocessExec()
        self.sky = [sky] if isinstance(sky, str) else list(sky)
        self.environ = os.environ if environ is None else environ
        self.clock = clock
        self.poll_s = poll_s  # how often an INIT cluster (a launch still running elsewhere) is looked at again

    async def status(self, cluster: str, *, timeout_s: float = 120) -> ClusterStatus | None:
        """The cluster as SkyPilot knows it, or None when it knows no such cluster."""
        for c in await self._status([cluster], timeout_s):
            if c.name == cluster:
                return c
        return None

    async def _status(self, names: list[str], timeout_s: float) -> list[ClusterStatus]:
        argv = [*self.sky, "status", "-o", "json", *names]
        result = await self.exec(argv, timeout_s=timeout_s)
        if result.returncode != 0:
            raise SkyFailed(result.summary("sky status"), argv=argv, returncode=result.returncode, output=result.output)
        try:
            records = json.loads(result.stdout)
        except ValueError:
            raise SkyFailed(
                f"sky status -o json printed no JSON: {result.stdout[:200]!r}",
                argv=argv,
                returncode=result.returncode,
                output=result.output,
            ) from None
        out = []
        for r in records if isinstance(records, list) else []:
            if isinstance(r, dict) and isinstance(r.get("name"), str) and r.get("status") not in (None, "TERMINATED"):
                out.append(
                    ClusterStatus(
                        name=r["name"],
                        status=str(r["status"]),
                        region=_region_of(r),
                        resources=str(r.get("resources_str") or ""),
                        launched_at=int(r.get("launched_at") or 0),
                    )
                )
        return out

    async def clusters(self, *, timeout_s: float = 120) -> list[ClusterStatus]:
        """Every cluster SkyPilot knows (`sky status -o json`)."""
        return await self._status([], timeout_s)

    async def launch(
        self,
        fleet: str,
        spec: DomainSpec,
        *,
        generation: str = "",
        avoid: tuple[str, ...] = (),
        on_attempt: Callable[[Attempt], None] | None = None,
    ) -> LaunchResult:
        """Launch the domain's cluster, trying each placement in order; found, not repeated, when up."""
        p = provision_of(spec)
        name = cluster_name(fleet, spec, generation)
        started = self.clock()
        attempts: list[Attempt] = []

        def record(a: Attempt) -> None:
            attempts.append(a)
            if on_attempt is not None:
                on_attempt(a)

        existing = await self.status(name, timeout_s=p.status_timeout_s)
        if existing is not None and existing.status == "INIT":
            # A launch of this cluster is under way (one started before a crash, whose `sky launch` runs
            # on): wait for it, within the launch bound, rather than launch the task a second time.
            deadline = self.clock() + p.launch_timeout_s
            while existing is not None and existing.status == "INIT" and self.clock() < deadline:
                await asyncio.sleep(self.poll_s)
                existing = await self.status(name, timeout_s=p.status_timeout_s)
            if existing is not None and existing.status != "UP":
                await self.down(name, timeout_s=p.down_timeout_s, status_timeout_s=p.status_timeout_s)
                existing = None
        elif existing is not None and existing.status != "UP":
            # STOPPED: not ours to restart half-configured; take it down and launch afresh
            await self.down(name, timeout_s=p.down_timeout_s, status_timeout_s=p.status_timeout_s)
            existing = None
        if existing is not None and existing.status == "UP":
            where = Placement(cloud=p.cloud, region=existing.region)
            record(
                Attempt(
                    placement=where,
                    outcome="found",
                    duration_s=0.0,
                    message=f"cluster {name} is already UP ({existing.resources or 'resources unknown'})",
                )
            )
            return LaunchResult(
                cluster=name, placement=where, attempts=attempts, found=True, duration_s=self.clock() - started
            )
        secrets = secret_env(p, self.environ)
        for placement in placements(spec, avoid=avoid):
            t0 = self.clock()
            try:
                await self._launch_once(name, fleet, spec, placement, generation, secrets, p.launch_timeout_s)
            except CapacityError as exc:
                record(Attempt(placement=placement, outcome="capacity", duration_s=self.clock() - t0, message=str(exc)))
            except SkyTimeout as exc:
                record(Attempt(placement=placement, outcome="timeout", duration_s=self.clock() - t0, message=str(exc)))
            except SkyFailed as exc:
                record(Attempt(placement=placement, outcome="failed", duration_s=self.clock() - t0, message=str(exc)))
                await self._clean_up(name, p)
                raise LaunchFailed(
                    f"launching {name} in {placement.describe()} failed, not for want of capacity, "
                    f"so no other placement was tried: {exc}",
                    attempts,
                ) from None
            else:
                record(Attempt(placement=placement, outcome="launched", duration_s=self.clock() - t0))
                return LaunchResult(
                    cluster=name, placement=placement, attempts=attempts, found=False, duration_s=self.clock() - started
                )
            await self._clean_up(name, p)
        tried = ", ".join(f"{a.placement.describe()} ({a.outcome})" for a in attempts)
        raise LaunchFailed(
            f"no placement launched {name}: tried {tried}; add regions or zones to the domain's "
            "provision block, or try again later",
            attempts,
        )

    async def _launch_once(
        self,
        name: str,
        fleet: str,
        spec: DomainSpec,
        placement: Placement,
        generation: str,
        secrets: dict[str, str],
        timeout_s: float,
    ) -> None:
        text = task_yaml(fleet, spec, placement, generation=generation)
        with tempfile.TemporaryDirectory(prefix="haru-sky-") as tmp:
            path = os.path.join(tmp, f"{name}.yaml")
            with open(path, "w") as fh:
                fh.write(text)
            argv = [*self.sky, "launch", "--yes", "--cluster", name, "--detach-run"]
            for secret in secrets:
                argv += ["--secret", secret]  # the value comes from the environment, never the argv
            argv.append(path)
            result = await self.exec(argv, timeout_s=timeout_s, env=secrets)
        if result.returncode == 0:
            return
        error = CapacityError if is_capacity_error(result.output) else SkyFailed
        raise error(
            result.summary(f"sky launch in {placement.describe()}"),
            argv=argv,
            returncode=result.returncode,
            output=result.output,
        )

    async def _clean_up(self, name: str, p: ProvisionSpec) -> None:
        """After a failed attempt: take down whatever it left, so the next placement starts clean."""
        if await self.status(name, timeout_s=p.status_timeout_s) is not None:
            await self.down(name, timeout_s=p.down_timeout_s, status_timeout_s=p.status_timeout_s)

    async def down(self, cluster: str, *, timeout_s: float = 900, status_timeout_s: float = 120) -> bool:
        """Tear the cluster down. False when SkyPilot already knew no such cluster; TeardownFailed when
        `sky down` fails (the cluster may still be running and billed)."""
        if await self.status(cluster, timeout_s=status_timeout_s) is None:
            return False
        argv = [*self.sky, "down", "--yes", cluster]
        result = await self.exec(argv, timeout_s=timeout_s)
        if result.returncode != 0:
            raise TeardownFailed(
                result.summary("sky down") + f"; cluster {cluster} may still be running: check `sky status {cluster}`",
                argv=argv,
                returncode=result.returncode,
                output=result.output,
            )
        return True

    async def cost(self, cluster: str, *, timeout_s: float = 120) -> float | None:
        """What SkyPilot's cost report says the cluster has cost so far (USD), or None when it does not say."""
        report = await self.cost_report(cluster, timeout_s=timeout_s)
        return float(report.total) if report is not None else None

    async def cost_report(self, cluster: str, *, timeout_s: float = 120) -> ClusterCost | None:
        """The cluster's line of SkyPilot's cost report: `total_cost` (USD) over `duration` (seconds; 0 when
        the report gives none), or None when the report does not list the cluster with a cost."""
        argv = [*self.sky, "cost-report", "-o", "json"]
        result = await self.exec(argv, timeout_s=timeout_s)
        if result.returncode != 0:
            return None
        try:
            records = json.loads(result.stdout)
        except ValueError:
            return None
        for r in records if isinstance(records, list) else []:
            if isinstance(r, dict) and r.get("name") == cluster:
                return cost_of_record(r)
        return None


def cost_of_record(record: dict) -> ClusterCost | None:
    """One cost-report record as a `ClusterCost` (None without a numeric, non-negative `total_cost`)."""
    value = record.get("total_cost")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        return None
    duration = record.get("duration")
    seconds = float(duration) if isinstance(duration, (int, float)) and not isinstance(duration, bool) else 0.0
    return ClusterCost(cluster=str(record.get("name", "")), total=repr(float(value)), seconds=max(seconds, 0.0))


def _region_of(record: dict) -> str:
    """The region a status record's cluster runs in, from the task YAML it was created with."""
    text = record.get("last_creation_yaml") or ""
    m = re.search(r"^\s*region:\s*\"?([A-Za-z0-9_.-]+)\"?\s*$", str(text), re.MULTILINE)
    return m.group(1) if m else ""
