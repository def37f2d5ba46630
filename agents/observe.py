"""What the agent writes about a model, decided by one table: `observe(state, observation) -> event | None`.

Pure: no I/O, no clock, no logging. The agent's shell sees something about a runtime (it spawned, it
answered, it exited, a probe failed, the GPU went away, it was put to sleep...) and hands that
observation, with the model's residency as recorded, to `observe`. The answer is the residency event to
append, or None when the observation changes nothing the log does not already say (a probe that fails
for the reason already recorded, an exit the agent caused itself). A pair the table does not hold is
the agent's own bug: `observe` raises `IllegalObservation` (as h11 raises on its own illegal events)
instead of writing a history the fleet's table (`haru.core.residency.TRANSITIONS`) would refuse.

    DECISIONS[(state, observation key)] -> event tag to write, or NOTHING

The observation key is the observation's tag, split where what to write depends on a field
(`exited:expected|error|gone`, `probe_failed:same|new`, `adopted:awake|asleep`, `unloaded:ran|idle`),
as `haru.core.residency.event_key` splits `admission_decided`. tests/unit/test_agent_observe.py walks
every entry (each writes an event the fleet's table accepts from that state) and every refusal;
docs/agent.md shows the table (`decision_table_markdown`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import msgspec

from haru.agents.errors import IllegalObservation
from haru.core.events import (
    Event,
    FetchedFile,
    LostReason,
    ModelAdopted,
    ModelFailed,
    ModelLoading,
    ModelLost,
    ModelPulling,
    ModelResident,
    ModelSleeping,
    ModelStopped,
    ModelWaking,
)
from haru.core.residency import ADOPTED_ASLEEP, ADOPTED_AWAKE, Residency, is_legal, state_name

__all__ = [
    "Observation",
    "PullProgressed",
    "PullRefused",
    "PullInterrupted",
    "Spawned",
    "Queued",
    "SpawnRefused",
    "Answered",
    "Exited",
    "ProbeFailed",
    "GpuGone",
    "Slept",
    "WakeBegun",
    "StillAsleep",
    "Adopted",
    "Vanished",
    "Unloaded",
    "DECISIONS",
    "NOTHING",
    "observation_key",
    "observe",
    "decision_table_markdown",
]


class Observation(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """Something the agent saw about one model's runtime, at `at`."""

    at: datetime
    domain: str
    model: str


class PullProgressed(Observation, frozen=True, kw_only=True, tag="pull_progressed"):
    """A layout's reference is being fetched: bytes done of total (the files, once all are verified)."""

    reference: str
    done_bytes: int = 0
    total_bytes: int = 0
    origin: str = ""
    files: list[FetchedFile] = []


class PullRefused(Observation, frozen=True, kw_only=True, tag="pull_refused"):
    """The registry said no (404, 401, a digest mismatch), or the reference names another runtime."""

    reference: str
    why: str


class PullInterrupted(Observation, frozen=True, kw_only=True, tag="pull_interrupted"):
    """The agent stopped mid-pull: nothing runs; the partial file stays for the next start."""

    detail: str = ""


class Spawned(Observation, frozen=True, kw_only=True, tag="spawned"):
    """A load attempt began (pid 0: the runtime could not even be started; `SpawnRefused` follows)."""

    endpoint: str = ""
    pid: int = 0
    attempt: int = 1
    sleep_mode: str = ""  # a vLLM's: "on: ..." / "off: ..." (how it was learned)


class Queued(Observation, frozen=True, kw_only=True, tag="queued"):
    """A load attempt waits for its GPU's turn before its runtime is started (agents/load_queue.py)."""

    waiting_for: str
    attempt: int = 1


class SpawnRefused(Observation, frozen=True, kw_only=True, tag="spawn_refused"):
    """The runtime (or the OS) refused to start it, in its own words."""

    said: str


class Answered(Observation, frozen=True, kw_only=True, tag="answered"):
    """Health passed, the model is listed and a one-token completion answered (after `warmup_ms`)."""

    endpoint: str = ""
    warmup_ms: int = 0
    sleeps: bool = True  # the runtime can be put to sleep (a vLLM on a platform without sleep mode cannot)


class Exited(Observation, frozen=True, kw_only=True, tag="exited"):
    """The runtime's process exited. `expected`: the agent stopped it itself (or is stopping).
    `said`: its own error lines, for a refusal while loading; `detail`: what to say about a loss."""

    code: int | None = None
    expected: bool = False
    said: str = ""
    detail: str = ""


class ProbeFailed(Observation, frozen=True, kw_only=True, tag="probe_failed"):
    """A probe failed, diagnosed with the one bit (`haru.core.residency` / `agents.probes.diagnose`)."""

    reason: LostReason
    detail: str = ""


class GpuGone(Observation, frozen=True, kw_only=True, tag="gpu_gone"):
    """The model's GPU was there and is not: the provider took it."""

    detail: str = ""


class Slept(Observation, frozen=True, kw_only=True, tag="slept"):
    """The runtime is asleep at `level`, verified by /is_sleeping; `freed_bytes` as the GPU showed."""

    level: int = 1
    freed_bytes: int = 0
    measured_by: str = ""  # "process" | "gpu" | "" (nothing could measure)
    detail: str = ""


class WakeBegun(Observation, frozen=True, kw_only=True, tag="wake_begun"):
    """A wake was asked of a sleeping runtime."""


class StillAsleep(Observation, frozen=True, kw_only=True, tag="still_asleep"):
    """A wake failed and the runtime says it is still asleep."""

    level: int = 1


class Adopted(Observation, frozen=True, kw_only=True, tag="adopted"):
    """A runtime that outlived the previous agent answers and runs the planned command line: kept."""

    pid: int = 0
    endpoint: str = ""
    asleep: bool = False
    level: int = 1
    detail: str = ""
    sleeps: bool = True  # the runtime can be put to sleep (as launched: a vLLM with --enable-sleep-mode)


class Vanished(Observation, frozen=True, kw_only=True, tag="vanished"):
    """The runtime the log says is live is gone: it died while no agent watched it."""

    detail: str = ""


class Unloaded(Observation, frozen=True, kw_only=True, tag="unloaded"):
    """The agent stopped the runtime on purpose. `ran`: there was a process to stop (or an external one)."""

    ran: bool = True
    detail: str = ""


AnyObservation = (
    PullProgressed
    | PullRefused
    | PullInterrupted
    | Spawned
    | Queued
    | SpawnRefused
    | Answered
    | Exited
    | ProbeFailed
    | GpuGone
    | Slept
    | WakeBegun
    | StillAsleep
    | Adopted
    | Vanished
    | Unloaded
)

NOTHING = ""  # the decision to write nothing: the log already says it, or the agent caused it

_LIVE = ("loading", "resident", "sleeping", "waking")


def _rows(states: tuple[str, ...] | list[str], key: str, outcome: str) -> dict[tuple[str, str], str]:
    return {(s, key): outcome for s in states}


# (recorded state, observation key) -> the event tag to write, or NOTHING. Every pair not listed is refused.
DECISIONS: dict[tuple[str, str], str] = {
    # A layout's reference is pulled before each load attempt (agents/pulling.py).
    **_rows(("unknown", "pulling", "failed", "lost", "stopped"), "pull_progressed", "model_pulling"),
    ("pulling", "pull_refused"): "model_failed",
    ("pulling", "pull_interrupted"): "model_stopped",
    # A load attempt: every attempt is a new `model_loading`, from wherever the last one ended.
    **_rows(("unknown", "pulling", "loading", "lost", "failed", "stopped"), "spawned", "model_loading"),
    ("loading", "spawn_refused"): "model_failed",
    # It waits for its GPU's turn (one cold load at a time per GPU): `loading`, saying what it waits for.
    **_rows(("unknown", "pulling", "loading", "lost", "failed", "stopped"), "queued", "model_loading"),
    # It answers: resident (once; a resident model answering again is no news).
    **_rows(("loading", "waking", "sleeping", "lost"), "answered", "model_resident"),
    ("resident", "answered"): NOTHING,
    # Its process exited. The agent's own stop is no news; a nonzero exit before it ever answered is the
    # runtime refusing the model (`failed`, in its words); any other exit is a loss.
    **_rows(("unknown", "pulling", *_LIVE, "lost", "failed", "stopped"), "exited:expected", NOTHING),
    ("loading", "exited:error"): "model_failed",
    **_rows(("resident", "sleeping", "waking", "lost"), "exited:error", "model_lost"),
    **_rows((*_LIVE, "lost"), "exited:gone", "model_lost"),
    # A probe failed: a loss, unless the loss is already recorded for the same reason.
    **_rows((*_LIVE, "lost"), "probe_failed:new", "model_lost"),
    ("lost", "probe_failed:same"): NOTHING,
    # The GPU went away: every live model on it is lost; where nothing runs there is nothing to lose.
    **_rows(("unknown", *_LIVE), "gpu_gone", "model_lost"),
    **_rows(("lost", "failed", "stopped", "pulling"), "gpu_gone", NOTHING),
    # Sleep and wake, as /is_sleeping verified them.
    **_rows(("resident", "waking", "sleeping"), "slept", "model_sleeping"),
    ("sleeping", "wake_begun"): "model_waking",
    ("waking", "wake_begun"): NOTHING,  # the promoter retried the (idempotent) wake
    ("waking", "still_asleep"): "model_sleeping",
    # A runtime that outlived its agent, kept by this one, as it was found.
    **_rows(("unknown", *_LIVE, "lost"), "adopted:awake", "model_adopted"),
    **_rows(("unknown", *_LIVE, "lost"), "adopted:asleep", "model_adopted"),
    # The log says live, but the runtime died while no agent watched it: said once, before the reload.
    **_rows(_LIVE, "vanished", "model_lost"),
    **_rows(("unknown", "pulling", "lost", "failed", "stopped"), "vanished", NOTHING),
    # Unloaded on purpose: `stopped` when something ran (a loss is over too: the runtime is gone for good).
    **_rows((*_LIVE, "lost"), "unloaded:ran", "model_stopped"),
    **_rows(("unknown", "pulling", "failed", "stopped"), "unloaded:ran", NOTHING),
    **_rows(("unknown", "pulling", *_LIVE, "lost", "failed", "stopped"), "unloaded:idle", NOTHING),
}

OBSERVATION_KEYS: tuple[str, ...] = (
    "pull_progressed",
    "pull_refused",
    "pull_interrupted",
    "spawned",
    "queued",
    "spawn_refused",
    "answered",
    "exited:expected",
    "exited:error",
    "exited:gone",
    "probe_failed:new",
    "probe_failed:same",
    "gpu_gone",
    "slept",
    "wake_begun",
    "still_asleep",
    "adopted:awake",
    "adopted:asleep",
    "vanished",
    "unloaded:ran",
    "unloaded:idle",
)


def _tag(observation: Observation) -> str:
    return type(observation).__struct_config__.tag  # type: ignore[return-value]


def observation_key(state: Residency, observation: Observation) -> str:
    """The table's name for an observation in a state: its tag, split where a field decides."""
    tag = _tag(observation)
    if isinstance(observation, Exited):
        if observation.expected:
            return "exited:expected"
        return "exited:error" if observation.code is not None and observation.code > 0 else "exited:gone"
    if isinstance(observation, ProbeFailed):
        same = state_name(state) == "lost" and getattr(state, "reason", "") == observation.reason
        return "probe_failed:same" if same else "probe_failed:new"
    if isinstance(observation, Adopted):
        return "adopted:asleep" if observation.asleep else "adopted:awake"
    if isinstance(observation, Unloaded):
        return "unloaded:ran" if observation.ran else "unloaded:idle"
    return tag


def _lost(o: Any, reason: str, detail: str, exit_code: int | None = None) -> ModelLost:
    return ModelLost(
        at=o.at,
        domain=o.domain,
        model=o.model,
        reason=reason,  # type: ignore[arg-type]
        detail=detail,
        exit_code=exit_code,
    )


# observation key -> how the event the table names is built from the observation's fields
_BUILD: dict[str, Callable[[Any], Event]] = {
    "pull_progressed": lambda o: ModelPulling(
        at=o.at,
        domain=o.domain,
        model=o.model,
        reference=o.reference,
        done_bytes=o.done_bytes,
        total_bytes=o.total_bytes,
        origin=o.origin,
        files=list(o.files),
    ),
    "pull_refused": lambda o: ModelFailed(
        at=o.at, domain=o.domain, model=o.model, runtime_said=f"pull {o.reference}: {o.why}"
    ),
    "pull_interrupted": lambda o: ModelStopped(at=o.at, domain=o.domain, model=o.model, detail=o.detail),
    "spawned": lambda o: ModelLoading(
        at=o.at,
        domain=o.domain,
        model=o.model,
        endpoint=o.endpoint,
        pid=o.pid,
        attempt=o.attempt,
        sleep_mode=o.sleep_mode,
    ),
    "queued": lambda o: ModelLoading(
        at=o.at, domain=o.domain, model=o.model, attempt=o.attempt, waiting_for=o.waiting_for
    ),
    "spawn_refused": lambda o: ModelFailed(at=o.at, domain=o.domain, model=o.model, runtime_said=o.said),
    "answered": lambda o: ModelResident(
        at=o.at, domain=o.domain, model=o.model, endpoint=o.endpoint, warmup_ms=o.warmup_ms, sleeps=o.sleeps
    ),
    "exited:error": lambda o: _lost(o, "process_exited", o.detail, o.code),
    "exited:gone": lambda o: _lost(o, "process_exited", o.detail, o.code),
    "probe_failed:new": lambda o: _lost(o, o.reason, o.detail),
    "gpu_gone": lambda o: _lost(o, "gpu_detached", o.detail),
    "slept": lambda o: ModelSleeping(
        at=o.at,
        domain=o.domain,
        model=o.model,
        level=o.level,
        freed_bytes=o.freed_bytes,
        measured_by=o.measured_by,
        detail=o.detail,
    ),
    "wake_begun": lambda o: ModelWaking(at=o.at, domain=o.domain, model=o.model),
    "still_asleep": lambda o: ModelSleeping(at=o.at, domain=o.domain, model=o.model, level=o.level),
    "adopted:awake": lambda o: ModelAdopted(
        at=o.at,
        domain=o.domain,
        model=o.model,
        pid=o.pid,
        endpoint=o.endpoint,
        asleep=False,
        level=o.level,
        detail=o.detail,
        sleeps=o.sleeps,
    ),
    "adopted:asleep": lambda o: ModelAdopted(
        at=o.at,
        domain=o.domain,
        model=o.model,
        pid=o.pid,
        endpoint=o.endpoint,
        asleep=True,
        level=o.level,
        detail=o.detail,
    ),
    "vanished": lambda o: _lost(o, "process_exited", o.detail),
    "unloaded:ran": lambda o: ModelStopped(at=o.at, domain=o.domain, model=o.model, detail=o.detail),
}


def _build(key: str, outcome: str, o: Observation) -> Event:
    if key == "exited:error" and outcome == "model_failed":  # refused the model before it ever answered
        return ModelFailed(at=o.at, domain=o.domain, model=o.model, runtime_said=o.said)  # type: ignore[attr-defined]
    return _BUILD[key](o)


def observe(state: Residency, observation: Observation) -> Event | None:
    """The residency event to write for `observation` of a model recorded in `state`, or None.

    Raises IllegalObservation when the table has no decision for the pair: the agent's own bug, said
    loudly instead of appended."""
    current = state_name(state)
    key = observation_key(state, observation)
    outcome = DECISIONS.get((current, key))
    if outcome is None:
        raise IllegalObservation(observation.model, current, key)
    if outcome == NOTHING:
        return None
    return _build(key, outcome, observation)


def _event_key(outcome: str, key: str) -> str:
    """The fleet table's key for the event an entry writes (model_adopted is split by how it was found)."""
    if outcome == "model_adopted":
        return ADOPTED_ASLEEP if key == "adopted:asleep" else ADOPTED_AWAKE
    return outcome


def legal_in_fleet_table(state: str, key: str) -> bool:
    """Whether the event an entry writes is one the fleet's residency table accepts from `state`."""
    outcome = DECISIONS[(state, key)]
    return outcome == NOTHING or is_legal(state, _event_key(outcome, key))


def decision_table_markdown() -> str:
    """The table as markdown (docs/agent.md): one row per observation, one column per state."""
    states = ("unknown", "pulling", "loading", "resident", "sleeping", "waking", "lost", "failed", "stopped")
    head = "| observation | " + " | ".join(states) + " |\n|---|" + "---|" * len(states) + "\n"
    rows = []
    for key in OBSERVATION_KEYS:
        cells = []
        for s in states:
            outcome = DECISIONS.get((s, key))
            cells.append(
                "refused" if outcome is None else "–" if outcome == NOTHING else outcome.removeprefix("model_")
            )
        rows.append(f"| `{key}` | " + " | ".join(cells) + " |")
    return head + "\n".join(rows) + "\n"
