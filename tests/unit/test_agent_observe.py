"""The agent's decision table (agents/observe.py): what it writes for each observation in each state,
and what it refuses. Given a recorded state, when an observation, then the event (or none)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from haru.agents.errors import IllegalObservation
from haru.agents.observe import (
    DECISIONS,
    NOTHING,
    OBSERVATION_KEYS,
    Adopted,
    Answered,
    Exited,
    GpuGone,
    ProbeFailed,
    PullInterrupted,
    PullProgressed,
    PullRefused,
    Queued,
    Slept,
    Spawned,
    SpawnRefused,
    StillAsleep,
    Unloaded,
    Vanished,
    WakeBegun,
    decision_table_markdown,
    legal_in_fleet_table,
    observation_key,
    observe,
)
from haru.core.events import (
    ModelAdopted,
    ModelFailed,
    ModelLoading,
    ModelLost,
    ModelResident,
    ModelSleeping,
    ModelStopped,
)
from haru.core.residency import (
    STATE_TAGS,
    Failed,
    Loading,
    Lost,
    Pulling,
    Resident,
    Sleeping,
    Stopped,
    Unknown,
    Waking,
    evolve,
    state_name,
)

T = datetime(2026, 12, 1, 1, 0, tzinfo=UTC)
ABOUT = {"at": T, "domain": "a", "model": "m"}

STATES = {
    "unknown": Unknown(),
    "pulling": Pulling(reference="hf:o/r"),
    "loading": Loading(attempt=1),
    "resident": Resident(),
    "sleeping": Sleeping(level=1),
    "waking": Waking(),
    "lost": Lost(reason="unhealthy"),
    "failed": Failed(runtime_said="no"),
    "stopped": Stopped(),
}

# One observation per table key (ProbeFailed's `same`/`new` depends on the state: see below).
EXAMPLES = {
    "pull_progressed": PullProgressed(**ABOUT, reference="hf:o/r", done_bytes=1, total_bytes=2),
    "pull_refused": PullRefused(**ABOUT, reference="hf:o/r", why="404"),
    "pull_interrupted": PullInterrupted(**ABOUT, detail="agent shutdown during the pull"),
    "spawned": Spawned(**ABOUT, endpoint="http://127.0.0.1:1", pid=42, attempt=2),
    "queued": Queued(**ABOUT, waiting_for="its turn on GPU 0 (m0 loading)", attempt=2),
    "spawn_refused": SpawnRefused(**ABOUT, said="no such file"),
    "answered": Answered(**ABOUT, endpoint="http://127.0.0.1:1", warmup_ms=7),
    "exited:expected": Exited(**ABOUT, code=0, expected=True),
    "exited:error": Exited(**ABOUT, code=1, said="exited with code 1 while loading: bad magic", detail="code 1"),
    "exited:gone": Exited(**ABOUT, code=None, detail="the adopted runtime exited"),
    "gpu_gone": GpuGone(**ABOUT, detail="the GPU went away"),
    "slept": Slept(**ABOUT, level=1, freed_bytes=10),
    "wake_begun": WakeBegun(**ABOUT),
    "still_asleep": StillAsleep(**ABOUT),
    "adopted:awake": Adopted(**ABOUT, pid=9, endpoint="http://127.0.0.1:1", asleep=False),
    "adopted:asleep": Adopted(**ABOUT, pid=9, endpoint="http://127.0.0.1:1", asleep=True, level=1),
    "vanished": Vanished(**ABOUT, detail="died while no agent watched"),
    "unloaded:ran": Unloaded(**ABOUT, ran=True, detail="agent shutdown"),
    "unloaded:idle": Unloaded(**ABOUT, ran=False, detail="agent shutdown"),
}


def example(state_tag: str, key: str):
    if key.startswith("probe_failed"):
        same = key == "probe_failed:same"
        # `same`: the loss already recorded for this reason (STATES["lost"] is lost{unhealthy}).
        return ProbeFailed(**ABOUT, reason="unhealthy" if same else "evicted", detail="probe")
    return EXAMPLES[key]


def test_every_entry_writes_an_event_the_fleets_table_accepts():
    for (state, key), outcome in DECISIONS.items():
        assert state in STATE_TAGS and key in OBSERVATION_KEYS, (state, key)
        assert legal_in_fleet_table(state, key), (state, key, outcome)


# Every (state, key) pair, but `probe_failed:same`, which exists only in a lost state with that reason.
PAIRS = [(s, k) for s in STATES for k in OBSERVATION_KEYS if k != "probe_failed:same" or s == "lost"]


@pytest.mark.parametrize(("state_tag", "key"), PAIRS)
def test_observe_follows_the_table_and_refuses_every_pair_it_does_not_hold(state_tag, key):
    state = STATES[state_tag]
    obs = example(state_tag, key)
    assert observation_key(state, obs) == key
    outcome = DECISIONS.get((state_tag, key))
    if outcome is None:
        with pytest.raises(IllegalObservation) as info:
            observe(state, obs)
        assert info.value.state == state_tag and info.value.observation == key and info.value.model == "m"
        assert "agents/observe.py" in str(info.value)
        return
    event = observe(state, obs)
    if outcome == NOTHING:
        assert event is None
        return
    assert type(event).__struct_config__.tag == outcome
    assert (event.at, event.domain, event.model) == (T, "a", "m")
    evolve(state, event)  # the fleet's table takes it (raises IllegalTransition otherwise)


def test_a_load_attempt_from_a_loss_records_loading_then_resident():
    loading = observe(Lost(reason="process_exited"), EXAMPLES["spawned"])
    assert loading == ModelLoading(at=T, domain="a", model="m", endpoint="http://127.0.0.1:1", pid=42, attempt=2)
    state = evolve(Lost(reason="process_exited"), loading, seq=5)
    resident = observe(state, EXAMPLES["answered"])
    assert resident == ModelResident(at=T, domain="a", model="m", endpoint="http://127.0.0.1:1", warmup_ms=7)
    assert observe(evolve(state, resident, seq=6), EXAMPLES["answered"]) is None  # answering again is no news


def test_a_nonzero_exit_while_loading_is_failed_in_the_runtimes_words_and_a_loss_otherwise():
    exited = Exited(
        **ABOUT, code=1, said="exited with code 1 while loading: bad magic", detail="the runtime exited with code 1"
    )
    assert observe(Loading(), exited) == ModelFailed(
        at=T, domain="a", model="m", runtime_said="exited with code 1 while loading: bad magic"
    )
    assert observe(Resident(), exited) == ModelLost(
        at=T, domain="a", model="m", reason="process_exited", detail="the runtime exited with code 1", exit_code=1
    )
    zero = Exited(**ABOUT, code=0, detail="the runtime exited with code 0")
    assert observe(Loading(), zero) == ModelLost(
        at=T, domain="a", model="m", reason="process_exited", detail="the runtime exited with code 0", exit_code=0
    )
    assert observe(Resident(), Exited(**ABOUT, code=1, expected=True)) is None  # the agent stopped it


def test_a_probe_failure_is_news_only_when_the_reason_changes():
    failed = ProbeFailed(**ABOUT, reason="evicted", detail="listed: model gone")
    assert observe(Resident(), failed) == ModelLost(
        at=T, domain="a", model="m", reason="evicted", detail="listed: model gone"
    )
    assert observe(Lost(reason="evicted"), failed) is None
    refined = observe(Lost(reason="unhealthy"), failed)
    assert isinstance(refined, ModelLost) and refined.reason == "evicted"


def test_a_gone_gpu_loses_live_models_once_and_says_nothing_where_nothing_runs():
    gone = EXAMPLES["gpu_gone"]
    for tag in ("loading", "resident", "sleeping", "waking", "unknown"):
        event = observe(STATES[tag], gone)
        assert isinstance(event, ModelLost) and event.reason == "gpu_detached", tag
    for tag in ("lost", "failed", "stopped", "pulling"):
        assert observe(STATES[tag], gone) is None, tag


def test_sleep_and_wake():
    assert observe(Resident(), EXAMPLES["slept"]) == ModelSleeping(at=T, domain="a", model="m", level=1, freed_bytes=10)
    waking = observe(Sleeping(), EXAMPLES["wake_begun"])
    assert type(waking).__struct_config__.tag == "model_waking"
    assert observe(Waking(), EXAMPLES["wake_begun"]) is None  # a retried wake
    assert observe(Waking(), EXAMPLES["still_asleep"]) == ModelSleeping(at=T, domain="a", model="m", level=1)
    with pytest.raises(IllegalObservation, match="wake_begun"):
        observe(Resident(), EXAMPLES["wake_begun"])  # the shell answers "already awake" before asking
    with pytest.raises(IllegalObservation, match="slept"):
        observe(Lost(reason="evicted"), EXAMPLES["slept"])


def test_adoption_keeps_the_state_found_and_refuses_to_adopt_a_failed_or_stopped_model():
    asleep = observe(Loading(), EXAMPLES["adopted:asleep"])
    assert isinstance(asleep, ModelAdopted) and asleep.asleep
    assert state_name(evolve(Loading(), asleep)) == "sleeping"
    assert state_name(evolve(Unknown(), observe(Unknown(), EXAMPLES["adopted:awake"]))) == "resident"
    for tag in ("failed", "stopped", "pulling"):
        with pytest.raises(IllegalObservation):
            observe(STATES[tag], EXAMPLES["adopted:awake"])


def test_unloading_records_stopped_only_when_something_ran():
    stopped = ModelStopped(at=T, domain="a", model="m", detail="agent shutdown")
    for tag in ("loading", "resident", "sleeping", "waking", "lost"):
        assert observe(STATES[tag], EXAMPLES["unloaded:ran"]) == stopped, tag
        assert observe(STATES[tag], EXAMPLES["unloaded:idle"]) is None, tag
    assert observe(Stopped(), EXAMPLES["unloaded:ran"]) is None
    assert observe(Pulling(reference="r"), EXAMPLES["pull_interrupted"]) == ModelStopped(
        at=T, domain="a", model="m", detail="agent shutdown during the pull"
    )


def test_a_runtime_that_vanished_unwatched_is_lost_once():
    lost = observe(Resident(), EXAMPLES["vanished"])
    assert lost == ModelLost(at=T, domain="a", model="m", reason="process_exited", detail="died while no agent watched")
    assert observe(Lost(reason="process_exited"), EXAMPLES["vanished"]) is None


def test_the_agents_own_illegal_steps_are_refused():
    with pytest.raises(IllegalObservation, match="`spawned` of model 'm' recorded `resident`"):
        observe(Resident(), EXAMPLES["spawned"])  # a second runtime over a resident one
    with pytest.raises(IllegalObservation):
        observe(Stopped(), EXAMPLES["answered"])  # a stopped model cannot answer
    with pytest.raises(IllegalObservation):
        observe(Failed(), EXAMPLES["exited:gone"])  # nothing ran after it failed
    with pytest.raises(IllegalObservation):
        observe(Resident(), EXAMPLES["pull_progressed"])
    assert observe(Pulling(reference="r"), EXAMPLES["pull_refused"]) == ModelFailed(
        at=T, domain="a", model="m", runtime_said="pull hf:o/r: 404"
    )


def test_the_markdown_table_names_every_observation_and_refusal():
    md = decision_table_markdown()
    for key in OBSERVATION_KEYS:
        assert f"| `{key}` |" in md
    assert (
        "| `spawned` | loading | loading | loading | refused | refused | refused | loading | loading | loading |" in md
    )


def test_a_probe_that_finds_the_gpu_gone_refines_a_loss_but_a_gone_gpu_alone_does_not():
    # the periodic probe's diagnosis: lost{unhealthy} -> lost{gpu_detached}
    refined = observe(Lost(reason="unhealthy"), ProbeFailed(**ABOUT, reason="gpu_detached", detail="health: 503"))
    assert isinstance(refined, ModelLost) and refined.reason == "gpu_detached"
    # asked to sleep on a GPU that is gone: a model already lost (for any reason) stays as recorded
    assert observe(Lost(reason="unhealthy"), EXAMPLES["gpu_gone"]) is None


def test_a_model_waiting_for_its_gpu_is_loading_and_says_what_it_waits_for():
    queued = observe(Lost(reason="process_exited"), EXAMPLES["queued"])
    assert isinstance(queued, ModelLoading) and queued.pid == 0
    assert queued.waiting_for == "its turn on GPU 0 (m0 loading)"
    state = evolve(Lost(reason="process_exited"), queued, seq=5)
    assert state_name(state) == "loading" and state.waiting_for == "its turn on GPU 0 (m0 loading)"
    # the turn comes: its runtime is spawned, and the wait is over (the next loading says no wait)
    spawned = observe(state, EXAMPLES["spawned"])
    assert isinstance(spawned, ModelLoading) and spawned.waiting_for == "" and spawned.pid == 42
    assert evolve(state, spawned, seq=6).waiting_for == ""
