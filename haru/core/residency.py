"""Residency: the named state of one declared model on one domain, with its named reason.

Pure: no I/O, no clock. Time arrives as arguments.

States (a tagged union on `state`):

    unknown                      never probed
    pulling{since, done, total}  a layout's reference being fetched into the store (haru.models); reports bytes
    loading{since, attempt}      weights materializing; reports elapsed time, never times out
                                 (`waiting_for`: not spawned yet, waiting for its GPU's turn)
    resident{since, warmup_ms}   loaded AND answering AND accounted for
    sleeping{level}              vLLM level-1 sleep: weights in CPU RAM, VRAM freed
    waking{since}                coming back from sleep
    (model_adopted keeps a runtime that outlived its agent: resident, or sleeping if found asleep)
    lost{reason, detail}         evicted | gpu_detached | process_exited | unhealthy
    failed{runtime_said}         will not load, and what the runtime said
    stopped                      unloaded on purpose
    not_admitted{short_by_bytes} the planner refused it: the card is that many bytes short

Router answers: ready · warming{for_ms} · asleep · lost{reason} · not_admitted{short_by} · unknown.

The legal transitions are one table, `TRANSITIONS[(state, event_key)] -> state`, read by `evolve`
(which raises IllegalTransition for any other pair), by tests/unit/test_residency.py (every entry, and
every pair that is not one) and by docs/residency.md (`transition_table_markdown`); `evolve`
memoizes, per (state class, event class), the branch the table takes (`_step`). `to_state(event)`
is the state an event establishes on its own, for lenient readers of odd histories.
`classify_probe_failure` is the one-bit diagnosis; `answer(state, now)` the router answer, by `ANSWERS`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal

import msgspec

from haru.core.errors import IllegalTransition
from haru.core.events import AdmissionDecided, LostReason, ModelAdopted


class State(msgspec.Struct, frozen=True, kw_only=True, tag_field="state"):
    since: datetime | None = None  # when the writer observed the event that made this state
    seq: int = 0  # stream sequence of that event (0 = not from the log)


class Unknown(State, frozen=True, kw_only=True, tag="unknown"):
    pass


class Pulling(State, frozen=True, kw_only=True, tag="pulling"):
    reference: str = ""
    done_bytes: int = 0
    total_bytes: int = 0


class Loading(State, frozen=True, kw_only=True, tag="loading"):
    attempt: int = 1
    endpoint: str = ""
    waiting_for: str = ""  # not spawned yet: its GPU's turn (one cold load at a time per GPU)


class Resident(State, frozen=True, kw_only=True, tag="resident"):
    warmup_ms: int = 0
    endpoint: str = ""
    sleeps: bool = True  # False: its runtime cannot sleep (learned at launch); a standby keeps it resident


class Sleeping(State, frozen=True, kw_only=True, tag="sleeping"):
    level: int = 1


class Waking(State, frozen=True, kw_only=True, tag="waking"):
    pass


class Lost(State, frozen=True, kw_only=True, tag="lost"):
    reason: LostReason
    detail: str = ""


class Failed(State, frozen=True, kw_only=True, tag="failed"):
    runtime_said: str = ""


class Stopped(State, frozen=True, kw_only=True, tag="stopped"):
    detail: str = ""


class NotAdmitted(State, frozen=True, kw_only=True, tag="not_admitted"):
    short_by_bytes: int = 0


Residency = Unknown | Pulling | Loading | Resident | Sleeping | Waking | Lost | Failed | Stopped | NotAdmitted

UNKNOWN = Unknown()

AnswerKind = Literal["ready", "warming", "asleep", "lost", "not_admitted", "unknown"]


class Answer(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a router should do about one model. `since` lets a reader recompute `for_ms` later."""

    answer: AnswerKind
    for_ms: int = 0
    since: datetime | None = None
    reason: str = ""
    short_by_bytes: int = 0
    detail: str = (
        ""  # lost: the probe's detail; failed: what the runtime said; stopped: why; loading: what it waits for
    )


def _tag(value: object) -> str:
    """The tag of a tagged Struct (a state or an event), cached per class: reading
    `__struct_config__` builds a new config object each time, and the fold reads it several
    times per event."""
    cls = type(value)
    tag = _TAGS.get(cls)
    if tag is None:
        tag = _TAGS[cls] = cls.__struct_config__.tag  # type: ignore[attr-defined]
    return tag


_TAGS: dict[type, str] = {}


def state_name(state: State) -> str:
    return _tag(state)


# ------------------------------------------------------------------------------ the transition table
#
# Events as the table sees them: a residency event's tag, or the planner's verdict split in two.
ADMITTED = "admission_decided:admitted"
REFUSED = "admission_decided:not_admitted"
# A runtime a starting agent adopted (haru.core.events.ModelAdopted), split by how it was found.
ADOPTED_AWAKE = "model_adopted:awake"
ADOPTED_ASLEEP = "model_adopted:asleep"

RESIDENCY_EVENT_KEYS: tuple[str, ...] = (
    "model_pulling",
    "model_loading",
    "model_resident",
    "model_sleeping",
    "model_waking",
    "model_lost",
    "model_failed",
    "model_stopped",
    ADOPTED_AWAKE,
    ADOPTED_ASLEEP,
    ADMITTED,
    REFUSED,
)

STATE_TAGS: tuple[str, ...] = (
    "unknown",
    "pulling",
    "loading",
    "resident",
    "sleeping",
    "waking",
    "lost",
    "failed",
    "stopped",
    "not_admitted",
)

# (state, event) -> resulting state. Every pair not listed is illegal. The code (`evolve`), the tests
# (tests/unit/test_residency.py walks it) and the docs (docs/residency.md, generated from it by
# `transition_table_markdown`) all read this one table.
TRANSITIONS: dict[tuple[str, str], str] = {
    # unknown: never probed. The first observation may be anything the agent finds, except a wake
    # (waking needs a known sleeper). An agent that restarts adopts a running runtime as it finds it.
    ("unknown", "model_loading"): "loading",
    ("unknown", "model_resident"): "resident",
    ("unknown", "model_sleeping"): "sleeping",
    ("unknown", "model_lost"): "lost",
    ("unknown", "model_failed"): "failed",
    ("unknown", "model_stopped"): "stopped",
    # pulling: a layout's reference is fetched into the store before the runtime starts (haru.models).
    ("unknown", "model_pulling"): "pulling",
    ("pulling", "model_pulling"): "pulling",  # progress: bytes done of total, and the files once verified
    ("pulling", "model_loading"): "loading",  # every file verified: the runtime starts
    ("pulling", "model_failed"): "failed",  # the registry said no (404, 401, a digest mismatch): its words
    ("pulling", "model_stopped"): "stopped",  # the agent stopped mid-pull (the .part stays, to resume)
    ("failed", "model_pulling"): "pulling",  # a new attempt (backoff) resumes the pull
    ("lost", "model_pulling"): "pulling",
    ("stopped", "model_pulling"): "pulling",
    # loading: weights materializing; never fails on a clock, ends in one of these.
    ("loading", "model_loading"): "loading",  # a new attempt (restart with backoff), reported afresh
    ("loading", "model_resident"): "resident",
    ("loading", "model_lost"): "lost",  # the process exited or the GPU went away mid-load
    ("loading", "model_failed"): "failed",  # the runtime refused, and said why
    ("loading", "model_stopped"): "stopped",  # unloaded on purpose before it finished
    # resident: loaded AND answering AND accounted for.
    ("resident", "model_resident"): "resident",  # re-observed (agent restart): keeps its `since`
    ("resident", "model_sleeping"): "sleeping",  # demoted to standby
    ("resident", "model_lost"): "lost",
    ("resident", "model_stopped"): "stopped",
    # sleeping: vLLM level-1 sleep, weights in CPU RAM, VRAM freed.
    ("sleeping", "model_sleeping"): "sleeping",  # re-observed, or a level change
    ("sleeping", "model_waking"): "waking",
    ("sleeping", "model_resident"): "resident",  # woke (an agent that restarted finds it awake)
    ("sleeping", "model_lost"): "lost",
    ("sleeping", "model_stopped"): "stopped",
    # waking: coming back from sleep.
    ("waking", "model_waking"): "waking",  # the promoter retried the (idempotent) wake
    ("waking", "model_resident"): "resident",
    ("waking", "model_sleeping"): "sleeping",  # the wake was abandoned and it was put back to sleep
    ("waking", "model_lost"): "lost",
    ("waking", "model_failed"): "failed",  # the runtime refused to wake (e.g. out of memory), and said why
    ("waking", "model_stopped"): "stopped",
    # lost: the agent restarts it, or it recovers, or the diagnosis is refined.
    ("lost", "model_loading"): "loading",  # restart
    ("lost", "model_resident"): "resident",  # recovered (unhealthy answered again; GPU came back)
    ("lost", "model_lost"): "lost",  # a new or refined reason (unhealthy, then process_exited)
    ("lost", "model_stopped"): "stopped",
    # failed: only a new attempt (after the operator changed something) or a stop.
    ("failed", "model_loading"): "loading",
    ("failed", "model_stopped"): "stopped",
    # stopped: unloaded on purpose; only a new load brings it back.
    ("stopped", "model_loading"): "loading",
    # not_admitted: the agent must not run it. It may report the stop (or the exit) of a runtime it had
    # running before a layout change refused the model; anything else is a writer's bug.
    ("not_admitted", "model_stopped"): "not_admitted",
    ("not_admitted", "model_lost"): "not_admitted",
    ("not_admitted", ADMITTED): "unknown",  # a new layout makes it fit: unknown until observed
    ("not_admitted", REFUSED): "not_admitted",  # still refused; the shortfall may have changed
}
# A runtime that outlived its agent, adopted by the next one (no load): whatever the previous agent last
# recorded while the process lived (it may have died mid-load or mid-wake), the state is what is found.
for _s in ("unknown", "loading", "resident", "sleeping", "waking", "lost"):
    TRANSITIONS[(_s, ADOPTED_AWAKE)] = "resident"
    TRANSITIONS[(_s, ADOPTED_ASLEEP)] = "sleeping"
# The planner's verdict applies in every state: refused -> not_admitted; admitted keeps what is observed.
for _s in STATE_TAGS:
    if _s != "not_admitted":
        TRANSITIONS[(_s, REFUSED)] = "not_admitted"
        TRANSITIONS[(_s, ADMITTED)] = _s
del _s


def event_key(event: object) -> str:
    """The table's name for an event: its tag, or `admission_decided:admitted|not_admitted`."""
    tag = _tag(event)
    if isinstance(event, AdmissionDecided):
        return ADMITTED if event.admitted else REFUSED
    if isinstance(event, ModelAdopted):
        return ADOPTED_ASLEEP if event.asleep else ADOPTED_AWAKE
    return tag


def is_legal(state: str, event: str) -> bool:
    return (state, event) in TRANSITIONS


def to_state(event: object, seq: int = 0) -> Residency:
    """The state an event establishes, whatever came before (a lenient reader's fallback).

    `model_declared` establishes `unknown`; a refused admission `not_admitted`; an accepted one
    `unknown` (nothing observed yet). Raises IllegalTransition for events that are not about residency.
    """
    return _to_state(event, seq, event_key(event))


def _to_state(event: object, seq: int, key: str) -> Residency:
    build = _ESTABLISHES.get(key)
    if build is None:
        raise IllegalTransition("any", key)
    return build(event, getattr(event, "at", None), seq)


# event key -> the state it establishes (read by to_state; one dict lookup instead of a chain of ifs)
_ESTABLISHES: dict[str, Callable[[Any, datetime | None, int], Residency]] = {
    "model_declared": lambda e, at, seq: Unknown(since=at, seq=seq),
    "model_pulling": lambda e, at, seq: Pulling(
        since=at, seq=seq, reference=e.reference, done_bytes=e.done_bytes, total_bytes=e.total_bytes
    ),
    ADMITTED: lambda e, at, seq: Unknown(since=at, seq=seq),
    REFUSED: lambda e, at, seq: NotAdmitted(since=at, seq=seq, short_by_bytes=e.short_by_bytes),
    "model_loading": lambda e, at, seq: Loading(
        since=at, seq=seq, attempt=e.attempt, endpoint=e.endpoint, waiting_for=e.waiting_for
    ),
    "model_resident": lambda e, at, seq: Resident(
        since=at, seq=seq, warmup_ms=e.warmup_ms, endpoint=e.endpoint, sleeps=e.sleeps
    ),
    "model_sleeping": lambda e, at, seq: Sleeping(since=at, seq=seq, level=e.level),
    "model_waking": lambda e, at, seq: Waking(since=at, seq=seq),
    "model_lost": lambda e, at, seq: Lost(since=at, seq=seq, reason=e.reason, detail=e.detail),
    "model_failed": lambda e, at, seq: Failed(since=at, seq=seq, runtime_said=e.runtime_said),
    "model_stopped": lambda e, at, seq: Stopped(since=at, seq=seq, detail=e.detail),
    ADOPTED_AWAKE: lambda e, at, seq: Resident(since=at, seq=seq, endpoint=e.endpoint, sleeps=e.sleeps),
    ADOPTED_ASLEEP: lambda e, at, seq: Sleeping(since=at, seq=seq, level=e.level),
}


def evolve(state: Residency, event: object, *, seq: int = 0, subject: str = "") -> Residency:
    """The next residency state, by the table. Raises IllegalTransition naming state, event, subject.

    Self-transitions that re-observe the same condition (resident -> resident, sleeping -> sleeping at
    the same level, an admitted verdict) keep the original `since`, so "resident for 14203s" survives
    an agent restart. A model that is not admitted stays not admitted when its runtime reports a stop.
    """
    # The hot path of every replay: a legal (state, residency event) pair has its step memoized.
    step = _STEPS[type(state), type(event)]
    if step is not None:
        return step(state, event, seq)
    return _evolve(state, event, seq, subject)


def _evolve(state: Residency, event: object, seq: int, subject: str) -> Residency:
    """`evolve`, read from the table (every pair; `_step` memoizes the legal residency ones)."""
    # event_key and _tag inlined.
    current = _TAGS.get(type(state)) or _tag(state)
    key = _TAGS.get(type(event)) or _tag(event)
    if key == "admission_decided" and isinstance(event, AdmissionDecided):
        key = ADMITTED if event.admitted else REFUSED
    elif key == "model_adopted" and isinstance(event, ModelAdopted):
        key = ADOPTED_ASLEEP if event.asleep else ADOPTED_AWAKE
    result = TRANSITIONS.get((current, key))
    if result is None:
        raise IllegalTransition(current, key, subject)
    if key == ADMITTED and result == current:
        return state
    if result == "not_admitted" and key != REFUSED:
        return state  # a runtime stopping or exiting changes nothing about the planner's verdict
    new = _to_state(event, seq, key)
    if result != (_TAGS.get(type(new)) or _tag(new)):  # admitted on not_admitted -> unknown (to_state already gives it)
        raise IllegalTransition(current, key, subject)  # pragma: no cover - the table and to_state agree
    if current == result and result == "resident":
        return msgspec.structs.replace(new, since=state.since, seq=state.seq)
    if current == result == "pulling":  # progress of the same pull: "pulling for 47s" keeps counting
        return msgspec.structs.replace(new, since=state.since)
    if isinstance(state, Sleeping) and isinstance(new, Sleeping) and state.level == new.level:
        return state
    return new


def _step(state_cls: type, event_cls: type) -> Callable[[Any, Any, int], Residency] | None:
    """What `_evolve` does for a (state class, event class) pair, decided once from the table: the
    same branches, taken ahead of time. None for pairs `evolve` leaves to `_evolve`: illegal ones
    (it raises) and the planner's verdict (its outcome depends on `admitted`)."""
    current = state_cls.__struct_config__.tag  # type: ignore[attr-defined]
    key = event_cls.__struct_config__.tag  # type: ignore[attr-defined]
    result = TRANSITIONS.get((current, key))
    build = _ESTABLISHES.get(key)
    if result is None or build is None or key in ("admission_decided", "model_adopted"):
        return None
    if result == "not_admitted":
        return lambda state, e, seq: state  # a stop or exit changes nothing about the verdict
    if current == result == "resident":
        return lambda state, e, seq: msgspec.structs.replace(build(e, e.at, seq), since=state.since, seq=state.seq)
    if current == result == "sleeping":
        return lambda state, e, seq: state if state.level == e.level else build(e, e.at, seq)
    if current == result == "pulling":
        return lambda state, e, seq: msgspec.structs.replace(build(e, e.at, seq), since=state.since)
    return lambda state, e, seq: build(e, e.at, seq)


class _Steps(dict[tuple[type, type], "Callable[[Any, Any, int], Residency] | None"]):
    """(state class, event class) -> step, filled on first use; None cached for the pairs left to
    `_evolve`, so a lookup never rebuilds one."""

    def __missing__(self, pair: tuple[type, type]) -> Callable[[Any, Any, int], Residency] | None:
        step = self[pair] = _step(*pair) if all(hasattr(c, "__struct_config__") for c in pair) else None
        return step


_STEPS: dict[tuple[type, type], Callable[[Any, Any, int], Residency] | None] = _Steps()


# ------------------------------------------------------------------------------------- diagnosis


def classify_probe_failure(process_alive: bool, gpu_present: bool | None, runtime_holds_model: bool) -> LostReason:
    """The one-bit diagnosis of a failed probe.

    The process is gone: `process_exited`. The GPU is gone (NVML says so): `gpu_detached`, the
    provider's doing. The GPU is there (or unknown) and the runtime no longer holds the model:
    `evicted`. Otherwise `unhealthy`. `gpu_present=None` (no NVML) never yields `gpu_detached`:
    without evidence Haru does not blame the provider.
    """
    if not process_alive:
        return "process_exited"
    if gpu_present is False:
        return "gpu_detached"
    if not runtime_holds_model:
        return "evicted"
    return "unhealthy"


# --------------------------------------------------------------------------------- router answers

# state -> (answer, what a router should do). Read by `answer` and by the docs.
ANSWERS: dict[str, tuple[AnswerKind, str]] = {
    "resident": ("ready", "send it"),
    "pulling": ("warming", "wait (503 + Retry-After): its files are being fetched; for_ms says how long"),
    "loading": (
        "warming",
        "wait (503 + Retry-After) or try elsewhere, but do not fault this node; for_ms says how long",
    ),
    "waking": ("warming", "as loading: it is coming back from sleep"),
    "sleeping": ("asleep", "try the active domain; this copy is a standby's (503 + Retry-After)"),
    "lost": (
        "lost",
        "try elsewhere; reason gpu_detached: do not score the operator down; evicted: this box is over-committed",
    ),
    "failed": (
        "lost",
        "try elsewhere; reason `failed`, detail is what the runtime said; it will not come back without the operator",
    ),
    "stopped": (
        "lost",
        "try elsewhere; reason `stopped`: unloaded on purpose, nobody's fault, back only after a new load",
    ),
    "not_admitted": ("not_admitted", "stop asking (409): it will never fit here; short_by says by how much"),
    "unknown": ("unknown", "we genuinely do not know yet, and say so (503)"),
}


def answer(state: Residency, now: datetime) -> Answer:
    """The router answer for one model's state, with `for_ms` computed from `now`."""
    tag = state_name(state)
    kind = ANSWERS[tag][0]
    if kind == "ready":
        return Answer(answer="ready", since=state.since)
    if kind == "warming":
        for_ms = 0
        if state.since is not None:
            for_ms = max(0, int((now - state.since).total_seconds() * 1000))
        waits = state.waiting_for if isinstance(state, Loading) else ""
        return Answer(answer="warming", for_ms=for_ms, since=state.since, reason=tag, detail=waits)
    if kind == "asleep":
        return Answer(answer="asleep", since=state.since)
    if isinstance(state, Lost):
        return Answer(answer="lost", since=state.since, reason=state.reason, detail=state.detail)
    if isinstance(state, Failed):
        return Answer(answer="lost", since=state.since, reason="failed", detail=state.runtime_said)
    if isinstance(state, Stopped):
        return Answer(answer="lost", since=state.since, reason="stopped", detail=state.detail)
    if isinstance(state, NotAdmitted):
        return Answer(answer="not_admitted", since=state.since, short_by_bytes=state.short_by_bytes)
    return Answer(answer="unknown", since=state.since)


def transition_table_markdown() -> str:
    """The legal transitions as a Markdown table (state rows, event columns): what the docs show."""
    events = RESIDENCY_EVENT_KEYS
    short = {ADMITTED: "admitted", REFUSED: "refused", ADOPTED_AWAKE: "adopted", ADOPTED_ASLEEP: "adopted asleep"}
    head = "| state \\ event | " + " | ".join(short.get(e, e.removeprefix("model_")) for e in events) + " |"
    rule = "|---" * (len(events) + 1) + "|"
    rows = [head, rule]
    for s in STATE_TAGS:
        cells = [TRANSITIONS.get((s, e), "·") for e in events]
        rows.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
