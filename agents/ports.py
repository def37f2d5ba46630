"""What the agent's outer units see of the agent: narrow interfaces and named results.

The command service (agents/commands.py) and the serving port (agents/serving.py) are handed an object
that satisfies `CommandTarget` / `ServingTarget` (the Agent does); they import nothing from
agents/agent.py, so the agent package's imports are acyclic (agent -> commands -> ports, agent ->
serving -> ports). What a verb does comes back as a named struct (`Outcome`, `GpuVerdict`), never as a
positional tuple.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgspec

from haru.core.commands import Command, ErrorInfo

if TYPE_CHECKING:
    from agents.gpu import GpuReading
    from agents.model_slot import ModelSlot
    from agents.training import Ended, Trainer
    from haru.core.specs import Policy

__all__ = ["Outcome", "GpuVerdict", "Selection", "CommandTarget", "ServingTarget"]


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
    data: dict = {}


class GpuVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """verify_gpu's answer: ok, the first problem as the reply's error, and what was read, per GPU."""

    ok: bool
    error: ErrorInfo | None = None
    data: dict = {}


class Selection(msgspec.Struct, frozen=True, kw_only=True):
    """The models a command names (all admitted ones when it names none), and the names this domain lacks."""

    models: list = []  # list[ModelSlot]
    unknown: list[str] = []


class CommandTarget(Protocol):
    """What the command service asks of the agent."""

    fleet: str
    domain: str
    host: str
    pid: int

    @property
    def models(self) -> Mapping[str, "ModelSlot"]: ...
    @property
    def trainers(self) -> Mapping[str, "Trainer"]: ...
    @property
    def policy(self) -> "Policy": ...

    def status_data(self) -> dict: ...
    def selected(self, command: Command) -> Selection: ...
    async def sleep_model(self, m: "ModelSlot", level: int) -> Outcome: ...
    async def wake_model(self, m: "ModelSlot") -> Outcome: ...
    async def probe_model(self, m: "ModelSlot") -> Outcome: ...
    async def stop_training_slot(self, slot: str) -> "Ended | None": ...
    async def start_training_slot(self, slot: str, *, force: bool = False) -> Outcome: ...
    async def refresh_route(self, revision: int) -> None: ...
    async def verify_gpus(self, models: list["ModelSlot"]) -> GpuVerdict: ...
    async def apply_declared(self, decl_seq: int, timeout_s: float) -> Applied: ...


class ServingTarget(Protocol):
    """What the serving port asks of the agent."""

    fleet: str
    domain: str
    state_dir: Path

    @property
    def models(self) -> Mapping[str, "ModelSlot"]: ...
    @property
    def policy(self) -> "Policy": ...
    @property
    def keep_runtimes(self) -> bool: ...

    def read_gpu(self, index: int) -> "GpuReading": ...
    def recheck(self, m: "ModelSlot") -> None: ...
