"""What one promoter replica knows about each fleet it decides for, kept by the service and read by
the step runners: the folded view, the tips of the fleet's subjects, heartbeats heard, the steps this
replica runs, the declarations (provision blocks included), launches of the hour and canary reports.

The view a decision reads is the follower's fold plus this replica's own appends that a quorum has
acknowledged and the follower has not delivered yet (`acked`, `view`): the acknowledgement already says
what the log holds at that sequence, so the next step is decided at once instead of after the
delivery (one round trip to where the consumer lives, per decision, at WAN latency)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from haru.core import ranking
from haru.core.events import (
    DomainChanged,
    DomainDeclared,
    DomainRetired,
    Event,
    StepCompleted,
    StepFailed,
    StepStarted,
)
from haru.core.fold import Folder, evolve
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
    # (seq, subject, event) of this replica's own acknowledged appends the follower has not folded yet
    ahead: list[tuple[int, str, Event]] = field(default_factory=list)
    _overlay: tuple[FleetView, int, FleetView] | None = None  # (folded view, len(ahead), view with ahead on it)

    @property
    def view(self) -> FleetView:
        """The folded view, with this replica's acknowledged appends the follower has not delivered yet
        applied on top, in their order (`acked`)."""
        base = self.folder.view()
        if not self.ahead:
            return base
        if self.ahead[0][0] <= self.folder.seq:  # delivered and folded: the fold has them now
            self.ahead = [a for a in self.ahead if a[0] > self.folder.seq]
            if not self.ahead:
                return base
        cached = self._overlay
        if cached is not None and cached[0] is base and cached[1] == len(self.ahead):
            return cached[2]
        out = base
        for seq, subject, event in self.ahead:
            out = evolve(out, event, seq=seq, subject=subject)
        self._overlay = (base, len(self.ahead), out)
        return out

    def note(self, event: Event) -> None:
        """What the promoter keeps beside the view from an applied event: who runs each step, the launches
        (the hourly budget), the domains' declarations (their provision blocks)."""
        if isinstance(event, StepStarted):
            self.step_by[event.op_id] = event.by
            if event.step == "launch":
                self.launches.append(event.at)
        elif isinstance(event, (DomainDeclared, DomainChanged)):
            self.specs[event.spec.name] = event.spec
        elif isinstance(event, DomainRetired):
            self.specs.pop(event.domain, None)

    def acked(self, seq: int, subject: str, event: Event) -> None:
        """Our own append, acknowledged at `seq`: the next decision reads it (`view`) and expects it
        (`last`) without waiting for the follower to deliver it."""
        if seq > self.last.get(subject, 0):
            self.last[subject] = seq
        if seq > self.folder.seq:
            self.ahead.append((seq, subject, event))

    def folded(self, subject: str, seq: int) -> None:
        """The follower folded `seq` on `subject`: the subject's tip, unless an acknowledged append of ours
        on it is still on its way (the tip stays ours: the log holds it)."""
        mine = max((s for s, subj, _ in self.ahead if subj == subject and s > seq), default=0)
        self.last[subject] = mine or seq

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


def first_standbys(fleets: Mapping[str, FleetState]) -> list[str]:
    """Each fleet's first-ranked standby now, when it is fit to be promoted (haru.core.ranking), fleets in
    name order: where a failover would go next (`haru promoter --stream-leaders` keeps the leaders there)."""
    out = []
    for fleet in sorted(fleets):
        view = fleets[fleet].view
        ranked = ranking.rank(view) if view.active else []
        if ranked and ranked[0].fit:
            out.append(ranked[0].domain)
    return out
