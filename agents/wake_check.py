"""The proof that a wake is correct, not only alive: before a runtime sleeps, the greedy, fixed-seed
answer of the model and of each LoRA adapter to a fixed prompt is recorded; after the wake the same
questions are asked again, and any different answer is `wake_answer_changed` (a dropped adapter, a
stale prefix cache, wrong weights). Kept in the agent's memory: a runtime adopted asleep by a
restarted agent is woken without this check (its reply says so)."""

from __future__ import annotations

from typing import Any

from haru.agents.errors import RuntimeProblem


class WakeCheck:
    """One model's recorded answers: `record` before a sleep, `changed` after the wake."""

    def __init__(self) -> None:
        self.answers: dict[str, str] = {}  # the model's served name, then each adapter -> its answer

    @property
    def armed(self) -> bool:
        return bool(self.answers)

    @staticmethod
    async def answers_now(runtime: Any, names: tuple[str, ...], timeout_s: float) -> dict[str, str]:
        return {name: await runtime.greedy_answer(name, timeout_s) for name in names}

    async def record(self, runtime: Any, names: tuple[str, ...], timeout_s: float) -> None:
        """Before a sleep: remember what the model and each adapter (`names`) answer now."""
        self.answers = await self.answers_now(runtime, names, timeout_s)

    async def changed(self, runtime: Any, timeout_s: float) -> str:
        """After a wake: "" if the runtime answers as it did before it slept (or nothing was recorded),
        else what differs. Forgets the recorded answers either way: a wake is checked once."""
        if not self.answers:
            return ""
        before, self.answers = self.answers, {}
        try:
            now = await self.answers_now(runtime, tuple(before), timeout_s)
        except RuntimeProblem as exc:
            return f"the greedy check could not be repeated: {exc}"
        return "; ".join(f"{name}: {before[name]!r} before the sleep, {now.get(name)!r} after the wake"
                         for name in before if now.get(name) != before[name])

    def forget(self) -> None:
        self.answers = {}
