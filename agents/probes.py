"""Probes: the real signals residency is made of.

    ready(runtime)      -> Probe    health passes, /v1/models lists the model, a one-token completion
                                    answers (and, for vLLM, /is_sleeping is false: asked first, so
                                    no completion is ever sent to a paused engine, which holds it)
    diagnose(...)       -> reason   why a failed probe failed: the one-bit rule of
                                    `haru.core.residency.classify_probe_failure` fed with what we can see

A probe never decides what to do about a failure; the agent does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

import msgspec

from haru.agents.errors import RuntimeProblem
from haru.agents.gpu import GpuReading
from haru.agents.runtimes.base import Runtime
from haru.core.events import LostReason
from haru.core.residency import classify_probe_failure

__all__ = ["Probe", "ready", "holds_model", "diagnose"]

T = TypeVar("T")


class Probe(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    step: str = (
        ""  # which check failed: health | models (no answer) | listed (answered without it) | sleeping | completion
    )
    detail: str = ""
    latency_ms: int = 0
    sleeping: bool | None = None
    # where the probe's time went (ms, to 0.1): the loading path logs them with the first answer
    health_ms: float = 0.0
    models_ms: float = 0.0
    completion_ms: float = 0.0


async def ready(runtime: Runtime, *, timeout_s: float, check_sleep: bool = True) -> Probe:
    """The full check: health, listed, not sleeping, and a real one-token completion. Without
    `check_sleep` (a loading runtime, which nothing can have paused yet) the listing and the completion
    are asked together, so the first answer costs one round trip less; a failure is still reported at
    the first step that failed, in this order."""
    t0 = time.perf_counter()
    health = await runtime.health(timeout_s=min(timeout_s, 5.0))
    if not health.ok:
        return Probe(ok=False, step="health", detail=health.detail or f"/health answered {health.status}")
    health_ms = _ms(time.perf_counter() - t0)
    completion: asyncio.Task[tuple[int | RuntimeProblem, float]] | None = None
    if not check_sleep:
        completion = asyncio.ensure_future(_timed(runtime.probe_completion(timeout_s)))
    listed, models_ms = await _timed(runtime.list_models(timeout_s=min(timeout_s, 5.0)))
    try:
        if isinstance(listed, RuntimeProblem):  # no answer is not evidence of an eviction
            return Probe(ok=False, step="models", detail=str(listed))
        if runtime.spec.name not in listed:
            return Probe(
                ok=False, step="listed", detail=f"/v1/models does not list {runtime.spec.name!r} (it lists {listed})"
            )
        sleeping: bool | None = None
        if check_sleep:  # a vLLM that cannot sleep is still asked: a paused one would hold the completion
            try:
                sleeping = await runtime.is_sleeping(timeout_s=min(timeout_s, 5.0))
            except RuntimeProblem as exc:
                return Probe(ok=False, step="sleeping", detail=str(exc))
            if sleeping:
                return Probe(ok=False, step="sleeping", detail="/is_sleeping says it sleeps", sleeping=True)
            completion = asyncio.ensure_future(_timed(runtime.probe_completion(timeout_s)))
        assert completion is not None
        latency, completion_ms = await completion
    finally:
        if completion is not None and not completion.done():
            completion.cancel()
    if isinstance(latency, RuntimeProblem):
        return Probe(ok=False, step="completion", detail=str(latency), sleeping=sleeping)
    return Probe(
        ok=True,
        latency_ms=latency,
        sleeping=sleeping,
        health_ms=health_ms,
        models_ms=models_ms,
        completion_ms=completion_ms,
    )


async def _timed(step: Awaitable[T]) -> tuple[T | RuntimeProblem, float]:
    """A probe step's answer (or the RuntimeProblem it raised) and how long it took, in ms."""
    started = time.perf_counter()
    try:
        answer: T | RuntimeProblem = await step
    except RuntimeProblem as exc:
        answer = exc
    return answer, _ms(time.perf_counter() - started)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


async def holds_model(runtime: Runtime, timeout_s: float = 5.0) -> bool:
    """Does the runtime still list the model? An unanswered question counts as yes (it is not evidence
    of an eviction: a hung server is `unhealthy`, not `evicted`)."""
    try:
        return runtime.spec.name in await runtime.list_models(timeout_s=timeout_s)
    except RuntimeProblem:
        return True


def diagnose(*, process_alive: bool, gpu: GpuReading | None, runtime_holds_model: bool) -> LostReason:
    return classify_probe_failure(process_alive, None if gpu is None else gpu.present, runtime_holds_model)
