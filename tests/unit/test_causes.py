"""The cause rules (haru/core/causes.py) and the causal tree `haru why` draws (haru/log/history.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec

from haru.core import causes, subjects
from haru.core import events as ev
from haru.core.residency import to_state
from haru.core.views import DomainView, FleetView, ModelView, OperationView, StepView
from haru.log import history
from haru.log.eventlog import Record

T = datetime(2026, 11, 30, tzinfo=UTC)


def test_every_event_type_is_a_root_or_has_a_table_row_naming_real_types():
    for tag, wanted in causes.EXPECTED.items():
        assert tag in ev.ALL_TAGS
        assert wanted and set(wanted) <= set(ev.ALL_TAGS), tag


def test_the_agent_cites_the_exit_a_restart_answers_and_the_command_a_wake_answers():
    rule = causes.residency_cause
    loading = ev.ModelLoading(at=T, domain="a", model="m")
    assert rule(loading, prev_tag="lost", prev_seq=40, command=0, gpu_gone=0, agent=3, stopping=False) == 40
    assert rule(loading, prev_tag="unknown", prev_seq=0, command=0, gpu_gone=0, agent=3, stopping=False) == 3
    waking = ev.ModelWaking(at=T, domain="a", model="m")
    assert rule(waking, prev_tag="sleeping", prev_seq=50, command=77, gpu_gone=0, agent=3, stopping=False) == 77
    resident = ev.ModelResident(at=T, domain="a", model="m")
    assert rule(resident, prev_tag="waking", prev_seq=78, command=77, gpu_gone=0, agent=3, stopping=False) == 77
    assert rule(resident, prev_tag="loading", prev_seq=41, command=0, gpu_gone=0, agent=3, stopping=False) == 41
    lost = ev.ModelLost(at=T, domain="a", model="m", reason="gpu_detached")
    assert rule(lost, prev_tag="resident", prev_seq=41, command=77, gpu_gone=90, agent=3, stopping=False) == 90
    exited = ev.ModelLost(at=T, domain="a", model="m", reason="process_exited")
    assert rule(exited, prev_tag="resident", prev_seq=41, command=77, gpu_gone=90, agent=3, stopping=False) == 0
    failed = ev.ModelFailed(at=T, domain="a", model="m", runtime_said="unknown architecture")
    assert rule(failed, prev_tag="loading", prev_seq=42, command=0, gpu_gone=0, agent=3, stopping=False) == 42
    stopped = ev.ModelStopped(at=T, domain="a", model="m")
    assert rule(stopped, prev_tag="resident", prev_seq=41, command=0, gpu_gone=0, agent=99, stopping=True) == 99


def _view(**kw) -> FleetView:
    lost = to_state(ev.ModelLost(at=T, domain="a", model="m", reason="gpu_detached"), 61)
    a = DomainView(name="a", models={"m": ModelView(name="m", residency=lost)}, reachable=True)
    b = DomainView(name="b", models={"m": ModelView(name="m")}, reachable=True)
    return FleetView(fleet="f", domains={"a": a, "b": b}, active="a", **kw)


def test_the_promoter_cites_the_loss_the_step_before_and_the_probe():
    view = _view()
    promo = ev.PromotionRequested(at=T, op_id="o", target="b", source="a", reason="gpu_detached")
    assert causes.decided_cause(view, promo, {}) == 61
    unreachable = ev.PromotionRequested(at=T, op_id="o", target="b", source="a", reason="domain_unreachable")
    assert causes.decided_cause(view, unreachable, {subjects.liveness("f", "a"): 55}) == 55
    manual = ev.PromotionRequested(at=T, op_id="o", target="b", source="a", reason="manual")
    assert causes.decided_cause(view, manual, {}) == 0
    op = OperationView(
        op_id="o",
        kind="promotion",
        target="b",
        seq=63,
        steps=[StepView(step="wake", state="completed", seq=74), StepView(step="probe", state="completed", seq=76)],
    )
    running = _view(operation=op)
    assert causes.decided_cause(running, ev.StepStarted(at=T, op_id="o", step="flip"), {}) == 76
    assert causes.decided_cause(running, ev.OperationCompleted(at=T, op_id="o"), {}) == 76
    fresh = _view(operation=OperationView(op_id="o", kind="promotion", target="b", seq=63))
    assert causes.decided_cause(fresh, ev.StepStarted(at=T, op_id="o", step="stop_training"), {}) == 63
    assert causes.flip_cause(op) == 76
    declined = ev.FailoverDeclined(at=T, domain="a", candidate="b", why="GPU 0 of a detached; standby b is lost")
    assert causes.decided_cause(view, declined, {}) == 61
    silent = _view().domains["a"]
    away = msgspec.structs.replace(
        view, domains={**view.domains, "a": msgspec.structs.replace(silent, reachable=False)}
    )
    declined_silent = ev.FailoverDeclined(at=T, domain="a", candidate="b", why="a unreachable; standby b is lost")
    assert causes.decided_cause(away, declined_silent, {subjects.liveness("f", "a"): 55}) == 55
    back = ev.DomainReachable(at=T, domain="a")
    assert causes.decided_cause(view, back, {subjects.liveness("f", "a"): 55}) == 55


def rec(seq: int, subject: str, e: ev.Event) -> Record:
    return Record(seq, subject, 0, ev.encode(e), e)


def test_the_tree_hangs_each_event_under_its_cause_and_says_where_a_link_is_missing():
    gpu = rec(10, subjects.gpu("f", "a", 0), ev.GpuObserved(at=T, domain="a", index=0, present=False))
    lost = rec(
        11, subjects.model("f", "a", "m"), ev.ModelLost(at=T, domain="a", model="m", reason="gpu_detached", cause=10)
    )
    unlinked = rec(12, subjects.model("f", "b", "m"), ev.ModelWaking(at=T, domain="b", model="m"))
    wrong = rec(13, subjects.op("f"), ev.StepCompleted(at=T, op_id="o", step="wake", cause=11))
    gone = rec(14, subjects.op("f"), ev.StepFailed(at=T, op_id="o", step="wake", cause=9))
    roots = history.causal_tree({r.seq: r for r in (gpu, lost, unlinked, wrong, gone)})
    assert [n.rec.seq for n in roots] == [14, 12, 10]
    assert [c.rec.seq for c in roots[2].children] == [11] and [c.rec.seq for c in roots[2].children[0].children] == [13]
    assert "could not be read" in roots[0].missing
    assert "a link is missing" in roots[1].missing
    assert "is a model_lost, not one of step_started" in roots[2].children[0].children[0].missing
    assert roots[2].missing == "" and roots[2].children[0].missing == ""
    text = history.render_tree(roots)
    assert "└─ seq      11  lost" in text and "! no cause recorded" in text
