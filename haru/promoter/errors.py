"""The promoter's exceptions. A leaf module: it imports nothing from the package.

    PromoterError (haru.core.errors.HaruError)
    └── OperationNotFound   an operation id that the fleet's op subject never saw (`haru op <id>`)  (operator)

Everything else the promoter meets is already in `haru.core.errors`: a lost race is `Conflict` (the
promoter re-reads and decides again), an agent that does not answer is `AgentGone`.
"""

from __future__ import annotations

from haru.core.errors import HaruError


class PromoterError(HaruError):
    """Base of every error the promoter raises on purpose."""


class OperationNotFound(PromoterError):
    """No operation with that id on the fleet's op subject."""

    def __init__(self, fleet: str, op_id: str) -> None:
        self.fleet = fleet
        self.op_id = op_id
        super().__init__(f"no operation {op_id!r} in fleet {fleet!r}; list them with `haru op --fleet {fleet}`")
