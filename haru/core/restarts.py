"""Backoff, and when to restart a child that died: plain values, no asyncio, no processes.

    Backoff(first_s=0.25, max_s=5.0).delay(attempt)    the pause after `attempt` failures in a row

Every retry loop in Haru (a follower's replay, the gateway's watches, the projector's writes, the
Postgres sink's sessions, a model's restarts, `haru up`'s children) waits `Backoff.delay` of its own
failures in a row, and starts again at 1 once an attempt got somewhere.

`haru up` calls `next_restart` each time a child (an agent, the projector, the promoter, nats-server)
dies and sleeps for the delay it returns.

    failures, delay_s, crash_loop = next_restart(POLICY, failures, ran_s)

A child that ran for `stable_s` or longer before dying is forgiven its earlier failures: the
delay starts again at `first_s`. A child that dies sooner than that doubles the delay each time
(up to `max_s`), and from the `loop_after`-th quick death in a row it is in a crash loop, which the
caller says in its log (with the child's own log file, where the reason is).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Delays that double from `first_s` with each failure in a row, capped at `max_s`."""

    first_s: float
    max_s: float

    def delay(self, attempt: int) -> float:
        """Seconds to wait after `attempt` failures in a row (1, 2, ...): first_s, 2 first_s, ... max_s."""
        return min(self.first_s * float(2 ** min(max(0, attempt - 1), 64)), self.max_s)


@dataclass(frozen=True)
class RestartPolicy:
    first_s: float = 0.2
    max_s: float = 30.0
    stable_s: float = 30.0
    loop_after: int = 3


POLICY = RestartPolicy()


def next_restart(policy: RestartPolicy, failures: int, ran_s: float) -> tuple[int, float, bool]:
    """(failures in a row including this one, seconds to wait before restarting, crash loop?)."""
    failures = 1 if ran_s >= policy.stable_s else failures + 1
    return failures, Backoff(policy.first_s, policy.max_s).delay(failures), failures >= policy.loop_after


def exit_reason(returncode: int | None) -> str:
    """`exited with status 1`, `killed by SIGKILL`: how a child ended, in words."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exited with status {returncode}"
