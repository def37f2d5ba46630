"""The envelope every event carries (`Event`, documented in `haru.core.events`) and the literal types
several events share. Import events from `haru.core.events`, which re-exports these.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec

__all__ = ["Event", "LostRange", "LostReason", "SCHEMA_VERSION", "Step", "StopHow"]


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


class LostRange(msgspec.Struct, frozen=True, kw_only=True):
    """Acknowledged events the log no longer holds on one subject (`log_regressed`,
    `domain_log_regressed`): the writer was acknowledged stream sequence `acknowledged` there, whose
    body hashed to `expected` (sha256 hex); the log now holds the subject only up to `held` (0: none of
    what the writer knew). `reason`: behind (the subject ends earlier) or rewritten (the sequence
    holds another body or another subject's event)."""

    subject: str
    acknowledged: int
    held: int
    reason: Literal["behind", "rewritten"]
    expected: str = ""
