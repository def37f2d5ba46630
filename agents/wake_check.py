"""The proof that a wake is correct, not only alive: before a runtime sleeps, the greedy, fixed-seed
answer of the model and of each LoRA adapter to a fixed prompt is recorded; after the wake the same
questions are asked again, and any different answer is `wake_answer_changed` (a dropped adapter, a
stale prefix cache, wrong weights).

The answers belong to the runtime process that gave them, so they are kept where that process's
identity is: its identity file in the agent's state directory (`wake_answers`, agents/runtime_files.py),
written when they are recorded and cleared once the wake is checked. An agent restarted while the
runtime sleeps adopts it with them, and still checks the wake; one restarted after the wake and
before its check finds the runtime awake with them, and checks it before adopting it; a new process (a restart, a
reload) gets a new identity file without them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from haru.agents.errors import RuntimeProblem

__all__ = ["WakeCheck"]


class WakeCheck:
    """One model's recorded answers: `record` before a sleep, `changed` after the wake. `keep` is
    called with the answers each time they change ({} = none), to persist them."""

    def __init__(
        self, answers: Mapping[str, str] | None = None, keep: Callable[[dict[str, str]], None] | None = None
    ) -> None:
        self.answers: dict[str, str] = dict(answers or {})  # the model's served name, then each adapter -> its answer
        self._keep = keep

    @property
    def armed(self) -> bool:
        return bool(self.answers)

    def _set(self, answers: dict[str, str]) -> None:
        self.answers = answers
        if self._keep is not None:
            self._keep(dict(answers))

    @staticmethod
    async def answers_now(runtime: Any, names: tuple[str, ...], timeout_s: float) -> dict[str, str]:
        return {name: await runtime.greedy_answer(name, timeout_s) for name in names}

    async def record(self, runtime: Any, names: tuple[str, ...], timeout_s: float) -> None:
        """Before a sleep: remember what the model and each adapter (`names`) answer now."""
        self._set(await self.answers_now(runtime, names, timeout_s))

    async def changed(self, runtime: Any, timeout_s: float) -> str:
        """After a wake: "" if the runtime answers as it did before it slept (or nothing was recorded),
        else what differs. Forgets the recorded answers either way: a wake is checked once."""
        if not self.answers:
            return ""
        before = self.answers
        try:
            now = await self.answers_now(runtime, tuple(before), timeout_s)
        except RuntimeProblem as exc:
            return f"the greedy check could not be repeated: {exc}"
        finally:
            self._set({})
        return "; ".join(
            f"{name}: {before[name]!r} before the sleep, {now.get(name)!r} after the wake"
            for name in before
            if now.get(name) != before[name]
        )

    def keep_only(self, names: set[str]) -> None:
        """Forget the answers of what is no longer served (an adapter version unloaded while it slept)."""
        if any(n not in names for n in self.answers):
            self._set({n: a for n, a in self.answers.items() if n in names})

    def forget(self) -> None:
        if self.answers:
            self._set({})
