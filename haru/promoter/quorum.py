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

A stream that stops answering is not always a cut: when the region that led it is lost, the stream has
no leader until JetStream elects one (4-9 s of Raft election timeout in nats-server), and the promoters
of the surviving regions are not cut off at all. A promoter that still hears most of the promoters it
knows on core NATS (`reaches_most`: three or more known, one per region as docs/deploy.md places them)
is on the majority's side of any cut, so the silence it measured is evidence: it enters `minority` all
the same (it cannot append), but does not forget what it heard, and judges at once when the stream
answers again (`cut_off` says which kind of episode this is).

A promoter cut off on its own side may attempt no append at all (it is not the one acting), so it never
enters `minority`; the service watches the other side of the same rule for it: one that knew three or more
promoters and hears no longer most of them judges no silence (`promoters_unheard`) until it hears most of
them again, and then measures silence afresh (`promoters_heard_again`).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from haru.core.errors import LogError, LogUnavailable

__all__ = ["Isolation", "Quorum", "QuorumState", "most_heard_ago", "no_quorum", "reaches_most"]

QuorumState = Literal["majority", "minority"]

# JetStream's own words when the meta group or a stream has no leader (a majority is missing)
RECHECK_S = 30.0  # in minority with nothing committed seen: try to act again after this long
_NO_LEADER = ("code 10008", "temporarily unavailable", "no stream leader", "no suitable peers")


def reaches_most(heard: int, known: int) -> bool:
    """Whether a promoter that hears `heard` of the `known` promoters (itself included) on core NATS is on
    the majority's side of any cut: with three or more known, a strict majority heard; with fewer it
    cannot tell (False)."""
    return known >= 3 and 2 * heard > known


def most_heard_ago(ages: list[float]) -> float | None:
    """How long ago a promoter last heard most of the promoters it knows, given how long ago it heard each
    (`ages`, itself included): the age of the one that makes a strict majority, freshest first. None with
    fewer than three known: it cannot tell (`reaches_most`)."""
    if len(ages) < 3:
        return None
    return sorted(ages)[len(ages) // 2]


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
        # whether the last episode may have been this promoter's own isolation (its silence is then no
        # evidence), rather than a stream electing a leader while most promoters were still heard
        self.cut_off = True
        self._log = logger

    def failed(self, exc: LogError, *, heard_most: bool = False) -> bool:
        """An append failed with `exc`; True when that moved this promoter into `minority`. `heard_most`:
        it still hears most of the promoters it knows (`reaches_most`)."""
        if not no_quorum(exc) or self.state == "minority":
            return False
        self.state, self.since, self.why = "minority", time.monotonic(), str(exc)
        self.entered += 1
        self.entered_ns = time.time_ns()
        self.cut_off = not heard_most
        self._log.warning(
            "quorum_lost",
            state="minority",
            why=self.why,
            detail="no majority acknowledges this promoter's appends: it cannot start an operation or move "
            "the route until one does; "
            + (
                "heartbeat silence is measured afresh"
                if self.cut_off
                else "most promoters are still heard (a stream electing its leader): what was heard is kept"
            ),
        )
        return True

    def unheard(self) -> bool:
        """Most of the promoters this one knows fell silent on core NATS (`Isolation`): it may be the one cut
        off, before any append of its own failed to say so. `minority` as a cut (what it heard is no evidence);
        True when that moved it there."""
        if self.state == "minority":
            self.cut_off = True
            return False
        self.state, self.since, self.why = "minority", time.monotonic(), "most promoters are not heard"
        self.entered += 1
        self.entered_ns = time.time_ns()
        self.cut_off = True
        self._log.warning(
            "quorum_lost",
            state="minority",
            why=self.why,
            detail="this promoter may be the one cut off: it cannot start an operation or move the route, and "
            "judges no domain silent, until most promoters are heard or a majority answers again",
        )
        return True

    def alone(self) -> None:
        """In `minority`, most of the known promoters are no longer heard: this episode may be our own
        isolation after all."""
        if self.state == "minority":
            self.cut_off = True

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


class Isolation:
    """Whether this promoter is alone on its side of a cut, by the promoters it hears on core NATS: it knew
    three or more and hears no longer most of them. It ends when most of those known at the cut are heard
    again ('back'), or after `RECHECK_S` ('lapsed'): the others may have died rather than been cut away, and
    the service then forgets whom it knew and what it heard, and measures afresh; if it is cut off after all,
    its next verdict's append finds no quorum and it is in `minority` (above), so nothing measured from its
    side of a cut is ever appended."""

    def __init__(self) -> None:
        self.known_at_cut = 0  # 0: not cut off
        self.since = 0.0  # monotonic time the episode began

    def judge(self, heard: int, known: int, now: float) -> Literal["", "cut", "still", "back", "lapsed"]:
        """'' (not cut off), 'cut' (just stopped hearing most), 'still' (cut off), 'back' (most heard again),
        'lapsed' (cut off for RECHECK_S): after 'back' and 'lapsed', measure silence afresh."""
        if self.known_at_cut:
            if 2 * heard > self.known_at_cut or now - self.since > RECHECK_S:
                back = 2 * heard > self.known_at_cut
                self.known_at_cut = 0
                return "back" if back else "lapsed"
            return "still"
        if known >= 3 and not reaches_most(heard, known):
            self.known_at_cut, self.since = known, now
            return "cut"
        return ""
