"""The residency state machine, read from its one table; the probe diagnosis; router answers."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from haru.core import events as ev
from haru.core.errors import IllegalTransition
from haru.core.residency import (
    ADMITTED,
    ADOPTED_ASLEEP,
    ADOPTED_AWAKE,
    ANSWERS,
    REFUSED,
    RESIDENCY_EVENT_KEYS,
    STATE_TAGS,
    TRANSITIONS,
    UNKNOWN,
    Failed,
    Loading,
    Lost,
    NotAdmitted,
    Pulling,
    Resident,
    Sleeping,
    Stopped,
    Unknown,
    Waking,
    answer,
    classify_probe_failure,
    event_key,
    evolve,
    state_name,
    to_state,
    transition_table_markdown,
)
from haru.core.specs import ModelSpec

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
T1 = T0 + timedelta(seconds=47)


def make_event(key: str, at: datetime = T1) -> ev.Event:
    common = dict(at=at, domain="a", model="qwen3.6:27b")
    return {
        "model_pulling": lambda: ev.ModelPulling(
            **common, reference="hf:Qwen/Qwen3-0.6B-GGUF", done_bytes=5, total_bytes=10
        ),
        "model_loading": lambda: ev.ModelLoading(**common, pid=10, attempt=2, endpoint="127.0.0.1:18080"),
        "model_resident": lambda: ev.ModelResident(**common, warmup_ms=256, endpoint="127.0.0.1:18080"),
        "model_sleeping": lambda: ev.ModelSleeping(**common, level=1),
        "model_waking": lambda: ev.ModelWaking(**common),
        "model_lost": lambda: ev.ModelLost(**common, reason="gpu_detached", detail="NVML: GPU is lost"),
        "model_failed": lambda: ev.ModelFailed(**common, runtime_said="CUDA out of memory"),
        "model_stopped": lambda: ev.ModelStopped(**common, detail="agent stopping"),
        ADOPTED_AWAKE: lambda: ev.ModelAdopted(**common, pid=10, endpoint="127.0.0.1:18080"),
        ADOPTED_ASLEEP: lambda: ev.ModelAdopted(**common, pid=10, endpoint="127.0.0.1:18080", asleep=True, level=1),
        ADMITTED: lambda: ev.AdmissionDecided(
            at=at, domain="a", name="qwen3.6:27b", gpu_index=0, admitted=True, vram_bytes=1
        ),
        REFUSED: lambda: ev.AdmissionDecided(
            at=at, domain="a", name="qwen3.6:27b", gpu_index=0, admitted=False, vram_bytes=9, short_by_bytes=7
        ),
    }[key]()


SAMPLE_STATES = {
    "unknown": Unknown(),
    "pulling": Pulling(since=T0, seq=3, reference="qwen3:0.6b", done_bytes=1, total_bytes=10),
    "loading": Loading(since=T0, seq=3, attempt=1),
    "resident": Resident(since=T0, seq=4, warmup_ms=100),
    "sleeping": Sleeping(since=T0, seq=5, level=1),
    "waking": Waking(since=T0, seq=6),
    "lost": Lost(since=T0, seq=7, reason="evicted"),
    "failed": Failed(since=T0, seq=8, runtime_said="no"),
    "stopped": Stopped(since=T0, seq=9),
    "not_admitted": NotAdmitted(since=T0, seq=2, short_by_bytes=5),
}


def test_table_covers_known_states_and_events_only():
    assert set(SAMPLE_STATES) == set(STATE_TAGS)
    for (state, event), result in TRANSITIONS.items():
        assert state in STATE_TAGS and event in RESIDENCY_EVENT_KEYS and result in STATE_TAGS
    assert set(ANSWERS) == set(STATE_TAGS)


LEGAL = sorted(TRANSITIONS.items())


@pytest.mark.parametrize("pair,result", LEGAL, ids=[f"{s}+{e}" for (s, e), _ in LEGAL])
def test_every_legal_transition(pair, result):
    state, key = pair
    event = make_event(key)
    new = evolve(SAMPLE_STATES[state], event, seq=42, subject="haru.evt.f.a.model.x")
    assert state_name(new) == result


ILLEGAL = [(s, e) for s in STATE_TAGS for e in RESIDENCY_EVENT_KEYS if (s, e) not in TRANSITIONS]


@pytest.mark.parametrize("state,key", ILLEGAL, ids=[f"{s}+{e}" for s, e in ILLEGAL])
def test_every_illegal_transition_raises_naming_state_event_subject(state, key):
    subject = "haru.evt.default.a.model.qwen3~2e6~3a27b"
    with pytest.raises(IllegalTransition) as info:
        evolve(SAMPLE_STATES[state], make_event(key), seq=1, subject=subject)
    err = info.value
    assert err.state == state and err.event == key and err.subject == subject
    assert state in str(err) and key in str(err) and subject in str(err)


def test_a_sample_of_illegal_transitions_the_operator_would_expect():
    for state, key in [
        ("unknown", "model_waking"),
        ("resident", "model_loading"),
        ("stopped", "model_resident"),
        ("failed", "model_resident"),
        ("not_admitted", "model_loading"),
        ("resident", "model_waking"),
    ]:
        assert (state, key) not in TRANSITIONS


def test_transition_carries_event_facts():
    s = evolve(UNKNOWN, make_event("model_loading"), seq=11)
    assert s == Loading(since=T1, seq=11, attempt=2, endpoint="127.0.0.1:18080")
    s = evolve(s, make_event("model_resident"), seq=12)
    assert s == Resident(since=T1, seq=12, warmup_ms=256, endpoint="127.0.0.1:18080")
    s = evolve(s, make_event("model_lost"), seq=13)
    assert s == Lost(since=T1, seq=13, reason="gpu_detached", detail="NVML: GPU is lost")
    s = evolve(s, make_event(REFUSED), seq=14)
    assert s == NotAdmitted(since=T1, seq=14, short_by_bytes=7)
    # the runtime it had is stopped: still not admitted, same shortfall
    assert evolve(s, make_event("model_stopped"), seq=15) is s
    assert evolve(s, make_event(ADMITTED), seq=16) == Unknown(since=T1, seq=16)


def test_reobserving_resident_keeps_since():
    s = Resident(since=T0, seq=4, warmup_ms=100)
    again = evolve(s, make_event("model_resident", at=T1), seq=20)
    assert again.since == T0 and again.seq == 4 and again.warmup_ms == 256
    assert evolve(s, make_event(ADMITTED), seq=21) is s


def test_restart_after_lost_is_a_new_attempt():
    s = evolve(Lost(since=T0, seq=3, reason="process_exited"), make_event("model_loading"), seq=4)
    assert isinstance(s, Loading) and s.attempt == 2


def test_to_state_is_lenient():
    for key in RESIDENCY_EVENT_KEYS:
        state = to_state(make_event(key), seq=9)
        assert state.seq == 9 and state.since == T1
    assert state_name(to_state(make_event(ADMITTED))) == "unknown"
    assert to_state(ev.ModelDeclared(at=T0, domain="a", spec=ModelSpec(name="m", slot="s", gpu_index=0))) == Unknown(
        since=T0
    )
    with pytest.raises(IllegalTransition):
        to_state(ev.RouteMoved(at=T0, active="a"))


def test_an_adopted_runtime_keeps_its_residency_and_its_since():
    """An agent restart that adopts a runtime is not a new residency: resident stays resident since
    the same moment, a sleeping runtime stays asleep (issue 14)."""
    resident = evolve(Unknown(since=T0), make_event("model_resident", T0), seq=3)
    after = evolve(resident, make_event(ADOPTED_AWAKE, T1), seq=4)
    assert state_name(after) == "resident" and after.since == T0
    asleep = evolve(evolve(resident, make_event("model_sleeping", T0), seq=5), make_event(ADOPTED_ASLEEP, T1), seq=6)
    assert state_name(asleep) == "sleeping" and asleep.since == T0
    assert event_key(make_event(ADOPTED_ASLEEP)) == ADOPTED_ASLEEP
    for state in ("stopped", "failed", "not_admitted"):  # no runtime there to adopt
        assert (state, ADOPTED_AWAKE) not in TRANSITIONS and (state, ADOPTED_ASLEEP) not in TRANSITIONS


def test_event_key():
    assert event_key(make_event("model_lost")) == "model_lost"
    assert event_key(make_event(ADMITTED)) == ADMITTED and event_key(make_event(REFUSED)) == REFUSED


@pytest.mark.parametrize(
    "alive,gpu,holds,reason",
    [
        (False, True, True, "process_exited"),
        (False, False, False, "process_exited"),
        (False, None, True, "process_exited"),
        (True, False, True, "gpu_detached"),
        (True, False, False, "gpu_detached"),
        (True, True, False, "evicted"),
        (True, None, False, "evicted"),  # no NVML: never blame the provider without evidence
        (True, True, True, "unhealthy"),
        (True, None, True, "unhealthy"),
    ],
)
def test_classify_probe_failure(alive, gpu, holds, reason):
    assert classify_probe_failure(alive, gpu, holds) == reason


def test_answers():
    now = T0 + timedelta(seconds=47, milliseconds=250)
    assert answer(Resident(since=T0), now).answer == "ready"
    w = answer(Loading(since=T0), now)
    assert (w.answer, w.for_ms, w.reason, w.since) == ("warming", 47_250, "loading", T0)
    w = answer(Waking(since=T0), now)
    assert (w.answer, w.for_ms, w.reason) == ("warming", 47_250, "waking")
    assert answer(Loading(since=None), now).for_ms == 0
    assert answer(Loading(since=now + timedelta(seconds=1)), now).for_ms == 0  # clock skew never goes negative
    assert answer(Sleeping(since=T0), now).answer == "asleep"
    a = answer(Lost(since=T0, reason="gpu_detached", detail="x"), now)
    assert (a.answer, a.reason, a.detail) == ("lost", "gpu_detached", "x")
    a = answer(Failed(since=T0, runtime_said="CUDA out of memory"), now)
    assert (a.answer, a.reason, a.detail) == ("lost", "failed", "CUDA out of memory")
    a = answer(Stopped(since=T0, detail="agent stopping"), now)
    assert (a.answer, a.reason) == ("lost", "stopped")
    a = answer(NotAdmitted(short_by_bytes=123), now)
    assert (a.answer, a.short_by_bytes) == ("not_admitted", 123)
    assert answer(UNKNOWN, now).answer == "unknown"


def test_docs_show_the_table():
    md = transition_table_markdown()
    for state in STATE_TAGS:
        assert f"| {state} |" in md
    from pathlib import Path

    doc = Path(__file__).resolve().parents[2] / "docs" / "residency.md"
    assert md in doc.read_text(), "docs/residency.md must carry the table as transition_table_markdown() prints it"
