"""One model's verbs, as a command asks them of its supervisor: sleep, wake and probe.

A sleep is verified by /is_sleeping and then by what it freed (a paused engine that freed nothing is
woken again and never put to sleep after); a wake by /is_sleeping, a one-token completion and the greedy
answers recorded before the sleep (agents/wake_check.py). What each found is recorded through the
supervisor's context, under the model's lock, so a verb and the supervisor's own loop never interleave.
`freed_by_sleep`/`freed_on_gpus` are the pure measure of what a sleep freed.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from haru.agents import probes
from haru.agents.errors import OutOfMemory, RuntimeProblem, SleepFreedNothing, WakeAnswerChanged
from haru.agents.gpu import GpuReading, process_tree, read_parents
from haru.agents.model_slot import RUNTIME_STOP_GRACE_S
from haru.agents.observe import Answered, Slept, StillAsleep, WakeBegun
from haru.agents.ports import Outcome

if TYPE_CHECKING:
    from haru.agents.supervisor import ModelSupervisor

__all__ = ["SleepWake", "freed_by_sleep", "freed_on_gpus"]


class SleepWake:
    def __init__(self, supervisor: ModelSupervisor) -> None:
        """`supervisor`: the model's, whose context, lock and diagnosis the verbs share."""
        self.s = supervisor

    async def sleep_one(self, level: int) -> None:
        """Put a resident runtime to sleep (caller holds m.lock). Verified through /is_sleeping, then by
        what it freed: a sleep that measurably freed nothing is a paused engine, not a sleeping one. It
        is woken again (it stays resident), the runtime is known not to sleep from then on, and
        SleepFreedNothing is raised. Before it sleeps, its greedy answers are recorded for the wake."""
        m = self.s.m
        await self.s.wake_check.record(
            m.runtime, (m.name, *m.spec.adapters, *m.runtime_adapters), self.s.ctx.policy().probe_timeout_ms / 1000
        )
        pid = m.runtime.pid
        tree = process_tree({pid}, read_parents()) if pid else frozenset()
        before = [self.s.ctx.gpu.read(i) for i in self.s.gpus]  # a tensor-parallel model: each of its GPUs
        await m.runtime.sleep(level, self.s.ctx.policy().wake_timeout_ms / 1000)
        after = [self.s.ctx.gpu.read(i) for i in self.s.gpus]
        freed, measured_by, detail = freed_on_gpus(before, after, tree)
        if measured_by and freed <= 0:
            try:
                await m.runtime.wake(self.s.ctx.policy().wake_timeout_ms / 1000)
            except RuntimeProblem as exc:
                self.s.logger.warning("a sleep that freed nothing could not be undone", error=str(exc))
            never = getattr(m.runtime, "never_sleeps", None)
            if never is not None:
                never(f"a sleep freed nothing ({detail})")
            raise SleepFreedNothing(
                f"{m.name}: /is_sleeping said asleep but the sleep freed nothing ({detail}): the "
                f"engine was paused, not asleep; it was woken again, stays resident, and is no "
                f"longer put to sleep"
            )
        await self.s.ctx.record(
            m, Slept(**self.s.ctx.about(m), level=level, freed_bytes=freed, measured_by=measured_by, detail=detail)
        )

    async def sleep(self, level: int) -> Outcome:
        """Idempotent sleep."""
        m = self.s.m
        if not m.runtime.can_sleep:
            return Outcome(ok=True, detail=f"a {m.runtime.kind} runtime has no sleep mode; it stays {m.state_tag}")
        async with m.lock:
            if self.s.gpu_went_away():
                # A runtime may well answer /sleep on a GPU that is gone; its weights are not in VRAM to free.
                await self.s.gpu_gone("the GPU went away; asked to sleep")  # the table: no news if already lost
                return Outcome(
                    ok=False,
                    code="gpu_detached",
                    detail=f"GPU {self.s.read_gpu().index} is gone (the provider took it): "
                    f"{m.name} is lost, not asleep",
                )
            tag = m.state_tag
            if tag == "sleeping":
                try:
                    if await m.runtime.is_sleeping() is True:
                        return Outcome(ok=True, detail="already asleep")
                except RuntimeProblem as exc:
                    return Outcome(ok=False, code=exc.code, detail=str(exc))
            elif tag not in ("resident", "waking"):
                return Outcome(
                    ok=False,
                    code="not_resident",
                    detail=f"{m.name} is {tag}; only a resident model can be put to sleep",
                )
            try:
                await self.sleep_one(level)
            except RuntimeProblem as exc:
                return Outcome(ok=False, code=exc.code, detail=str(exc))
            return Outcome(ok=True, detail="asleep (verified by /is_sleeping)")

    async def wake(self) -> Outcome:
        """Idempotent wake, verified by /is_sleeping and a real one-token completion (`took_ms`)."""
        m = self.s.m
        started = time.monotonic()
        timeout = self.s.ctx.policy().probe_timeout_ms / 1000
        async with m.lock:
            tag = m.state_tag
            if tag == "resident" or not m.runtime.can_sleep:
                if tag != "resident":
                    return Outcome(ok=False, code="not_resident", detail=f"{m.name} is {tag}", took_ms=0)
                probe = await probes.ready(m.runtime, timeout_s=timeout)
                if probe.ok:
                    return Outcome(
                        ok=True,
                        detail="already awake; probe answered",
                        took_ms=int((time.monotonic() - started) * 1000),
                    )
                return Outcome(
                    ok=False,
                    code="probe_failed",
                    detail=f"awake but the probe failed at {probe.step}: {probe.detail}",
                    took_ms=0,
                )
            if tag not in ("sleeping", "waking"):
                return Outcome(
                    ok=False, code="not_sleeping", detail=f"{m.name} is {tag}; there is nothing to wake", took_ms=0
                )
            await self.s.ctx.record(m, WakeBegun(**self.s.ctx.about(m)))  # sleeping -> waking; a retried wake: no news
            gen = m.generation
            try:
                await m.runtime.wake(self.s.ctx.policy().wake_timeout_ms / 1000)
            except OutOfMemory as exc:
                await self.after_failed_wake(gen)
                return Outcome(
                    ok=False, code="out_of_memory", detail=str(exc), took_ms=int((time.monotonic() - started) * 1000)
                )
            except RuntimeProblem as exc:
                await self.after_failed_wake(gen)
                return Outcome(
                    ok=False, code=exc.code, detail=str(exc), took_ms=int((time.monotonic() - started) * 1000)
                )
            probe = await probes.ready(m.runtime, timeout_s=timeout)
            took = int((time.monotonic() - started) * 1000)
            if gen != m.generation or m.exited.is_set():
                return Outcome(
                    ok=False, code="process_exited", detail=f"{m.name}'s runtime exited while waking", took_ms=took
                )
            if not probe.ok:
                code = "out_of_memory" if "out of memory" in probe.detail.lower() else "probe_failed"
                await self.after_failed_wake(gen, probe=probe)
                return Outcome(
                    ok=False,
                    code=code,
                    detail=f"woke but the probe failed at {probe.step}: {probe.detail}",
                    took_ms=took,
                )
            if self.s.ctx.restore_adapters is not None and m.spec.max_loras:
                # vLLM drops run-time adapters on a deep sleep (and may reload them lazily on first use): load
                # what is missing now, so the check below asks each adapter its own question on a warm engine
                held = await self.s.ctx.restore_adapters(m)
                self.s.wake_check.keep_only({m.name, *m.spec.adapters, *held})
            checked = self.s.wake_check.armed
            changed = await self.s.wake_check.changed(m.runtime, self.s.ctx.policy().probe_timeout_ms / 1000)
            took = int((time.monotonic() - started) * 1000)
            if changed:
                await self.wrong_after_wake(gen, changed)
                return Outcome(
                    ok=False,
                    code=WakeAnswerChanged.code,
                    detail=f"woke and answers, but not as before it slept: {changed}; it is reloaded",
                    took_ms=took,
                )
            m.last_probe = probe
            await self.s.ctx.record(
                m,
                Answered(
                    **self.s.ctx.about(m), endpoint=m.runtime.base_url, sleeps=m.runtime.can_sleep, warmup_ms=took
                ),
            )
            m.resident_at = time.monotonic()
            answers = (
                "the greedy answers recorded before the sleep"
                if checked
                else "no greedy answer to compare: none was kept from before it slept"
            )
            return Outcome(
                ok=True,
                detail=f"awake (verified by /is_sleeping, a probe in {probe.latency_ms} ms and {answers})",
                took_ms=took,
            )

    async def probe(self) -> Outcome:
        """A real one-token completion of a resident model (`latency_ms`); a failed one is news: the
        supervisor's diagnosis records it now."""
        m = self.s.m
        if m.state_tag != "resident":
            return Outcome(ok=False, code="not_resident", detail=f"{m.name} is {m.state_tag}")
        p = await probes.ready(m.runtime, timeout_s=self.s.ctx.policy().probe_timeout_ms / 1000)
        if p.ok:
            return Outcome(ok=True, detail=f"answered in {p.latency_ms} ms", latency_ms=p.latency_ms)
        await self.s.check()
        return Outcome(ok=False, code="probe_failed", detail=f"{p.step}: {p.detail}")

    async def after_failed_wake(self, gen: int, probe: probes.Probe | None = None) -> None:
        """Record the truth after a wake failed: still asleep, or lost (and why)."""
        m = self.s.m
        if gen != m.generation or m.exited.is_set() or m.state_tag != "waking":
            return
        try:
            asleep = await m.runtime.is_sleeping()
        except RuntimeProblem:
            asleep = None
        if asleep is True:
            await self.s.ctx.record(m, StillAsleep(**self.s.ctx.about(m), level=1))
            return
        gpu = self.s.read_gpu()
        holds = await probes.holds_model(m.runtime, min(self.s.ctx.policy().probe_timeout_ms / 1000, 5.0))
        reason = probes.diagnose(process_alive=self.s.m.process_alive(), gpu=gpu, runtime_holds_model=holds)
        if reason != "process_exited":
            detail = f"wake failed: {probe.step}: {probe.detail}" if probe else "wake failed"
            await self.s.lost(reason, detail[:500])

    async def wrong_after_wake(self, gen: int, changed: str) -> None:
        """A woken runtime that answers differently from before its sleep (a LoRA adapter no longer
        applied, a stale cache): lost{unhealthy} in those words, never resident, and stopped so the
        supervisor reloads it from its files (caller holds m.lock)."""
        m = self.s.m
        self.s.wake_check.forget()
        if gen != m.generation or m.exited.is_set():
            return
        await self.s.lost("unhealthy", f"{WakeAnswerChanged.code}: {changed}"[:500])
        m.on_purpose = True
        await m.runtime.stop(RUNTIME_STOP_GRACE_S)
        m.exited.set()


def freed_by_sleep(before: GpuReading, after: GpuReading, tree: frozenset[int]) -> tuple[int, str, str]:
    """What a sleep freed: (bytes, measured_by, detail). Pure.

    "process": NVML's per-process memory of the runtime's process tree (vLLM's engine runs in a child
    process), when the GPU accounted for every process and the tree held memory before; "gpu": the
    whole GPU's used memory, when it answers but processes cannot be told apart; "": nothing could
    measure (no NVML, a GPU that did not answer), and the detail says so."""
    if before.present and after.present and before.accounted and after.accounted:
        held = sum(p.used_bytes for p in before.processes if p.pid in tree)
        if held > 0:
            still = sum(p.used_bytes for p in after.processes if p.pid in tree)
            return max(0, held - still), "process", f"its processes held {held} bytes before the sleep, {still} after"
    if before.present and after.present:
        return (
            max(0, before.memory_used_bytes - after.memory_used_bytes),
            "gpu",
            f"the GPU's used memory went from {before.memory_used_bytes} to {after.memory_used_bytes} bytes",
        )
    return 0, "", "not measured: no GPU reading on this host (no NVML), so what the sleep freed is unknown"


def freed_on_gpus(before: list[GpuReading], after: list[GpuReading], tree: frozenset[int]) -> tuple[int, str, str]:
    """What a sleep freed across every GPU a model spans (one for most): the sum of `freed_by_sleep` on
    each; measured only when every GPU was (else the detail says which could not be). Pure."""
    each = [freed_by_sleep(b, a, tree) for b, a in zip(before, after, strict=True)]
    if len(each) == 1:
        return each[0]
    if any(not how for _, how, _ in each):
        return 0, "", "; ".join(f"GPU {b.index}: {d}" for b, (_, _, d) in zip(before, each, strict=True))
    how = "process" if all(h == "process" for _, h, _ in each) else "gpu"
    return (
        sum(f for f, _, _ in each),
        how,
        "; ".join(f"GPU {b.index}: {d}" for b, (_, _, d) in zip(before, each, strict=True)),
    )
