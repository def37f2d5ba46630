"""Haru's exceptions. A leaf module: it imports nothing from the package.

Every message names the thing, the value and the fix, and says whose fault it is:
a bad layout is the operator's, a reclaimed GPU the provider's, a wrong sequence a race.

    HaruError
    ├── InvalidName            a fleet/domain/slot name or model id that cannot be used   (operator)
    ├── LayoutError            a layout that does not validate, with the JSON path         (operator)
    ├── ArgConflict            a model's `args` flag that contradicts its plan (haru.core.launch) (operator)
    ├── InvalidWeights         traffic weights that cannot be applied (haru.core.weights)    (operator)
    ├── ConfigError            an agent or service configuration that cannot be used       (operator)
    │   └── AlreadyRunning     `haru up` on a home another live `haru up` holds             (operator)
    ├── EventDecodeError       a body on an event subject that is not a valid event         (writer)
    ├── IllegalTransition      a residency event that the current state does not allow     (writer)
    ├── LogError               the event log (JetStream) failed or refused
    │   ├── Conflict           an optimistic append lost a race: carries the current sequence
    │   ├── LogUnavailable     no server, no stream leader, or a timeout
    │   │   ├── ReplayTimeout  a replay that did not finish within its deadline
    │   │   └── StoreBusy      a nats-server store directory another live server holds
    │   ├── LogDamaged         the store cannot serve sequences it should hold (a damaged
    │   │                      block), or ends before what was derived from it (truncated)
    │   └── HistoryRefused     a delete or purge that the stream forbids
    ├── CommandError           a command to an agent failed (carries its code)
    │   └── AgentGone          nobody answers for that domain
    └── BusError               a core-NATS publish or request failed (haru.log.bus)
        ├── NoResponders       nothing is subscribed to the request's subject
        └── RequestTimeout     no reply within the request's bound
"""

from __future__ import annotations

from typing import Any


class HaruError(Exception):
    """Base of every error Haru raises on purpose."""


class InvalidName(HaruError, ValueError):
    """A fleet, domain or slot name (or a model id) that Haru cannot use."""


class LayoutError(HaruError, ValueError):
    """A layout that does not validate. `path` is a JSON path like `$.domains[1].gpus[0].memory`."""

    def __init__(self, message: str, *, path: str = "$", fix: str = "") -> None:
        self.path = path
        self.fix = fix
        text = f"{message} - at `{path}`"
        if fix:
            text += f". Fix: {fix}"
        super().__init__(text)


class ArgConflict(HaruError, ValueError):
    """An operator `args` entry that contradicts the plan (haru.core.launch). `index` is its position in `args`;
    the layout parser turns it into a LayoutError at `...args[index]`."""

    def __init__(self, *, flag: str, given: str, planned: str, index: int, fix: str) -> None:
        self.flag, self.given, self.planned, self.index, self.fix = flag, given, planned, index, fix
        given_text = f"{flag} {given}".rstrip()
        super().__init__(f"args give {given_text!r}, which contradicts the plan's {planned}")


class InvalidWeights(HaruError, ValueError):
    """Traffic weights that cannot be applied: an unknown domain, shares that do not add up, a bad pair."""


class ConfigError(HaruError, ValueError):
    """A service or agent configuration that cannot be used."""


class AlreadyRunning(ConfigError):
    """A second `haru up` on a home that a live one holds."""


class EventDecodeError(HaruError, ValueError):
    """A body that is not a valid Haru event. The message carries msgspec's path."""


class IllegalTransition(HaruError):
    """A residency event that the current state does not allow."""

    def __init__(self, state: str, event: str, subject: str = "") -> None:
        self.state = state
        self.event = event
        self.subject = subject
        where = f" on {subject}" if subject else ""
        super().__init__(
            f"illegal residency transition{where}: `{event}` cannot follow state `{state}`; "
            f"the writer skipped a step (see the transition table in haru/core/residency.py)"
        )


class LogError(HaruError):
    """The event log failed or refused."""


class Conflict(LogError):
    """An optimistic append lost: the subject's last sequence is not the one expected.

    The caller re-reads, re-decides, and tries again or gives up.
    """

    def __init__(self, subject: str, expected: int, current: int | None) -> None:
        self.subject = subject
        self.expected = expected
        self.current = current
        now = "unknown" if current is None else str(current)
        super().__init__(
            f"conflict on {subject}: expected last sequence {expected}, it is {now} "
            f"(another writer appended first; re-read and decide again)"
        )


class BatchUnsupported(LogError):
    """The log cannot store a batch of appends atomically (a stream without `allow_atomic`, a server
    older than nats-server 2.12): the caller appends one at a time."""


class LogUnavailable(LogError):
    """No server, no stream leader, or a timeout talking to JetStream."""


class StreamUnknown(LogUnavailable):
    """The server that answered knows no such stream (JetStream's 10059): not created yet (`haru up` creates
    it), or a new meta leader still catching up after an election. Never "nothing stored": a caller for
    whom a stream not created yet is normal (a dry run before `haru up`) catches this."""


class ReplayTimeout(LogUnavailable):
    """A replay that did not finish within its deadline (the server is slow, overloaded or gone)."""


class LogDamaged(LogError):
    """The event store cannot serve sequences it should hold.

    `missing` lists the sequence numbers (sorted; empty when the store counted messages it could
    not deliver but the scan could not name them: `uncounted` says how many). Raised by a replay
    after its handler has seen every readable event, so what was read is still usable.
    """

    def __init__(self, message: str, *, missing: list[int], last: int = 0, uncounted: int = 0) -> None:
        self.missing = missing
        self.last = last  # the stream's last sequence when the replay started
        self.uncounted = uncounted
        self.records: list[Any] | None = None  # what a history() read before the damage was reported
        super().__init__(message)


def seq_ranges(seqs: list[int], limit: int = 20) -> str:
    """`[3, 4, 5, 9]` -> `3-5, 9` (at most `limit` ranges, then `… (N more)`)."""
    spans: list[tuple[int, int]] = []
    for s in sorted(set(seqs)):
        if spans and s == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], s)
        else:
            spans.append((s, s))
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans[:limit])
    if len(spans) > limit:
        text += f" … ({len(spans) - limit} more ranges)"
    return text


class StoreBusy(LogUnavailable):
    """A nats-server store directory that another live nats-server holds."""


class HistoryRefused(LogError):
    """The stream refused to delete or purge history (deny_delete / deny_purge)."""


class CommandError(HaruError):
    """A command sent to an agent failed. `code` is the agent's error code."""

    def __init__(self, message: str, *, code: str = "command_failed") -> None:
        self.code = code
        super().__init__(message)


class AgentGone(CommandError):
    """No agent answers for a domain (no responders or no reply in time)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="agent_gone")


class BusError(HaruError):
    """A publish or request on the bus (core NATS, haru.log.bus) failed: the connection is closed, or refused."""


class NoResponders(BusError):
    """A request that nothing is subscribed to answer."""


class RequestTimeout(BusError):
    """A request with no reply within its bound."""
