"""Events of every type built with chosen identity fields (fleet, domain, model, slot, writer): what the
authority tests hand to the subject and permission checks.
"""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec

from haru.core import events as ev
from haru.core.specs import Policy

T = datetime(2026, 11, 30, tzinfo=UTC)


def build(
    cls: type,
    *,
    fleet: str = "default",
    domain: str = "a",
    model: str = "qwen3.6:27b",
    index: int = 0,
    slot: str = "lora",
    by: str = "",
) -> ev.Event:
    """An event of type `cls` whose identity fields (where it has them) are the ones given."""
    spec: dict = {}
    if cls in (ev.DomainDeclared, ev.DomainChanged):
        spec = {"name": domain}
    elif cls in (ev.ModelDeclared, ev.ModelChanged):
        spec = {"name": model, "slot": slot, "gpu_index": index}
    elif cls in (ev.TrainingDeclared, ev.TrainingChanged):
        spec = {"slot": slot, "gpu_index": index, "command": ["train"], "checkpoint_dir": "/ck"}
    fields = {
        "type": cls.__struct_config__.tag, "at": T, "by": by, "fleet": fleet, "domain": domain, "model": model,
        "index": index, "slot": slot, "policy": msgspec.to_builtins(Policy()), "spec": spec, "name": model,
        "gpu_index": index, "admitted": True, "vram_bytes": 1, "reason": "unhealthy", "runtime_said": "no",
        "present": True, "pid": 1, "how": "exited", "op_id": "op-1", "target": domain, "step": "wake", "why": "x",
        "eligible": True, "active": domain, "reference": "ollama:library/qwen3:0.6b", "upto": 1, "source": domain,
        "base_model": model, "adapter": "a", "version": "run-1", "object_name": "o", "digest": "sha256:00",
        "size_bytes": 1, "rank": 8, "state": "resident",
        "gateway": "gw",
    }  # fmt: skip
    return msgspec.convert(fields, cls)
