"""What an agent observed while its appends could not reach the log, kept in order until they can (pure).

    backlog = Backlog(limit=1000)
    ref = backlog.add(subject, event, expect)   # a provisional sequence (negative) for the writer to keep
    head = backlog.head()                       # the oldest entry, appended first
    backlog.done(head.ref, seq)                 # appended: `ref` now resolves to `seq`
    backlog.resolve(ref)                        # the stored sequence of a ref (None while it waits)

Entries leave in the order they came, across subjects, so a cause (an event's `cause`, the sequence of
another of the agent's events) is always appended before whatever cites it. A writer that got a ref
instead of a sequence keeps it as it would a sequence (a model's `seq`, the `expect` of its next
append, a cause): the appender resolves refs when their entry is appended.

**Bounded.** At `limit` entries the backlog coalesces: on each subject, when a run of waiting events
comes back to a state it was already in (the same state key: `model_lost` ... `model_resident` ...
`model_lost`), the events of the loop are dropped and the later event takes the place of the first,
so the subject keeps going from its stored state to its latest one through legal transitions (each
kept event's transition is one the table allowed before). A GPU observation is a whole snapshot: only
the latest waiting one per GPU is kept. An entry that may be in the log already is never dropped: the
head (being appended) and any whose append was attempted and not acknowledged (`sent`: its bytes may
be stored, or flushed from the client's reconnect buffer once the connection is back, so only its own
retry, recognised by its Nats-Msg-Id, keeps the subject's sequence). What was dropped is counted
(`coalesced`); a ref of a dropped event resolves to the stored sequence of the kept event of the same
state (the loss a restart cites is the loss that was kept). When nothing coalesces the backlog is
`full`: it still takes an event that closes a loop (`absorbs`: it coalesces at once, making room),
and for anything else the writer waits (nothing is ever dropped unseen).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from haru.core import events as ev
from haru.core.residency import event_key, state_name, to_state

__all__ = ["Backlog", "Pending", "state_key"]


@dataclass
class Pending:
    ref: int  # the provisional sequence handed to the writer (negative)
    subject: str
    event: ev.Event
    expect: int  # the expected last sequence the writer gave (a sequence or a ref)
    # an append of it was attempted and not acknowledged: its bytes may be stored, or still sit in the
    # client's reconnect buffer and be stored when the connection is back; never dropped, so its retry
    # (the same body and Nats-Msg-Id) is what the log recognises, not a later event it would store twice
    sent: bool = False


def state_key(event: ev.Event) -> str | None:
    """The state a subject is in after `event`, for coalescing (None: never coalesced)."""
    if isinstance(event, ev.GpuObserved):
        return "gpu_observed"  # a snapshot: the latest supersedes every earlier one
    if isinstance(event, (ev.TrainingStarted, ev.TrainingStopped)):
        return ev.tag_of(event)
    try:
        return f"{event_key(event)}>{state_name(to_state(event))}"
    except (KeyError, TypeError, ValueError):
        return None  # not a residency event


class Backlog:
    def __init__(self, limit: int) -> None:
        self.limit = max(2, limit)
        self.entries: deque[Pending] = deque()
        self.coalesced = 0  # events dropped by coalescing, since the start
        self._next = -1
        self._stored: dict[int, int] = {}  # ref -> stored sequence
        self._replaced: dict[int, int] = {}  # dropped ref -> the ref that took its place

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def full(self) -> bool:
        return len(self.entries) >= self.limit

    def add(self, subject: str, event: ev.Event, expect: int, *, sent: bool = False) -> int:
        ref = self._next
        self._next -= 1
        self.entries.append(Pending(ref, subject, event, expect, sent))
        if self.full:
            self.coalesce()
        return ref

    def head(self) -> Pending | None:
        return self.entries[0] if self.entries else None

    def done(self, ref: int, seq: int) -> None:
        """The head entry `ref` was appended at `seq`."""
        if self.entries and self.entries[0].ref == ref:
            self.entries.popleft()
        self._stored[ref] = seq

    def resolve(self, seq: int) -> int | None:
        """A sequence as stored: itself when it is one, the stored sequence of a ref, None while it waits."""
        seen = 0
        while seq < 0 and seq in self._replaced and seen < 1000:
            seq, seen = self._replaced[seq], seen + 1
        if seq >= 0:
            return seq
        return self._stored.get(seq)

    def absorbs(self, subject: str, event: ev.Event) -> bool:
        """Whether adding `event` closes a loop on `subject`, so that a full backlog takes it and coalesces
        (it makes room rather than taking it)."""
        key = state_key(event)
        if key is None:
            return False
        run = [p for p in self.entries if p.subject == subject]
        return self._loop_at(run, key, self.head()) is not None

    @staticmethod
    def _loop_at(run: list[Pending], key: str | None, head: Pending | None) -> int | None:
        """Where in a subject's waiting `run` an event of state `key` closes a loop (None: it does not).
        A loop starts after the last entry that may be in the log already (the head, or one `sent`)."""
        if key is None:
            return None
        start = next((i + 1 for i in range(len(run) - 1, -1, -1) if run[i].sent or run[i] is head), 0)
        return next((i for i in range(start, len(run)) if state_key(run[i].event) == key), None)

    def coalesce(self) -> int:
        """Drop the loops of each subject's waiting run (see the module docstring); returns how many."""
        runs: dict[str, list[Pending]] = {}
        head = self.entries[0] if self.entries else None  # may be being appended: never dropped
        for p in self.entries:
            run = runs.setdefault(p.subject, [])
            at = self._loop_at(run, state_key(p.event), head)
            if at is not None:
                dropped = run[at:]
                del run[at:]
                p.expect = dropped[0].expect  # the later event continues from where the first began
                for q in dropped:
                    # what cited a dropped event cites the kept one of the same state: an earlier one, or `p`
                    q_key = state_key(q.event)
                    same = next((k for k in reversed(run) if state_key(k.event) == q_key), p)
                    self._replaced[q.ref] = same.ref
            run.append(p)
        kept = {id(p) for run in runs.values() for p in run}
        before = len(self.entries)
        self.entries = deque(p for p in self.entries if id(p) in kept)
        n = before - len(self.entries)
        self.coalesced += n
        return n
