"""What Haru started on each GPU: each runtime's and trainer's process tree, with what the plan gave it.

The GPU watcher (agents/gpu_watch.py) accounts a GPU's processes against these owners. Built from the
host's model slots (the mapping agents/model_slots.py keeps), its training slots and its slots now, so it
needs neither the watcher nor the parts that use the watcher.
"""

from __future__ import annotations

from collections.abc import Mapping

from haru.agents.current import CurrentSlots
from haru.agents.gpu import Owner, process_tree, read_parents
from haru.agents.model_slot import ModelSlot
from haru.agents.training_slots import TrainingSlots
from haru.core.specs import model_gpus

__all__ = ["Owners"]


class Owners:
    def __init__(self, models: Mapping[str, ModelSlot], training: TrainingSlots, current: CurrentSlots) -> None:
        """`models`: the host's model slots by name, as they are now (the model slots' own mapping)."""
        self.models = models
        self.training = training
        self.current = current

    def __call__(self, index: int) -> list[Owner]:
        """What Haru started on GPU `index`: each runtime's and trainer's process tree, with its plan.

        A sleeping runtime is planned at the policy's sleep residual (what sleep should leave behind)."""
        parents = read_parents()
        residual = self.current.policy().sleep_residual_bytes
        out: list[Owner] = []
        for m in self.models.values():
            if index not in model_gpus(m.spec) or m.runtime.kind == "external":
                continue
            pid = m.runtime.pid if m.runtime.alive() else None
            asleep = m.runtime.can_sleep and m.state_tag == "sleeping"
            planned = min(residual, m.spec.vram_bytes) if asleep else m.spec.vram_bytes
            out.append(
                Owner(
                    name=m.name,
                    kind="model",
                    pids=process_tree({pid} if pid else set(), parents),
                    planned_bytes=planned,
                )
            )
        for slot, t in self.training.trainers.items():
            if t.spec.gpu_index != index:
                continue
            roots = set(t.group_pids()) | ({t.pid} if t.running() and t.pid else set())
            out.append(
                Owner(name=slot, kind="training", pids=process_tree(roots, parents), planned_bytes=t.spec.vram_bytes)
            )
        return out
