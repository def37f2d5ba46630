"""Whether this promoter's appends reach a majority of the log: `majority` or `minority`.

A promoter acts only through appends the stream's quorum accepted, so one whose NATS node lost its
majority (its region partitioned from the others) cannot start an operation, write a liveness verdict
or flip the route, whatever it decides. It says so instead of retrying quietly: the first append that
no quorum answered (a timeout, no stream leader, JetStream unavailable) puts it in the named state
`minority` (a log line and `haru_promoter_quorum{state="minority"} 1`), and the first append
acknowledged again (or refused by a quorum for a stale sequence: a quorum answered) ends it.

What it measured while cut off is not evidence: heartbeats stopped reaching it because it was the one
isolated. Entering and leaving `minority` both make the promoter measure heartbeat silence afresh (as
after a reconnect), so a promoter back from a partition never appends a verdict of silence it heard
only from its own side of the cut.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from haru.core.errors import LogError, LogUnavailable

__all__ = ["Quorum", "QuorumState", "no_quorum"]

QuorumState = Literal["majority", "minority"]

# JetStream's own words when the meta group or a stream has no leader (a majority is missing)
_NO_LEADER = ("code 10008", "temporarily unavailable", "no stream leader", "no suitable peers")


def no_quorum(exc: LogError) -> bool:
    """Whether an append failed because no majority answered (as opposed to a refusal or a bug)."""
    if isinstance(exc, LogUnavailable):
        return True
    text = str(exc).lower()
    return any(words in text for words in _NO_LEADER)


class Quorum:
    def __init__(self, logger: Any) -> None:
        self.state: QuorumState = "majority"
        self.since = time.monotonic()
        self.why = ""
        self.entered = 0  # times this promoter found itself in the minority
        self._log = logger

    def failed(self, exc: LogError) -> bool:
        """An append failed with `exc`; True when that moved this promoter into `minority`."""
        if not no_quorum(exc) or self.state == "minority":
            return False
        self.state, self.since, self.why = "minority", time.monotonic(), str(exc)
        self.entered += 1
        self._log.warning(
            "quorum_lost",
            state="minority",
            why=self.why,
            detail="no majority acknowledges this promoter's appends: it cannot start an operation or move "
            "the route until one does; heartbeat silence is measured afresh",
        )
        return True

    def answered(self) -> bool:
        """A quorum answered an append (accepted, or refused it for a stale sequence); True when that
        ended `minority`."""
        if self.state == "majority":
            return False
        took = time.monotonic() - self.since
        self.state, self.since, self.why = "majority", time.monotonic(), ""
        self._log.info("quorum_regained", state="majority", minority_s=round(took, 1))
        return True
