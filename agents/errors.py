"""The agent's exceptions. A leaf module: it imports nothing from `agents`.

    AgentError                     (haru.errors.HaruError)
    ├── AgentRefused               another agent already runs this domain                     (operator)
    ├── RuntimeProblem             a runtime (vLLM, llama-server, external) misbehaved
    │   ├── RuntimeUnreachable     its HTTP port does not answer (not up yet, crashed, hung)
    │   ├── RuntimeRefused         it answered with an error status; carries status and body
    │   │   └── OutOfMemory        CUDA out of memory (a wake with the VRAM taken by someone else)
    │   ├── ProbeFailed            a one-token completion did not answer as it must
    │   └── Unverified             it said 200 but the truth (/is_sleeping) disagrees
    ├── TrainingProblem            a training command could not be started            (operator)
    └── RuntimeBuildFailed         llama-server could not be found or built (`agents.runtimes.llama_build`)
"""

from __future__ import annotations

from haru.errors import HaruError


class AgentError(HaruError):
    """Base of everything the agent raises on purpose."""


class AgentRefused(AgentError):
    """A second agent for a domain that already has one: refused so two writers never share a history."""


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


class ProbeFailed(RuntimeProblem):
    code = "probe_failed"


class Unverified(RuntimeProblem):
    """A 200 that the runtime's own state contradicts (slept but /is_sleeping is false, ...)."""

    code = "unverified"


class PortHolderError(AgentError):
    """The serving port's holder (agents/portholder.py) could not be started or reached."""


class TrainingProblem(AgentError):
    code = "training_failed"


class RuntimeBuildFailed(AgentError):
    """llama-server could not be found or built; the message names the step and the fix."""

    code = "runtime_build_failed"
