"""The log seam, declared: what services may ask of the event log, the views and the route intents.

Every service is typed against these Protocols, never against a concrete log. Two logs implement them:
`haru.log.eventlog.EventLog` (JetStream) and `haru.log.memory.MemoryLog` (in memory, for tests of
service logic); `haru/log/conformance.py` has mypy check both against every Protocol here, so neither
can drift, and tests/integration/test_log_contract.py runs one suite of behaviour against both.

    Followable     replay, last_seq, last_seq_matching, read_seq, on_link_change  (the Follower's needs)
    EventReader    + last, last_seq_of, history, tail, subject_counts, follower, follow
    EventWriter    writer, append                  (optimistic, sequence-checked, hash-chained)
    EventStore     EventReader + EventWriter        (haru apply, the projector's and promoter's writes)
    ViewStore      get_view, views, put_view (compare-and-swap by revision), watch_views
    IntentStore    publish_intent (sequence-checked), last_intent, watch_intents
    Log            all of the above, plus connected, bus (core NATS: haru.log.bus.Bus), ensure, close

A service asks for the smallest of these that covers what it does: `haru.log.reads` reads
(`EventReader`), `haru apply` reads and appends (`EventStore`), the follower needs a `Followable`; the
projector, the promoter, the gateway and `RouteWatcher` (intents and the link's ups and downs) take a
`Log`.

The semantics every implementation keeps (the contract suite checks them): one dense stream sequence
for all event subjects; `append(subject, event, expect=seq)` stores only when `seq` is the subject's
last sequence (0: the subject is empty) and raises `Conflict` with the current one otherwise; a retried
append of the same (subject, expect, body) returns the stored sequence instead of a second event;
`prev` chains each subject's bodies and `by` names the writer; `replay` hands records in sequence
order and, with `follow`, goes on until cancelled or until the link drops (`LogUnavailable`);
`put_view(key, data, last=rev)` is a compare-and-swap (0: the key must not exist).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from haru.core import subjects
from haru.core.record import Record

if TYPE_CHECKING:
    from haru.log.bus import Bus
    from haru.log.follow import Follower

__all__ = ["EventReader", "EventStore", "EventWriter", "Followable", "Handler", "IntentStore", "Log", "ViewStore"]

Handler = Callable[[Record], Any | Awaitable[Any]]
"""What a replay or a follower calls with each record: plain or async."""


class Followable(Protocol):
    """What `haru.log.follow.Follower` needs: a replay that can follow, the heads, single reads and
    the link's ups and downs."""

    async def replay(
        self,
        handler: Handler,
        *,
        from_seq: int = 1,
        subject_filter: str = subjects.ALL_EVENTS,
        follow: bool = False,
        headers: bool = True,
        timeout: float | None = None,
        strict: bool = False,
        on_gap: Callable[[list[int]], Any] | None = None,
    ) -> int:
        """Call `handler` with each stored record matching the filter from `from_seq`, in order; with
        `follow`, then every new one until cancelled. Returns the last sequence handled."""
        ...

    async def last_seq(self) -> int:
        """The event stream's last sequence (0 when empty)."""
        ...

    async def last_seq_matching(self, subject_filter: str) -> int:
        """The last sequence of any subject matching the filter (0 when none)."""
        ...

    async def read_seq(self, seq: int) -> Record | None:
        """The record at `seq` (None when the store cannot serve it)."""
        ...

    def on_link_change(self, listener: Callable[[bool], None]) -> Callable[[], None]:
        """Tell `listener(False)` when the link to the log is lost and `listener(True)` when it is
        back; returns the function that removes the listener."""
        ...


class EventReader(Followable, Protocol):
    """Reading the event log: single subjects, history, counts and following."""

    async def last(self, subject: str, *, direct: bool = False) -> Record | None:
        """The last record on `subject` (None when the subject is empty). `direct`: asked as JetStream's
        direct get with the subject in the request's own subject, which a user allowed to read only that
        subject may send (a route follower); any replica answers it, so it may be a moment behind."""
        ...

    async def last_seq_of(self, subject: str) -> int:
        """The last sequence on `subject` (0 when empty): what to pass as `expect`."""
        ...

    async def history(
        self,
        subject_filter: str = subjects.ALL_EVENTS,
        *,
        from_seq: int = 1,
        timeout: float | None = None,
        strict: bool = False,
    ) -> list[Record]:
        """Every stored record matching the filter from `from_seq`, in order."""
        ...

    async def tail(
        self, subject_filter: str, limit: int, *, timeout: float | None = None, strict: bool = False
    ) -> list[Record]:
        """The last `limit` records matching the filter, oldest first."""
        ...

    async def subject_counts(self, subject_filter: str = subjects.ALL_EVENTS) -> dict[str, int]:
        """The subjects matching the filter that hold messages, with how many each."""
        ...

    def follower(self, handler: Handler, *, from_seq: int = 1, **kwargs: Any) -> Follower:
        """A `haru.log.follow.Follower` of this log (`kwargs`: the Follower's)."""
        ...

    async def follow(self, handler: Handler, *, from_seq: int = 1, **kwargs: Any) -> None:
        """Follow from `from_seq` until cancelled (`follower(...).run()`)."""
        ...


class EventWriter(Protocol):
    """Appending to the event log."""

    @property
    def writer(self) -> str:
        """Who appends (the `by` of events that do not name their writer)."""
        ...

    async def append(self, subject: str, event: Any, *, expect: int) -> int:
        """Append `event` to `subject` if the subject's last sequence is `expect` (0 = empty); fills
        `prev` and `by`; returns the new sequence; raises `Conflict` when another writer got there."""
        ...

    async def append_batch(self, appends: Sequence[tuple[str, Any]], *, expect: Mapping[str, int]) -> list[int]:
        """Append each (subject, event) in order, atomically: all of them, at consecutive sequences, or none.

        `expect`: each subject's last sequence before the batch (0 = empty), checked for all before any is
        stored. Fills `prev` (an event after another on the same subject in the batch chains to it) and
        `by`. An event may cite an earlier one of the batch by a negative, relative `cause`
        (haru.core.record.with_absolute_cause): its sequence is not known until the batch is stored.
        Returns the sequences; raises `Conflict` when a subject moved past its `expect` (nothing is
        stored) and `BatchUnsupported` when the log cannot store a batch atomically."""
        ...


class EventStore(EventReader, EventWriter, Protocol):
    """The event log, read and written."""


class ViewStore(Protocol):
    """The projected fleet views (the KV bucket haru_views), written by compare-and-swap."""

    async def get_view(self, key: str) -> tuple[bytes, int] | None:
        """(body, revision) of a view, None when there is none."""
        ...

    async def views(self) -> dict[str, bytes]:
        """Every view stored now, by key."""
        ...

    async def put_view(self, key: str, data: bytes, *, last: int) -> int:
        """Write a view if its revision is `last` (0 = the key must not exist); returns the new
        revision; raises `Conflict` otherwise."""
        ...

    def watch_views(self, pattern: str = "fleet.*") -> AsyncIterator[tuple[str, bytes | None, int]]:
        """The current views, then every change: (key, body or None when deleted, revision)."""
        ...


class IntentStore(Protocol):
    """The route intents (stream HARU_ROUTE, one subject a fleet), published with expected sequences."""

    async def publish_intent(self, fleet: str, data: bytes, *, expect: int) -> int:
        """Publish if the fleet's last intent is at `expect` (0 = none yet); returns its sequence."""
        ...

    async def last_intent(self, fleet: str) -> tuple[bytes, int] | None:
        """(body, sequence) of the fleet's last intent, None when there is none."""
        ...

    def watch_intents(self, fleet: str = "*") -> AsyncIterator[tuple[str, bytes, int]]:
        """The last intent of each matching fleet, then every new one: (fleet, body, sequence)."""
        ...


class Log(EventStore, ViewStore, IntentStore, Protocol):
    """One connection to the whole log: events, views, intents and the bus on the same link."""

    @property
    def connected(self) -> bool:
        """Whether the link to the log is up now."""
        ...

    @property
    def bus(self) -> Bus:
        """Core NATS on the same link (heartbeats, liveness, commands): haru.log.bus."""
        ...

    async def ensure(self, *, replicas: int | None = None) -> None:
        """Create (or check) the streams and the views' bucket."""
        ...

    async def close(self) -> None: ...
