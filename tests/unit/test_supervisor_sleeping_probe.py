"""The periodic probe of a sleeping model whose process has died: the exit is the exit waiter's to record
(`process_exited`, with the exit status), once. The probe that found /health dead in the same moment records
nothing, or the log would say `model_lost` twice for one death (CI saw it: a SIGKILLed standby's runtime)."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
import structlog

from haru.agents.gpu import GpuReading
from haru.agents.load_queue import LoadQueue
from haru.agents.model_slot import ModelSlot
from haru.agents.runtimes.base import Health
from haru.agents.supervisor import ModelSupervisor
from haru.core.residency import Sleeping
from haru.core.specs import ModelSpec

pytestmark = pytest.mark.timeout(10)


class _Runtime:
    kind = "vllm"
    can_sleep = True
    base_url = "http://127.0.0.1:1"

    def __init__(self, *, alive: bool) -> None:
        self._alive = alive
        self.pid = None

    def alive(self) -> bool:
        return self._alive

    async def health(self, *, timeout_s: float) -> Health:
        return Health(ok=False, status=0, detail="connection refused")

    async def is_sleeping(self, *, timeout_s: float) -> bool:
        return True


def _supervised(*, alive: bool) -> tuple[ModelSupervisor, list[Any]]:
    spec = ModelSpec(name="m", slot="s", gpu_index=0, vram_bytes=1 << 30, runtime="vllm")
    m = ModelSlot(spec, _Runtime(alive=alive), "haru.evt.f.a.model.m")  # type: ignore[arg-type]
    m.state = Sleeping(level=1)
    recorded: list[Any] = []

    async def record(_m: ModelSlot, observation: Any) -> Any:
        recorded.append(observation)
        return observation

    ctx: Any = SimpleNamespace(
        record=record,
        about=lambda _m: {"at": datetime.now(UTC), "domain": "a", "model": "m"},
        gpu=SimpleNamespace(read=lambda i: GpuReading(index=i, present=True)),
        policy=lambda: SimpleNamespace(probe_timeout_ms=1000),
        files=SimpleNamespace(write_wake_answers=lambda *_a: None),
        loads=LoadQueue(),
        logger=structlog.get_logger("test"),
        stopping=lambda: False,
    )
    return ModelSupervisor(m, ctx), recorded


async def test_a_sleeping_models_dead_process_is_left_to_the_exit_waiter():
    supervisor, recorded = _supervised(alive=False)
    assert await supervisor.check() is False
    assert recorded == []


async def test_a_sleeping_model_whose_live_process_fails_health_is_lost_unhealthy():
    supervisor, recorded = _supervised(alive=True)
    assert await supervisor.check() is False
    assert [(type(o).__name__, o.reason) for o in recorded] == [("ProbeFailed", "unhealthy")]
