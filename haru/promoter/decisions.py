"""What the decider returns and what it is told: plain frozen values, no behaviour."""

from __future__ import annotations

from datetime import datetime

import msgspec

from haru.core.events import AnyEvent
from haru.core.weights import Tally


class Append(msgspec.Struct, frozen=True, kw_only=True):
    """Append `event` on `subject`, expecting the subject's last sequence as the service folded it.

    A `step_started` that the service appends successfully is a step for it to run.
    """

    subject: str
    event: AnyEvent
    why: str = ""


class Facts(msgspec.Struct, frozen=True, kw_only=True):
    """What the decider cannot read from the view.

    `silent_ms`:     per domain, ms since its last heartbeat; None = not heard since listening began.
    `listening_ms`:  how long this promoter has listened to heartbeats (no verdict of silence before
                     one heartbeat timeout has passed).
    `most_heard_ms`: ms since this promoter last heard most of the promoters it knows (itself included);
                     None = it cannot tell (fewer than three known). Silence it measured after that
                     moment may be its own isolation, not the domain's: it is no evidence.
    `running`:       (op_id, step, attempt) this process is executing now.
    `step_by`:       who appended the operation's latest `step_started` (the service keeps it).
    `me`:            this promoter's writer id. A started step written by `me` that `me` is not running
                     is from before a restart: it is re-started at once, without waiting for its lease.
    `runner_silent_ms`: ms since the promoter named by `step_by` was last heard on haru.host.alive
                     (haru/host/alive.py); None = not heard since listening began.
    `runner_timeout_ms`: silence after which that promoter is taken for dead: its started step is
                     re-started at once instead of after the step's lease.
    `new_op_id`:     the id for an operation this call may request.
    `launches_last_hour`: launch steps started in the fleet in the last hour (the service counts them).
    `canary`:        the gateways' canary reports of the window, summed (haru.promoter.canary.tally).
    """

    now: datetime
    me: str = ""
    new_op_id: str = ""
    silent_ms: dict[str, int | None] = {}
    listening_ms: int = 0
    most_heard_ms: int | None = None
    running: frozenset[tuple[str, str, int]] = frozenset()
    step_by: str = ""
    runner_silent_ms: int | None = None
    runner_timeout_ms: int = 0  # 0: runners are never judged by silence, only by their lease
    launches_last_hour: int = 0  # `launch` steps started in this fleet in the last hour (policy max_launches_per_hour)
    # What the gateways reported of the domains with a share of traffic, since the split was set and within
    # the policy's canary_window_ms: domain -> model -> Tally (haru.promoter.canary).
    canary: dict[str, dict[str, Tally]] = {}
