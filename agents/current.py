"""The host's slots as they are now: what the layout gives this host, changed only by a layout applied live.

Built before the parts that read it (the role's first domain, the supervisors' policy, the load order,
the GPUs to watch), so none of them needs the live apply (agents/live_apply.py), which is the one that
moves it on.
"""

from __future__ import annotations

from haru.agents.config import HostSlots
from haru.core.specs import Policy

__all__ = ["CurrentSlots"]


class CurrentSlots:
    def __init__(self, slots: HostSlots) -> None:
        self.slots = slots

    def policy(self) -> Policy:
        """The fleet's policy, as declared now."""
        return self.slots.policy

    def first_domain(self) -> str:
        """The fleet's first declared domain (active until a route_moved says otherwise)."""
        return self.slots.first_domain

    def model_order(self) -> list[str]:
        """The admitted models in declaration order (the order cold loads take their GPU's turn)."""
        return [spec.name for spec in self.slots.admitted_models]

    def gpu_indexes(self) -> list[int]:
        """Every GPU this host's slots name."""
        return self.slots.gpu_indexes()

    def probe_interval_s(self) -> float:
        return self.slots.policy.probe_interval_ms / 1000

    def gpu_memory_bytes(self) -> dict[int, int]:
        """Each declared GPU's memory, by index."""
        return {g.index: g.memory_bytes for g in self.slots.domain.spec.gpus}
