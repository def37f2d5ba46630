"""The event the current work answers, per task: a leaf the agent's units share.

`COMMAND_CAUSE` holds the `step_started` sequence of the command a request task runs
(haru.core.commands.Command.cause), or the loss a restart answers: what the residency and training events
recorded in that task cite (haru.core.causes). The command service sets it per request task.
"""

from __future__ import annotations

import contextvars

__all__ = ["COMMAND_CAUSE", "VERSION"]

COMMAND_CAUSE: contextvars.ContextVar[int] = contextvars.ContextVar("haru_command_cause", default=0)
VERSION = "0.1.0"  # the agent's version, in agent_started and the command service's metadata
