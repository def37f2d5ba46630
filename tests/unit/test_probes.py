"""The readiness probe's order of verdicts, whether its steps run one after the other (a serving
runtime: nothing reaches a paused engine) or the listing and the completion together (a loading one)."""

from __future__ import annotations

import asyncio

import pytest

from haru.agents import probes
from haru.agents.errors import ProbeUnanswered, RuntimeUnreachable
from haru.agents.runtimes.base import Health


class Spec:
    name = "m1"


class FakeRuntime:
    spec = Spec()

    def __init__(
        self,
        *,
        listed=("m1",),
        completion_error: str = "",
        models_error: str = "",
        sleeping=False,
        completion_s: float = 0.0,
    ) -> None:
        self.listed, self.completion_error, self.models_error = list(listed), completion_error, models_error
        self.sleeping, self.completion_s = sleeping, completion_s
        self.asked: list[str] = []
        self.in_flight = self.most_in_flight = 0

    async def _call(self, seconds: float) -> None:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(seconds)
        finally:
            self.in_flight -= 1

    async def health(self, timeout_s: float = 5.0) -> Health:
        self.asked.append("health")
        return Health(ok=True, status=200)

    async def list_models(self, timeout_s: float = 5.0) -> list[str]:
        self.asked.append("models")
        await self._call(0.01)
        if self.models_error:
            raise RuntimeUnreachable(self.models_error)
        return self.listed

    async def is_sleeping(self, timeout_s: float = 5.0) -> bool:
        self.asked.append("sleeping")
        return self.sleeping

    async def probe_completion(self, timeout_s: float) -> int:
        self.asked.append("completion")
        await self._call(self.completion_s)
        if self.completion_error:
            raise ProbeUnanswered(self.completion_error)
        return int(self.completion_s * 1000)


@pytest.mark.parametrize("check_sleep", [True, False])
async def test_a_model_not_listed_is_reported_as_such_even_when_its_completion_failed_too(check_sleep):
    rt = FakeRuntime(listed=("other",), completion_error="404 no such model")
    p = await probes.ready(rt, timeout_s=1, check_sleep=check_sleep)  # type: ignore[arg-type]
    assert (p.ok, p.step) == (False, "listed") and "does not list 'm1'" in p.detail
    assert ("completion" in rt.asked) is (not check_sleep)  # asked together only while loading
    p = await probes.ready(
        FakeRuntime(models_error="no answer", completion_error="x"), timeout_s=1, check_sleep=check_sleep
    )  # type: ignore[arg-type]
    assert (p.ok, p.step, p.detail) == (False, "models", "no answer")


async def test_a_serving_runtime_is_asked_whether_it_sleeps_before_any_completion():
    rt = FakeRuntime(sleeping=True)
    p = await probes.ready(rt, timeout_s=1)  # type: ignore[arg-type]
    assert (p.ok, p.step, p.sleeping) == (False, "sleeping", True)
    assert rt.asked == ["health", "models", "sleeping"]  # no completion was sent to the paused engine


async def test_a_loading_runtime_gets_the_listing_and_the_completion_together_and_the_probe_says_each_steps_time():
    rt = FakeRuntime(completion_s=0.05)
    p = await probes.ready(rt, timeout_s=1, check_sleep=False)  # type: ignore[arg-type]
    assert p.ok and sorted(rt.asked) == ["completion", "health", "models"] and rt.most_in_flight == 2  # together
    assert p.completion_ms >= 45 and p.models_ms >= 9 and p.health_ms >= 0
    serving = FakeRuntime(completion_s=0.05)
    assert (await probes.ready(serving, timeout_s=1)).ok  # type: ignore[arg-type]
    assert serving.asked == ["health", "models", "sleeping", "completion"] and serving.most_in_flight == 1
    failed = await probes.ready(FakeRuntime(completion_error="503 still warming"), timeout_s=1, check_sleep=False)  # type: ignore[arg-type]
    assert (failed.ok, failed.step, failed.detail) == (False, "completion", "503 still warming")
