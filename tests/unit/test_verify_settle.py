"""verify_gpu polls within a bounded settle window while the memory a stopped trainer held comes back."""

from __future__ import annotations

from haru.agents.gpu_verdict import settled
from haru.agents.ports import GpuVerdict
from haru.core.commands import ErrorInfo

BUSY = GpuVerdict(ok=False, error=ErrorInfo(code="gpu_busy", message="GPU 0 has 2 bytes free; need 8"), data={})


def verdicts(*seq: GpuVerdict):
    reads = list(seq)
    seen = {"observed": 0}

    async def observe() -> None:
        seen["observed"] += 1

    def judge() -> GpuVerdict:
        return reads.pop(0) if len(reads) > 1 else reads[0]

    return observe, judge, seen


async def test_memory_released_a_moment_late_is_waited_for_and_the_time_said():
    observe, judge, seen = verdicts(BUSY, BUSY, GpuVerdict(ok=True, data={"gpus": {}}))
    v = await settled(observe, judge, settle_s=5.0, poll_s=0.01)
    assert v.ok and v.data["reads"] == 3 and seen["observed"] == 3
    assert 0 <= v.data["settle_ms"] < 5000 and v.data["settle_bound_ms"] == 5000


async def test_memory_never_released_fails_after_the_window_saying_so():
    observe, judge, _ = verdicts(BUSY)
    v = await settled(observe, judge, settle_s=0.05, poll_s=0.01)
    assert not v.ok and v.error.code == "gpu_busy" and v.data["reads"] >= 2
    assert "settle window, verify_settle_ms" in v.error.message and v.data["settle_ms"] >= 50


async def test_training_still_running_or_a_gone_gpu_is_not_waited_for():
    for code in ("training_running", "gpu_detached"):
        observe, judge, seen = verdicts(GpuVerdict(ok=False, error=ErrorInfo(code=code, message="x"), data={}))
        v = await settled(observe, judge, settle_s=5.0, poll_s=0.01)
        assert not v.ok and seen["observed"] == 1 and v.error.message == "x"
