"""The `pulling` residency state: progress keeps the pull's start, `haru status` shows bytes, routers wait."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from haru.core import events as ev
from haru.core.residency import UNKNOWN, Pulling, answer, evolve
from haru.core.views import ModelView
from haru.projections.status import model_state

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def pulling(ms: int, done: int, total: int = 100 << 20) -> ev.ModelPulling:
    return ev.ModelPulling(
        at=T0 + timedelta(milliseconds=ms),
        domain="a",
        model="m",
        reference="qwen3:0.6b",
        done_bytes=done,
        total_bytes=total,
    )


def test_progress_keeps_since_and_status_shows_bytes():
    s = evolve(UNKNOWN, pulling(0, 0), seq=1)
    s = evolve(s, pulling(5000, 40 << 20), seq=2)
    assert isinstance(s, Pulling) and s.since == T0 and s.done_bytes == 40 << 20 and s.seq == 2
    text = model_state(ModelView(name="m", admitted=True, residency=s), T0 + timedelta(seconds=47))
    assert text == "pulling qwen3:0.6b 40.0 MiB of 100.0 MiB for 47s"
    a = answer(s, T0 + timedelta(seconds=2))
    assert (a.answer, a.reason, a.for_ms) == ("warming", "pulling", 2000)


def test_a_failed_pull_is_failed_and_a_retry_pulls_again():
    s = evolve(
        evolve(UNKNOWN, pulling(0, 0), seq=1),
        ev.ModelFailed(at=T0, domain="a", model="m", runtime_said="pull qwen3:0.6b: not found (404)"),
        seq=2,
    )
    assert s.runtime_said.endswith("not found (404)")
    assert isinstance(evolve(s, pulling(9000, 0), seq=3), Pulling)
    loading = evolve(evolve(s, pulling(9000, 0), seq=3), ev.ModelLoading(at=T0, domain="a", model="m"), seq=4)
    assert type(loading).__name__ == "Loading"
