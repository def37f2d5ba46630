"""The wall clock the tests stamp events with: one `now()`, timezone-aware as the events require."""

from __future__ import annotations

from datetime import UTC, datetime


def now() -> datetime:
    return datetime.now(UTC)
