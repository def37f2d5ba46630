"""Envoy by file-based dynamic configuration: the cluster's endpoints (EDS) in a file Envoy watches.

The cluster names the file as its EDS source:

    clusters:
    - name: haru_default
      type: EDS
      eds_cluster_config:
        eds_config: {path_config_source: {path: /etc/envoy/haru_default.eds.yaml}, resource_api_version: V3}

The follower writes the whole ClusterLoadAssignment (haru.core.router_plans.envoy_eds) to a temporary
file beside it and renames it over the path: Envoy reloads on the rename. Whether Envoy took it is
Envoy's to say (its admin `/clusters` page); the follower reports the file written.
"""

from __future__ import annotations

from pathlib import Path

from haru.core.router_plans import Plan, envoy_eds
from haru.routers.files import replace_atomically

__all__ = ["Envoy"]


class Envoy:
    kind = "envoy"

    def __init__(self, path: Path, cluster: str) -> None:
        self.path = path
        self.cluster = cluster

    def describe(self) -> str:
        return f"Envoy cluster {self.cluster} (EDS file {self.path})"

    async def apply(self, plan: Plan, intent: bytes, *, again: bool) -> None:
        replace_atomically(self.path, envoy_eds(plan, self.cluster))
