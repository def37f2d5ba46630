"""Whether this promoter's appends reach a majority of the log: `majority` or `minority`.

A promoter acts only through appends the stream's quorum accepted, so one whose NATS node lost its
majority (its region partitioned from the others) cannot start an operation, write a liveness verdict
or flip the route, whatever it decides. It says so instead of retrying quietly: the first append that
no quorum answered (a timeout, no stream leader, JetStream unavailable) puts it in the named state
`minority` (a log line and `haru_promoter_quorum{state="minority"} 1`), and the first append
acknowledged again (or refused by a quorum for a stale sequence: a quorum answered) ends it.

What it measures while cut off is not evidence: heartbeats stopped reaching it because it was the one
isolated. So while in `minority` it judges no domain silent, and entering and leaving `minority` both
make it measure heartbeat silence afresh (as after a reconnect). It leaves `minority` when a quorum
answers one of its appends, or when it folds a record the log committed after it entered (the majority
is back within reach; measured on this machine's clock against JetStream's record time), or after
`RECHECK_S` without either, to try again. So a promoter back from a partition never appends a verdict of
silence heard only from its own side of the cut.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from haru.core.errors import LogError, LogUnavailable

__all__ = ["Quorum", "QuorumState", "no_quorum"]

QuorumState = Literal["majority", "minority"]

# JetStream's own words when the meta group or a stream has no leader (a majority is missing)
RECHECK_S = 30.0  # in minority with nothing committed seen: try to act again after this long
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
        self.entered_ns = 0  # wall clock when it last did
        self._log = logger

    def failed(self, exc: LogError) -> bool:
        """An append failed with `exc`; True when that moved this promoter into `minority`."""
        if not no_quorum(exc) or self.state == "minority":
            return False
        self.state, self.since, self.why = "minority", time.monotonic(), str(exc)
        self.entered += 1
        self.entered_ns = time.time_ns()
        self._log.warning(
            "quorum_lost",
            state="minority",
            why=self.why,
            detail="no majority acknowledges this promoter's appends: it cannot start an operation or move "
            "the route until one does; heartbeat silence is measured afresh",
        )
        return True

    def committed(self, time_ns: int) -> bool:
        """A record JetStream stored at `time_ns` was folded; True when that ended `minority` (it was
        committed after this promoter entered it, so a majority is within reach again)."""
        if self.state == "minority" and time_ns > self.entered_ns:
            return self.answered()
        return False

    def lapsed(self) -> bool:
        """True (and `majority` again, to try) when `minority` has lasted RECHECK_S with nothing committed seen."""
        if self.state == "minority" and time.monotonic() - self.since > RECHECK_S:
            return self.answered()
        return False

    def answered(self) -> bool:
        """A quorum answered an append (accepted, or refused it for a stale sequence); True when that
        ended `minority`."""
        if self.state == "majority":
            return False
        took = time.monotonic() - self.since
        self.state, self.since, self.why = "majority", time.monotonic(), ""
        self._log.info("quorum_regained", state="majority", minority_s=round(took, 1))
        return True
