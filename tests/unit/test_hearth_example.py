"""hearth's example end to end through the pure core: the layout, the planner, `haru apply`'s events,
the fold and `haru status` all tell the same story, in hearth's words."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from haru.core import apply, planner, subjects
from haru.core import fold as fleet
from haru.core.layout import load_layout
from haru.projections import status

NOW = datetime(2026, 11, 29, 3, 0, tzinfo=UTC)
HEARTH = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "hearth.json"
LINE = "42.0 / 44.2 GiB held  (5 declared, 2 admitted)"


def test_apply_and_status_print_hearths_line_for_the_same_layout():
    layout = load_layout(HEARTH)
    plan = planner.plan(layout)
    assert {g.summary() for d in plan.domains for g in d.gpus} == {LINE}

    events = apply.diff(apply.fold_declarations([]), layout, plan, NOW)
    subject = subjects.decl(layout.fleet)
    views = fleet.fold((seq, subject, e) for seq, e in enumerate(events, start=1))
    text = status.render(views[layout.fleet], NOW)
    assert text.count(LINE) == 2  # both mirrored domains
    for model, short in (("gemma4:26b", "14.8"), ("qwen3.6:27b", "15.8"), ("gemma4-extract:31b", "17.8")):
        assert any(model in line and f"not admitted — short by {short} GiB" in line for line in text.splitlines())
