"""The type checker's half of the log contract: both logs are checked by mypy against every Protocol of
haru/log/seam.py, so the JetStream log and its in-memory twin cannot drift apart in what they offer
(tests/integration/test_log_contract.py is the other half: the same behaviour from both).

Nothing here runs: the functions exist to be type-checked (mypy reads this module like any other).
"""

from __future__ import annotations

from haru.log.bus import Bus, NatsBus
from haru.log.eventlog import EventLog
from haru.log.memory import MemoryBus, MemoryLog
from haru.log.seam import EventReader, EventStore, EventWriter, Followable, IntentStore, Log, ViewStore

__all__: list[str] = []


def _jetstream(log: EventLog, bus: NatsBus) -> None:
    _log: Log = log
    _events: EventStore = log
    _reader: EventReader = log
    _writer: EventWriter = log
    _followable: Followable = log
    _views: ViewStore = log
    _intents: IntentStore = log
    _bus: Bus = bus


def _memory(log: MemoryLog, bus: MemoryBus) -> None:
    _log: Log = log
    _events: EventStore = log
    _reader: EventReader = log
    _writer: EventWriter = log
    _followable: Followable = log
    _views: ViewStore = log
    _intents: IntentStore = log
    _bus: Bus = bus
