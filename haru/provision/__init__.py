"""Provisioning: launch and tear down `provider: skypilot | skyserve` domains through the `sky` CLI.

    skypilot.py   a domain as a SkyPilot task YAML; `sky launch / status / down` (SkyPilot)
    skyserve.py   a domain as a SkyServe service YAML; `sky serve up / status / down` (SkyServe)
    execs.py      the one seam to the CLI: run an argv with a bound (`Exec`, `SubprocessExec`)
    yamltext.py   the YAML of the files Haru submits (PyYAML)
    errors.py     ProvisionError and its tree

Static domains are never provisioned: Haru neither launches nor tears down a host it did not make.
"""

from haru.provision.errors import (
    CapacityError,
    LaunchFailed,
    NotProvisionable,
    ProvisionError,
    SecretMissing,
    SkyFailed,
    SkyTimeout,
    SkyUnavailable,
    TeardownFailed,
)
from haru.provision.execs import Exec, ExecResult, SubprocessExec
from haru.provision.skypilot import (
    Attempt,
    ClusterStatus,
    LaunchResult,
    Placement,
    SkyPilot,
    agent_config,
    cluster_name,
    placements,
    provision_of,
    task_config,
    task_yaml,
)
from haru.provision.skyserve import ServeResult, ServiceStatus, SkyServe, service_config, service_yaml

__all__ = [
    "ProvisionError",
    "NotProvisionable",
    "SecretMissing",
    "SkyUnavailable",
    "SkyTimeout",
    "SkyFailed",
    "CapacityError",
    "LaunchFailed",
    "TeardownFailed",
    "Exec",
    "ExecResult",
    "SubprocessExec",
    "Placement",
    "Attempt",
    "ClusterStatus",
    "LaunchResult",
    "SkyPilot",
    "agent_config",
    "cluster_name",
    "placements",
    "provision_of",
    "task_config",
    "task_yaml",
    "ServiceStatus",
    "ServeResult",
    "SkyServe",
    "service_config",
    "service_yaml",
    "submitted_yaml",
    "dry_run_text",
]


def submitted_yaml(fleet: str, spec, *, generation: str = "") -> str:
    """What `haru provision --dry-run` prints: the task YAML (skypilot, first placement) or the service YAML."""
    provision_of(spec)
    if spec.provider == "skyserve":
        return service_yaml(fleet, spec, generation=generation)
    return task_yaml(fleet, spec, generation=generation)


def dry_run_text(kind: str, fleet: str, spec, *, generation: str = "") -> str:
    """What `haru <kind> --dry-run` prints: for provision, the YAML; for teardown, the sky commands;
    for replace, both, in the order the operation runs them."""
    from haru.provision.skypilot import cluster_name

    provision_of(spec)
    name = cluster_name(fleet, spec)
    if spec.provider == "skyserve":
        down = (
            f"# teardown: every service of domain {spec.name} that `sky serve status` lists\n"
            f"sky serve down --yes {name}   # and {name}-r<generation> for a replacement\n"
        )
    else:
        down = (
            f"# teardown: every cluster of domain {spec.name} that `sky status -o json` lists\n"
            f"sky down --yes {name}   # and {name}-r<generation> for a replacement\n"
        )
    if kind == "teardown":
        return down
    verb = (
        "sky serve up --yes --service-name"
        if spec.provider == "skyserve"
        else "sky launch --yes --detach-run --cluster"
    )
    secrets = "".join(f" --secret {s}" for s in spec.provision.secrets)
    target = f"{name}-r<generation>" if kind == "replace" else name
    head = f"# {verb} {target}{secrets} <this file>\n"
    body = submitted_yaml(fleet, spec, generation=generation)
    return (down + "\n" if kind == "replace" else "") + head + body
