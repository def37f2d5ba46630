"""What the agent's verbs answer: named results, shared by the parts that do a verb and the command
service (agents/commands.py) that words the reply. What a verb does comes back as a named struct
(`Outcome`, `Applied`, `GpuVerdict`, `Selection`), never as a positional tuple.
"""

from __future__ import annotations

from typing import Any

import msgspec

from haru.core.commands import ErrorInfo

__all__ = ["Outcome", "Applied", "GpuVerdict", "Selection", "Identity"]


class Identity(msgspec.Struct, frozen=True, kw_only=True):
    """Which agent this is: its fleet and domain, and the host and pid it runs as."""

    fleet: str
    domain: str
    host: str
    pid: int


class Outcome(msgspec.Struct, frozen=True, kw_only=True):
    """What one verb did to one model or training slot. `code` is the reply's error code when not ok;
    `took_ms` how long a wake took; `latency_ms` how long a probe's completion took."""

    ok: bool
    code: str = ""
    detail: str = ""
    took_ms: int = 0
    latency_ms: int = 0


class Applied(msgspec.Struct, frozen=True, kw_only=True):
    """The `apply_layout` verb's answer: whether the host now runs the declarations, the reply's error
    code when not, what was done (`detail`), and `data` (the sequence applied, each model's state)."""

    ok: bool
    code: str = ""
    detail: str = ""
    data: dict[str, Any] = {}


class GpuVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """verify_gpu's answer: ok, the first problem as the reply's error, and what was read, per GPU."""

    ok: bool
    error: ErrorInfo | None = None
    data: dict[str, Any] = {}


class Selection(msgspec.Struct, frozen=True, kw_only=True):
    """The models a command names (all admitted ones when it names none), and the names this domain lacks."""

    models: list[Any] = []  # list[ModelSlot]
    unknown: list[str] = []
