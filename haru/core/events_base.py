"""The envelope every event carries (`Event`, documented in `haru.core.events`) and the literal types
several events share. Import events from `haru.core.events`, which re-exports these.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec

__all__ = ["Event", "LostReason", "SCHEMA_VERSION", "Step", "StopHow"]


SCHEMA_VERSION = 1

LostReason = Literal["evicted", "gpu_detached", "process_exited", "unhealthy"]
StopHow = Literal["exited", "terminated", "killed"]
Step = Literal[
    "stop_training",
    "verify_gpu",
    "wake",
    "probe",
    "flip",
    "settle_old_active",
    "sleep",
    "start_training",
    "apply_standby",
    "apply_old_active",
    "launch",
    "join",
    "settle",
    "down",
    "weigh",
    "canary",
]


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """The envelope shared by every event."""

    v: int = SCHEMA_VERSION
    at: datetime
    by: str = ""
    cause: int = 0
    prev: str = ""
