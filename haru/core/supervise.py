"""When to restart a child that died: the backoff and the crash-loop verdict, as plain values.

Pure: no asyncio, no processes. `haru up` calls `next_restart` each time a child (an agent, the
projector, the promoter, nats-server) dies and sleeps for the delay it returns.

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
class RestartPolicy:
    first_s: float = 0.2
    max_s: float = 30.0
    stable_s: float = 30.0
    loop_after: int = 3


POLICY = RestartPolicy()


def next_restart(policy: RestartPolicy, failures: int, ran_s: float) -> tuple[int, float, bool]:
    """(failures in a row including this one, seconds to wait before restarting, crash loop?)."""
    failures = 1 if ran_s >= policy.stable_s else failures + 1
    delay = min(policy.first_s * 2 ** (failures - 1), policy.max_s)
    return failures, delay, failures >= policy.loop_after


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
