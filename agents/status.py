"""What the agent says of itself: the `status` answer, the heartbeat and the GPUs' verdict.

Read from the agent's parts as they are now; nothing here changes them. `verify_gpus` observes the
models' GPUs first (recording what changed), then judges the readings (agents/gpu_verdict.py).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Protocol

import msgspec

from haru.agents.gpu import GpuReading
from haru.agents.gpu_verdict import gpus_of, judge_gpus, settled
from haru.agents.gpu_watch import GpuWatcher
from haru.agents.heartbeat import heartbeat_of
from haru.agents.live_apply import LiveApply
from haru.agents.model_slot import ModelSlot
from haru.agents.model_slots import ModelSlots
from haru.agents.ports import GpuVerdict, Identity
from haru.agents.role import Role
from haru.agents.training_slots import TrainingSlots
from haru.core.commands import Heartbeat
from haru.host.procfs import pid_alive

__all__ = ["Status", "ServingPort"]


def _now() -> datetime:
    return datetime.now(UTC)


class ServingPort(Protocol):
    @property
    def listening_url(self) -> str:
        """The serving port's URL ("" until it listens)."""
        ...


class Status:
    def __init__(
        self,
        identity: Identity,
        *,
        role: Role,
        live: LiveApply,
        models: ModelSlots,
        training: TrainingSlots,
        gpu_watch: GpuWatcher,
        serving: ServingPort | None,
    ) -> None:
        """`serving`: the serving port (None when this host has none: `serve: direct`, or disabled)."""
        self.identity = identity
        self.fleet, self.domain, self.host, self.pid = identity.fleet, identity.domain, identity.host, identity.pid
        self.role = role
        self.live = live
        self.models = models
        self.training = training
        self.gpu_watch = gpu_watch
        self.serving = serving

    def heartbeat(self) -> Heartbeat:
        return heartbeat_of(
            fleet=self.fleet,
            domain=self.domain,
            role=self.role.now,
            models={name: m.state_tag for name, m in self.models.models.items()},
            training=self.training.running(),
            pid=self.pid,
            at=_now(),
        )

    def data(self) -> dict[str, Any]:
        """The `status` verb's data: role, models and their states, training, GPUs."""
        slots = self.live.slots
        return {
            "fleet": self.fleet,
            "domain": self.domain,
            "role": self.role.now,
            "active_domain": self.role.active(),
            "route_revision": self.role.revision,
            "pid": self.pid,
            "host": self.host,
            "serving_url": self.serving.listening_url if self.serving is not None else "",
            "source": slots.source,
            "models": {name: _model(m) for name, m in self.models.models.items()},
            # changes applied live that wait for this domain to be the standby (they would interrupt a model
            # it serves as the active domain)
            "pending_layout": sorted(self.live.pending),
            "not_admitted": dict(slots.not_admitted),
            "training": {slot: _trainer(t) for slot, t in self.training.trainers.items()},
            "gpus": {str(index): self._gpu(self.gpu_watch.read(index)) for index in slots.gpu_indexes()},
        }

    def _gpu(self, r: GpuReading) -> dict[str, Any]:
        usage, foreign = self.gpu_watch.accounting(r)
        return {
            "present": r.present,
            "name": r.name,
            "memory_total_bytes": r.memory_total_bytes,
            "memory_used_bytes": r.memory_used_bytes,
            "memory_free_bytes": r.memory_free_bytes,
            "processes": [p.pid for p in r.processes],
            "mig": r.mig,
            "accounted": r.accounted,
            "usage": msgspec.to_builtins(usage),
            "foreign": msgspec.to_builtins(foreign),
        }

    async def verify_gpus(self, models: list[ModelSlot]) -> GpuVerdict:
        """Observe each of the models' GPUs (recording what changed) and judge them, again within the
        settle window while memory is not released yet (agents/gpu_verdict.py `settled`)."""

        async def observe() -> None:
            for index in gpus_of(models):
                await self.gpu_watch.observe(index)

        def judge() -> GpuVerdict:
            readings = {index: self.gpu_watch.read(index) for index in gpus_of(models)}
            return judge_gpus(
                models,
                self.training.trainers,
                readings,
                residual_bytes=self.live.slots.policy.sleep_residual_bytes,
                pid_alive=pid_alive,
            )

        return await settled(observe, judge, settle_s=self.live.slots.policy.verify_settle_ms / 1000)


def _model(m: ModelSlot) -> dict[str, Any]:
    st = msgspec.to_builtins(m.state)
    since = getattr(m.state, "since", None)
    return {
        "state": m.state_tag,
        "since": st.get("since"),
        "for_ms": int((_now() - since).total_seconds() * 1000) if since is not None else 0,
        "seq": m.seq,
        "reason": st.get("reason", ""),
        "detail": st.get("detail", ""),
        "runtime": m.runtime.kind,
        "endpoint": m.runtime.base_url,
        "pid": m.runtime.pid if m.runtime.alive() else None,
        "gpu_index": m.spec.gpu_index,
        "attempt": m.attempt,
        "vram_bytes": m.spec.vram_bytes,
    }


def _trainer(t: Any) -> dict[str, Any]:
    ended = t.ended
    return {
        "running": t.running(),
        "pid": t.pid,
        "gpu_index": t.spec.gpu_index,
        "ran_ms": t.ran_ms() if t.running() else (ended.ran_ms if ended else 0),
        "last_stop": None if ended is None else {"how": ended.how, "exit_code": ended.exit_code},
    }
