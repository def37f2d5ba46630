"""One admitted model on this host, as the agent's units share it: its runtime, its residency as
recorded, its lock. A data holder: the supervisor (agents/agent.py) changes it, the command service and
the serving port read it."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from haru.agents import probes
from haru.agents.runtimes import Runtime
from haru.core.residency import UNKNOWN, Residency, state_name
from haru.core.specs import ModelSpec, model_gpus
from haru.host.procfs import dying

__all__ = ["ModelSlot", "RUNTIME_STOP_GRACE_S"]

RUNTIME_STOP_GRACE_S = 15.0  # a runtime stopped on purpose: SIGTERM to its group, SIGKILL after this


class ModelSlot:
    """One admitted model on this host: its runtime, its residency as recorded, its lock."""

    def __init__(self, spec: ModelSpec, runtime: Runtime, subject: str) -> None:
        self.spec = spec
        self.runtime = runtime
        self.subject = subject
        self.seq = 0  # the subject's last sequence, as this agent knows it
        self.state: Residency = UNKNOWN
        self.lock = asyncio.Lock()  # state-changing work: supervisor transitions, sleep, wake
        self.append_lock = asyncio.Lock()
        self.generation = 0  # bumped per spawn; an exit of an older generation is old news
        self.attempt = 0
        self.failures = 0
        self.resident_at = 0.0
        self.exited = asyncio.Event()
        self.exit_code: int | None = None
        self.on_purpose = False  # the agent is stopping this runtime itself
        self.settled = asyncio.Event()  # the first load attempt has come to rest
        self.probe_ms = 0
        self.last_probe: probes.Probe | None = None
        # LoRA adapters loaded at run time (agents/adapters.py): runtime name -> its directory; the wake
        # check asks each its own question.
        self.runtime_adapters: dict[str, str] = {}

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def state_tag(self) -> str:
        return state_name(self.state)

    def process_alive(self) -> bool:
        """The runtime's process lives and is not already carrying out its exit. A SIGKILLed vLLM closes
        its sockets (a probe or a request reads a reset) tens of ms before the exit waiter sees it exit:
        what failed then is the exit, recorded as process_exited by the waiter, never as unhealthy."""
        if not self.runtime.alive():
            return False
        pid = self.runtime.pid
        return not (pid and dying(pid))


def awake_on(models: Mapping[str, ModelSlot], gpu_index: int) -> list[str]:
    """Models on GPU `gpu_index` that can sleep and are not asleep (training there would fight them for VRAM)."""
    return [
        m.name
        for m in models.values()
        if gpu_index in model_gpus(m.spec) and m.runtime.can_sleep and m.state_tag in ("resident", "loading", "waking")
    ]
