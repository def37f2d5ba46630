"""The agent's exceptions. A leaf module: it imports nothing from `agents`.

AgentError                     (haru.core.errors.HaruError)
├── AgentRefused               another agent already runs this domain                     (operator)
├── IllegalObservation         the agent's decision table has no entry for what it saw     (a bug here)
├── RuntimeProblem             a runtime (vLLM, llama-server, external) misbehaved
│   ├── RuntimeUnreachable     its HTTP port does not answer (not up yet, crashed, hung)
│   ├── RuntimeRefused         it answered with an error status; carries status and body
│   │   └── OutOfMemory        CUDA out of memory (a wake with the VRAM taken by someone else)
│   ├── ProbeUnanswered        a one-token completion did not answer as it must
│   └── Unverified             it said 200 but the truth (/is_sleeping) disagrees
├── TrainingProblem            a training command could not be started            (operator)
└── RuntimeBuildFailed         llama-server could not be found or built (`agents.runtimes.llama_build`)
"""

from __future__ import annotations

from haru.core.errors import HaruError


class AgentError(HaruError):
    """Base of everything the agent raises on purpose."""


class AgentRefused(AgentError):
    """A second agent for a domain that already has one: refused so two writers never share a history."""


class IllegalObservation(AgentError):
    """The agent saw something its decision table (agents/observe.py) has no entry for in the model's
    recorded state: writing anyway would append a history the fleet refuses. The agent's own bug."""

    code = "illegal_transition"

    def __init__(self, model: str, state: str, observation: str) -> None:
        self.model = model
        self.state = state
        self.observation = observation
        super().__init__(
            f"the agent has no residency event for `{observation}` of model {model!r} recorded `{state}`: "
            f"nothing is written (the pair is not in agents/observe.py DECISIONS; a writer skipped a step)"
        )


class RuntimeProblem(AgentError):
    """A runtime did not do what was asked. `code` is the reply error code commands report."""

    code = "runtime_error"


class RuntimeUnreachable(RuntimeProblem):
    code = "runtime_unreachable"


class RuntimeRefused(RuntimeProblem):
    code = "runtime_refused"

    def __init__(self, message: str, *, status: int = 0, body: str = "") -> None:
        self.status = status
        self.body = body
        super().__init__(message)


class OutOfMemory(RuntimeRefused):
    code = "out_of_memory"


class ProbeUnanswered(RuntimeProblem):
    code = "probe_failed"


class Unverified(RuntimeProblem):
    """A 200 that the runtime's own state contradicts (slept but /is_sleeping is false, ...)."""

    code = "unverified"


class SleepFreedNothing(RuntimeProblem):
    """The runtime said it sleeps, but the memory it held did not drop: it is paused, not asleep (a
    vLLM without sleep mode on its platform pauses its scheduler and keeps every byte)."""

    code = "sleep_freed_nothing"


class WakeAnswerChanged(RuntimeProblem):
    """After a wake, the greedy fixed-seed answer to the fixed prompt (the model's, or an adapter's)
    differs from the one recorded before it slept: the runtime answers, but wrongly."""

    code = "wake_answer_changed"


class PortHolderError(AgentError):
    """The serving port's holder (agents/portholder.py) could not be started or reached."""


class TrainingProblem(AgentError):
    code = "training_failed"


class RuntimeBuildFailed(AgentError):
    """llama-server could not be found or built; the message names the step and the fix."""

    code = "runtime_build_failed"
