"""The promoter counts the launch steps it folds for the hourly budget (policy max_launches_per_hour):
the decider is told how many started in the last hour, and older ones stop counting."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

from haru.core import subjects
from haru.core.events import ProvisionRequested, StepStarted, encode
from haru.log.eventlog import Record
from haru.promoter.service import Promoter


def record(seq: int, subject: str, event) -> Record:
    return Record(seq=seq, subject=subject, time_ns=0, data=encode(event), event=event)


def test_launch_steps_in_the_last_hour_are_counted():
    promoter = Promoter(SimpleNamespace(writer="promoter:t"), identity="promoter:t")
    now = datetime.now(UTC)
    op = subjects.op("f")
    events = [
        ProvisionRequested(at=now - timedelta(hours=2), op_id="op-1", target="a"),
        StepStarted(at=now - timedelta(hours=2), op_id="op-1", step="launch"),
        StepStarted(at=now - timedelta(minutes=30), op_id="op-1", step="launch", attempt=2),
        StepStarted(at=now - timedelta(minutes=10), op_id="op-1", step="join"),
        StepStarted(at=now - timedelta(minutes=5), op_id="op-1", step="launch", attempt=3),
    ]
    for seq, e in enumerate(events, start=1):
        promoter.on_record(record(seq, op, e))
    assert promoter.facts(promoter.fleets["f"]).launches_last_hour == 2
