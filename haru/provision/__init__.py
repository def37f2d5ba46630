"""Provisioning: launch and tear down `provider: skypilot | skyserve` domains through the `sky` CLI.

    skypilot.py   a domain as a SkyPilot task YAML; `sky launch / status / down` (SkyPilot)
    skyserve.py   a domain as a SkyServe service YAML; `sky serve up / status / down` (SkyServe)
    execs.py      the one seam to the CLI: run an argv with a bound (`Exec`, `SubprocessExec`)
    yamltext.py   the YAML writer
    errors.py     ProvisionError and its tree

Static domains are never provisioned: Haru neither launches nor tears down a host it did not make.
"""

from haru.provision.errors import (CapacityError, LaunchFailed, NotProvisionable, ProvisionError, SecretMissing,
                                   SkyFailed, SkyTimeout, SkyUnavailable, TeardownFailed)
from haru.provision.execs import Exec, ExecResult, SubprocessExec
from haru.provision.skypilot import (Attempt, ClusterStatus, LaunchResult, Placement, SkyPilot, agent_config,
                                     cluster_name, placements, provision_of, task_config, task_yaml)
from haru.provision.skyserve import ServeResult, ServiceStatus, SkyServe, service_config, service_yaml

__all__ = [
    "ProvisionError", "NotProvisionable", "SecretMissing", "SkyUnavailable", "SkyTimeout", "SkyFailed",
    "CapacityError", "LaunchFailed", "TeardownFailed",
    "Exec", "ExecResult", "SubprocessExec",
    "Placement", "Attempt", "ClusterStatus", "LaunchResult", "SkyPilot", "agent_config", "cluster_name",
    "placements", "provision_of", "task_config", "task_yaml",
    "ServiceStatus", "ServeResult", "SkyServe", "service_config", "service_yaml",
    "submitted_yaml",
]


def submitted_yaml(fleet: str, spec, *, generation: str = "") -> str:
    """What `haru provision --dry-run` prints: the task YAML (skypilot, first placement) or the service YAML."""
    provision_of(spec)
    if spec.provider == "skyserve":
        return service_yaml(fleet, spec, generation=generation)
    return task_yaml(fleet, spec, generation=generation)
