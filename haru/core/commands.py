"""Commands to agents and heartbeats from them: core NATS, not history.

Commands go over request/reply on `haru.cmd.<fleet>.<domain>.<verb>` (a `nats.micro` service per
agent, so `$SRV.PING` finds them). Every command is idempotent, carries the operation id and the
route revision it was decided against, and gets a typed `Reply`. No responders = the agent is gone.

Verbs: status, sleep, wake, probe, stop_training, start_training, verify_gpu, apply_layout.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

import msgspec

Verb = Literal["status", "sleep", "wake", "probe", "stop_training", "start_training", "verify_gpu", "apply_layout"]


class Command(msgspec.Struct, frozen=True, kw_only=True):
    op_id: str = ""
    route_revision: int = 0
    models: list[str] = []  # restrict to these models ('' = all the domain's admitted models)
    slots: list[str] = []  # restrict to these training slots (all when empty)
    level: int = 1  # sleep level
    step: str = ""  # the operation's step this command carries out
    cause: int = 0  # the stream sequence of that step's `step_started`: what the agent's events cite
    decl_seq: int = 0  # apply_layout: the declarations (haru.evt.<fleet>.decl) up to this sequence, at least
    # stop_training: once training stopped, read the GPUs as verify_gpu does and answer that reply too, in
    # data["verify_gpu"] (the promoter records it as the verify_gpu step that follows: one trip, not two)
    then_verify: bool = False


class ErrorInfo(msgspec.Struct, frozen=True, kw_only=True):
    code: str  # e.g. out_of_memory, probe_failed, gpu_busy, gpu_detached, not_sleeping, timeout
    message: str


class Reply(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    detail: str = ""
    took_ms: int = 0
    error: ErrorInfo | None = None
    data: dict[str, Any] = {}  # verb-specific facts (status: models and states; verify_gpu: free bytes)


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True):
    """Published on `haru.hb.<fleet>.<domain>` every second; a one-line summary, not history."""

    fleet: str
    domain: str
    at: datetime
    summary: str = ""
    models: dict[str, str] = {}  # model -> state name
    training: list[str] = []  # running training slots
    pid: int = 0


command_encoder = msgspec.json.Encoder()
command_decoder = msgspec.json.Decoder(Command)
reply_decoder = msgspec.json.Decoder(Reply)
heartbeat_decoder = msgspec.json.Decoder(Heartbeat)
