"""What one promoter replica knows about each fleet it decides for, kept by the service and read by
the step runners: the folded view, the tips of the fleet's subjects, heartbeats heard, the steps this
replica runs, the declarations (provision blocks included), launches of the hour and canary reports."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from haru.core.events import StepCompleted, StepFailed
from haru.core.fold import Folder
from haru.core.specs import DomainSpec
from haru.core.views import FleetView, OperationView
from haru.core.weights import CanaryReport, Tally
from haru.promoter.canary import tally as canary_tally


def utcnow() -> datetime:
    return datetime.now(UTC)


StepRunner = Callable[["FleetState", OperationView, str, int], Awaitable[StepCompleted | StepFailed]]
"""(fleet state, operation, step, seq of its step_started) -> the step's outcome, to be appended."""


@dataclass
class FleetState:
    """What the promoter knows about one fleet: its folded view and the tips of its subjects."""

    folder: Folder  # the fleet's view, folded incrementally (`view`)
    last: dict[str, int] = field(default_factory=dict)  # subject -> last seq folded
    step_by: dict[str, str] = field(default_factory=dict)  # op_id -> `by` of its latest step_started
    heard: dict[str, float] = field(default_factory=dict)  # domain -> monotonic time of last heartbeat
    running: set[tuple[str, str, int]] = field(default_factory=set)
    specs: dict[str, DomainSpec] = field(default_factory=dict)  # domain -> its declaration (provision block included)
    launches: list[datetime] = field(default_factory=list)  # `at` of every launch step started (the hourly budget)
    reports: list[tuple[float, str, CanaryReport]] = field(
        default_factory=list
    )  # (monotonic, gateway, report) of the window
    resumed_at: int = 0  # the stream sequence its view was taken complete up to at start (records up to it skipped)

    @property
    def view(self) -> FleetView:
        return self.folder.view()

    def canary_window(self) -> dict[str, dict[str, Tally]]:
        """The window's reports, summed: since the split in force was set, within canary_window_ms."""
        view = self.view
        if not self.reports:
            return {}
        horizon = time.monotonic() - view.policy.canary_window_ms / 1000
        self.reports = [r for r in self.reports if r[0] >= horizon]
        if not (view.weights or view.model_weights):
            # a LoRA adapter's versions (haru.promoter.adapter_gate) are judged on the whole window
            return canary_tally((g, r) for _, g, r in self.reports) if view.adapters else {}
        since = view.weights_change.at if view.weights_change is not None else None
        return canary_tally(((g, r) for _, g, r in self.reports), since=since)
