"""The promotion decider: given a fleet's view and a few outside facts, what to do next.

Pure: no asyncio, nats or logging; time, ids and facts (heartbeat silence, which steps this process
is executing) arrive as arguments. The service (`haru.promoter.service`) folds the log into a
`FleetView`, calls `decide`, appends what it returns with expected sequences, and runs the step a
successful `step_started` append gave it.

The sagas are data: `KINDS` says what each kind of operation is (its request event, the step
from which it can no longer be aborted), `STEPS` says what each step does (on which domain, which
agent verbs or which runner, bounded by which policy values) and `TRANSITIONS` says what follows
each outcome, per kind. The code, the tests and docs/promoter.md read the same tables. A new kind
is a request event (`haru.core.events.OperationRequested`), a `KINDS` row, its `TRANSITIONS` rows, any
new `STEPS`, and a request rule (`REQUEST_RULES`): docs/promoter.md, "Adding an operation kind".

    promotion:  stop_training -> verify_gpu -> wake -> probe -> flip -> settle_old_active -> completed
                any failure before flip -> aborted (routing never moves)
                settle_old_active failed -> completed anyway (best effort; the old active is recorded
                                            as not eligible to be standby until it recovers)
    demotion:   sleep -> start_training -> completed;   any failure -> aborted
    rolling:    stop_training -> apply_standby -> verify_gpu -> wake -> probe -> canary -> flip -> apply_old_active
                -> settle_old_active -> completed (canary: with policy rolling_canary_weight > 0 the standby
                takes that share of traffic for rolling_canary_ms first; rolled back -> aborted, routing unmoved)
                any failure before flip -> aborted (routing never moves; the old active keeps serving
                the old spec, its changes still waiting); apply_old_active failed -> settle_old_active
                anyway, and the old active is recorded not eligible to be standby; the active failing
                before the flip -> aborted, so that auto-failover is not held up by a long reload
    provision:  launch -> join -> settle -> completed;   launch/join failed -> aborted
                settle (sleep, start_training) failed -> completed anyway (best effort: with no route yet
                the first route decides the new host's role; an awake standby is demoted by housekeeping)
    weighting:  stop_training -> verify_gpu -> wake -> probe -> weigh -> completed (then `weights_set` on
                haru.evt.<fleet>.weights); any failure -> aborted (the weights stay as they were). The
                target is the domain the new split gives a share it did not have; with none (a share
                changed, taken back, the default again) the target is the active, and the steps before
                `weigh` are skipped: nothing to wake (haru.promoter.canary)
    teardown:   down -> completed;   failure -> aborted (and asked again after the backoff: never forgotten)
    replace:    down -> launch -> join -> settle -> completed;   down/launch/join failed -> aborted
                (the failed host goes first: the new one's agent takes over the same domain name, and
                one domain has one agent)

Who decides what, in order (`decide`):

1. liveness: heartbeat silence past `heartbeat_timeout_ms` -> `domain_unreachable`, heard again ->
   `domain_reachable` (`haru.promoter.liveness`);
1b. a canary whose probe failed or whose error rate the gateways reported over policy: its share goes
   back to the active (`weights_set`, with the evidence: haru.promoter.canary);
2. the operation in flight, if any: start its next step, re-start a step whose runner died (its lease
   ran out, or the runner was this promoter before a restart), or finish it;
3. with no operation in flight: the first route (no `route_moved` yet), auto-failover of a failed
   active (or `failover_declined`, once per distinct reason), and housekeeping: a recovered
   ineligible domain and an awake standby are demoted (asleep, training), unless it carries a share of
   traffic (a canary: haru.core.weights). A model whose runtime has
   no sleep mode (llama-server) is a standby resident, not an awake one; and a demotion that
   completed is never requested again while none of its inputs changed (`_already_done`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

import msgspec

from haru.core import ranking, subjects
from haru.core.commands import Command, Reply
from haru.core.events import (
    DemotionRequested,
    EligibilityChanged,
    Event,
    FailoverDeclined,
    OperationAborted,
    OperationCompleted,
    OperationRequested,
    PromotionRequested,
    PromotionRetargeted,
    ProvisionRequested,
    ReplaceRequested,
    RollingRequested,
    StepCompleted,
    StepFailed,
    StepStarted,
    TeardownRequested,
    WeightingRequested,
)
from haru.core.residency import Failed, Loading, Lost, Resident, Sleeping, Waking, state_name
from haru.core.specs import Policy, can_sleep
from haru.core.views import DomainView, FleetView, ModelView, OperationView, StepView
from haru.promoter import canary
from haru.promoter.decisions import Append, Facts
from haru.promoter.liveness import judge_liveness

OpKind = str  # a key of KINDS
Outcome = Literal["requested", "completed", "failed"]

# ------------------------------------------------------------------------------------ the tables

COMPLETE = "completed"  # the operation ends as completed
ABORT = "aborted"  # the operation ends as aborted


class StepSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What one step does.

    `on`:      which domain the step acts on: the operation's target, or the other domain (the old
               active for a promotion), or the route (the flip, which sends no command).
    `verbs`:   the agent commands sent, in order; every one must answer ok.
    `bound`:   the policy fields whose sum bounds the whole step (its lease: a started step with no
               outcome after bound + LEASE_MARGIN_MS may be re-started by any promoter).
    `fatal`:   whether a failure aborts the operation.
    `run`:     which runner of the service executes it: `agent` sends `verbs` to the domain's agent
               over request/reply; `flip` moves the route (compare-and-swap on the route subject).
               A new runner is a method registered in `Promoter.runners` under a new name.
    """

    on: Literal["target", "other", "route", "weights"]
    verbs: tuple[str, ...]
    bound: tuple[str, ...]
    fatal: bool = True
    what: str = ""
    run: str = "agent"


STEPS: dict[str, StepSpec] = {
    "stop_training": StepSpec(
        on="target",
        verbs=("stop_training",),
        bound=("training_grace_ms", "command_timeout_ms"),
        what="stop training on the target: SIGTERM, SIGKILL after the slot's grace",
    ),
    "verify_gpu": StepSpec(
        on="target",
        verbs=("verify_gpu",),
        bound=("command_timeout_ms",),
        what="verify the target's GPUs released the training VRAM (enough free for its models to wake)",
    ),
    "wake": StepSpec(
        on="target",
        verbs=("wake",),
        bound=("wake_timeout_ms",),
        what="wake every runtime on the target (level 1: weights come back from CPU RAM)",
    ),
    "probe": StepSpec(
        on="target",
        verbs=("probe",),
        bound=("probe_timeout_ms",),
        what="probe every model on the target: a real one-token completion, and /is_sleeping false",
    ),
    "flip": StepSpec(
        on="route",
        verbs=(),
        bound=("command_timeout_ms",),
        run="flip",
        what="append route_moved on the route subject, expecting its real last sequence, if the route has not moved since",
    ),
    "settle_old_active": StepSpec(
        on="other",
        verbs=("sleep", "start_training"),
        bound=("drain_ms", "command_timeout_ms", "command_timeout_ms"),
        fatal=False,
        what="best effort: let the old active's requests in flight finish (drain_ms), put it to sleep, start its training",
    ),
    "apply_standby": StepSpec(
        on="target",
        verbs=("apply_layout",),
        bound=("apply_timeout_ms", "command_timeout_ms"),
        what="the standby applies the declarations the change rolls out: changed models replaced, each come to rest",
    ),
    "apply_old_active": StepSpec(
        on="other",
        verbs=("apply_layout",),
        bound=("apply_timeout_ms", "command_timeout_ms"),
        fatal=False,
        what="the old active, now the standby, applies the changes that waited for it: changed models replaced",
    ),
    "sleep": StepSpec(
        on="target",
        verbs=("sleep",),
        bound=("drain_ms", "command_timeout_ms"),
        what="put every runtime on the target to sleep (level 1), once its requests in flight finished",
    ),
    "start_training": StepSpec(
        on="target",
        verbs=("start_training",),
        bound=("command_timeout_ms",),
        what="start the target's training slots",
    ),
    "weigh": StepSpec(
        on="weights",
        verbs=(),
        bound=("command_timeout_ms",),
        run="weigh",
        what="check that every domain the split gives a share serves (reachable, eligible, its models resident) and "
        "the route has not moved; the split is then recorded (weights_set)",
    ),
    "canary": StepSpec(
        on="target",
        verbs=(),
        bound=("rolling_canary_ms", "command_timeout_ms"),
        run="canary",
        what="with policy rolling_canary_weight > 0: the standby takes that share of traffic (weights_set) for "
        "rolling_canary_ms; a rollback (its probe or the gateways' error rate: haru.promoter.canary) fails it",
    ),
    "launch": StepSpec(
        on="target",
        verbs=(),
        bound=("launch_timeout_ms",),
        run="launch",
        what="launch the target's cluster (sky launch, each placement in order) or service (sky serve up); "
        "one already up is found, not launched again",
    ),
    "join": StepSpec(
        on="target",
        verbs=(),
        bound=("join_timeout_ms",),
        run="join",
        what="wait for the launched host's agent to start and its models to load",
    ),
    "settle": StepSpec(
        on="target",
        verbs=("sleep", "start_training"),
        bound=("drain_ms", "command_timeout_ms", "command_timeout_ms"),
        fatal=False,
        what="best effort: put the new host to sleep and start its training (with no route yet the first route "
        "decides its role; an awake standby is demoted later by housekeeping)",
    ),
    "down": StepSpec(
        on="target",
        verbs=(),
        bound=("teardown_timeout_ms",),
        run="down",
        what="tear down every cluster (sky down) or service (sky serve down) of the target, recording its cost",
    ),
}

# (kind, step that finished or None for the request, its outcome) -> the next step, COMPLETE or ABORT
TRANSITIONS: dict[tuple[OpKind, str | None, Outcome], str] = {
    ("promotion", None, "requested"): "stop_training",
    ("promotion", "stop_training", "completed"): "verify_gpu",
    ("promotion", "stop_training", "failed"): ABORT,
    ("promotion", "verify_gpu", "completed"): "wake",
    ("promotion", "verify_gpu", "failed"): ABORT,
    ("promotion", "wake", "completed"): "probe",
    ("promotion", "wake", "failed"): ABORT,
    ("promotion", "probe", "completed"): "flip",
    ("promotion", "probe", "failed"): ABORT,
    ("promotion", "flip", "completed"): "settle_old_active",
    ("promotion", "flip", "failed"): ABORT,
    ("promotion", "settle_old_active", "completed"): COMPLETE,
    ("promotion", "settle_old_active", "failed"): COMPLETE,  # best effort: recorded, not fatal
    ("rolling", None, "requested"): "stop_training",
    ("rolling", "stop_training", "completed"): "apply_standby",
    ("rolling", "stop_training", "failed"): ABORT,
    ("rolling", "apply_standby", "completed"): "verify_gpu",
    ("rolling", "apply_standby", "failed"): ABORT,
    ("rolling", "verify_gpu", "completed"): "wake",
    ("rolling", "verify_gpu", "failed"): ABORT,
    ("rolling", "wake", "completed"): "probe",
    ("rolling", "wake", "failed"): ABORT,
    ("rolling", "probe", "completed"): "canary",
    ("rolling", "probe", "failed"): ABORT,
    ("rolling", "canary", "completed"): "flip",
    ("rolling", "canary", "failed"): ABORT,
    ("rolling", "flip", "completed"): "apply_old_active",
    ("rolling", "flip", "failed"): ABORT,
    ("rolling", "apply_old_active", "completed"): "settle_old_active",
    ("rolling", "apply_old_active", "failed"): "settle_old_active",  # best effort: recorded, not fatal
    ("rolling", "settle_old_active", "completed"): COMPLETE,
    ("rolling", "settle_old_active", "failed"): COMPLETE,
    ("weighting", None, "requested"): "stop_training",
    ("weighting", "stop_training", "completed"): "verify_gpu",
    ("weighting", "stop_training", "failed"): ABORT,
    ("weighting", "verify_gpu", "completed"): "wake",
    ("weighting", "verify_gpu", "failed"): ABORT,
    ("weighting", "wake", "completed"): "probe",
    ("weighting", "wake", "failed"): ABORT,
    ("weighting", "probe", "completed"): "weigh",
    ("weighting", "probe", "failed"): ABORT,
    ("weighting", "weigh", "completed"): COMPLETE,
    ("weighting", "weigh", "failed"): ABORT,
    ("demotion", None, "requested"): "sleep",
    ("demotion", "sleep", "completed"): "start_training",
    ("demotion", "sleep", "failed"): ABORT,
    ("demotion", "start_training", "completed"): COMPLETE,
    ("demotion", "start_training", "failed"): ABORT,
    ("provision", None, "requested"): "launch",
    ("provision", "launch", "completed"): "join",
    ("provision", "launch", "failed"): ABORT,
    ("provision", "join", "completed"): "settle",
    ("provision", "join", "failed"): ABORT,
    ("provision", "settle", "completed"): COMPLETE,
    ("provision", "settle", "failed"): COMPLETE,  # best effort: housekeeping demotes an awake standby later
    ("teardown", None, "requested"): "down",
    ("teardown", "down", "completed"): COMPLETE,
    ("teardown", "down", "failed"): ABORT,
    ("replace", None, "requested"): "down",
    ("replace", "down", "completed"): "launch",
    ("replace", "down", "failed"): ABORT,
    ("replace", "launch", "completed"): "join",
    ("replace", "launch", "failed"): ABORT,
    ("replace", "join", "completed"): "settle",
    ("replace", "join", "failed"): ABORT,
    ("replace", "settle", "completed"): COMPLETE,
    ("replace", "settle", "failed"): COMPLETE,  # best effort: housekeeping demotes an awake standby later
}


@dataclass(frozen=True)
class KindSpec:
    """What one kind of operation is.

    `request`:   its request event on the op subject (a subclass of `OperationRequested`).
    `no_abort_from`: the step from which an operator can no longer abort it (`haru op abort`): once
               that step has started, routing may be moving ('' = abortable until it ends).
    `yields_to_failover`: a failed active aborts it before `no_abort_from` (the promoter drives one
               operation at a time, so a long one would otherwise hold auto-failover back).
    `what`:      one line for `haru op` and the docs.
    """

    request: type[OperationRequested]
    no_abort_from: str = ""
    yields_to_failover: bool = False
    what: str = ""


KINDS: dict[str, KindSpec] = {
    "promotion": KindSpec(
        request=PromotionRequested,
        no_abort_from="flip",
        what="make a standby domain active: stop its training, wake and probe it, flip the route, settle the old active",
    ),
    "demotion": KindSpec(
        request=DemotionRequested,
        what="put a standby domain to sleep and start its training",
    ),
    "rolling": KindSpec(
        request=RollingRequested,
        no_abort_from="flip",
        yields_to_failover=True,
        what="roll a layout change through the standby: apply it there, wake, probe and promote it, then apply it "
        "to the old active",
    ),
    "weighting": KindSpec(
        request=WeightingRequested,
        yields_to_failover=True,
        no_abort_from="weigh",
        what="give domains a share of a model's (or the fleet's) traffic: wake and probe the one that gains a share, "
        "then record the split",
    ),
    "provision": KindSpec(
        request=ProvisionRequested,
        what="launch a skypilot/skyserve domain's host, wait for its agent and models, make it the standby",
    ),
    "teardown": KindSpec(
        request=TeardownRequested,
        what="tear down every cluster or service of a skypilot/skyserve domain",
    ),
    "replace": KindSpec(
        request=ReplaceRequested,
        what="replace a failed domain's host: tear it down, launch a new one, make it the standby",
    ),
}

PROVISIONING_KINDS = ("provision", "teardown", "replace")
# Why a domain an operator tore down is not eligible; auto-replace leaves such a domain alone (the
# operator wanted it gone: `haru provision` brings it back).
TORN_DOWN = "torn down: no host until it is provisioned again"


def flow(kind: OpKind) -> list[str]:
    """The happy path of an operation kind, read from TRANSITIONS."""
    out: list[str] = []
    nxt = TRANSITIONS[(kind, None, "requested")]
    while nxt not in (COMPLETE, ABORT):
        out.append(nxt)
        nxt = TRANSITIONS[(kind, nxt, "completed")]
    return out


def steps_of(kind: OpKind) -> set[str]:
    """Every step an operation of `kind` can run, on any path of TRANSITIONS."""
    out: set[str] = set()
    for (k, step, _), nxt in TRANSITIONS.items():
        if k == kind:
            out |= {s for s in (step, nxt) if s is not None and s in STEPS}
    return out


LEASE_MARGIN_MS = 2_000


def step_bound_ms(step: str, policy: Policy) -> int:
    """The bound on one step, from policy: the sum of its `bound` fields."""
    return sum(int(getattr(policy, name)) for name in STEPS[step].bound)


def lease_ms(step: str, policy: Policy) -> int:
    """How long a started step belongs to its runner before another promoter may re-start it."""
    return step_bound_ms(step, policy) + LEASE_MARGIN_MS


def verb_timeout_ms(verb: str, policy: Policy) -> int:
    """The bound on one agent command of a step."""
    if verb == "wake":
        return policy.wake_timeout_ms
    if verb == "probe":
        return policy.probe_timeout_ms
    if verb == "apply_layout":
        return policy.apply_timeout_ms + policy.command_timeout_ms
    if verb == "stop_training":
        return policy.training_grace_ms + policy.command_timeout_ms
    if verb == "sleep":  # the agent lets the requests in flight finish first (drain_ms at most)
        return policy.drain_ms + policy.command_timeout_ms
    return policy.command_timeout_ms


# ---------------------------------------------------------------------------------- the decisions


def decide(view: FleetView, facts: Facts) -> list[Append]:
    """Everything to append now: liveness verdicts, then at most one append on the op or route subject.

    The service appends them in order and decides again after its view has folded its own appends.
    """
    out: list[Append] = list(judge_liveness(view, facts.silent_ms, facts.listening_ms, facts.now))
    if not view.domains:
        return out
    taken_back = canary.rollback(view, facts.canary, facts.now)  # its own subject: it races no operation
    if taken_back is not None:
        out.append(taken_back)
    if view.operation is not None and view.operation.state == "running":
        nxt = drive(view, view.operation, facts)
    else:
        nxt = next_operation(view, facts)
    if nxt is not None:
        out.append(nxt)
    return out


# ------------------------------------------------------------------------ driving the operation


def last_step(op: OperationView) -> StepView | None:
    return op.steps[-1] if op.steps else None


def step_record(op: OperationView, step: str) -> StepView | None:
    """The latest record of `step` in the operation."""
    for sv in reversed(op.steps):
        if sv.step == step:
            return sv
    return None


def probed(op: OperationView) -> bool:
    """Whether this operation completed the probe step (the flip's precondition)."""
    sv = step_record(op, "probe")
    return sv is not None and sv.state == "completed"


def other_domain(view: FleetView, op: OperationView) -> str:
    """The domain a step `on="other"` acts on: the old active of a promotion (its `source`, else the
    active when that is not the target; '' if none)."""
    if op.source and op.source != op.target:
        return op.source
    if view.active and view.active != op.target:
        return view.active
    for name in view.domains:
        if name != op.target:
            return name
    return ""


def step_domain(view: FleetView, op: OperationView, step: str) -> str:
    on = STEPS[step].on
    if on == "target":
        return op.target
    if on == "other":
        return other_domain(view, op)
    return ""


def not_applicable(view: FleetView, op: OperationView, step: str) -> str:
    """Why a best-effort step does not apply, when the reason is known ('' = it applies, or it is not
    best effort): the domain it acts on is unreachable or has a GPU gone, typically the very reason
    for the failover. Recorded as skipped with this reason, never as a failure."""
    spec = STEPS.get(step)
    if op.kind == "weighting" and step != "weigh" and op.target == view.active:
        return "skipped: the split gives no domain a new share, so there is nothing to wake or probe"
    if spec is None or spec.fatal or spec.on in ("route", "weights"):
        return ""
    domain = step_domain(view, op, step)
    dv = view.domains.get(domain) if domain else None
    if dv is None:
        return ""
    cause = (
        " (the reason for this operation)"
        if op.source == domain and op.reason in ("gpu_detached", "domain_unreachable")
        else ""
    )
    if dv.reachable is False:
        return f"skipped: {domain} is unreachable{cause}, so it cannot be put to sleep or given training"
    for gpu in dv.gpus:
        if gpu.present is False:
            return (
                f"skipped: GPU {gpu.index} of {domain} is gone{cause}, so it cannot be put to sleep or given training"
            )
    return ""


def drive(view: FleetView, op: OperationView, facts: Facts) -> Append | None:
    """The next append for the operation in flight (None: wait, a step is running)."""
    fleet = view.fleet
    op_subject = subjects.op(fleet)
    if op.kind not in KINDS:
        return None  # a kind this promoter does not know (a newer one's): that promoter drives it
    cur = last_step(op)
    if cur is None:
        first = TRANSITIONS[(op.kind, None, "requested")]
        # A cascading promotion that just moved on starts afresh on its new target; the attempt number
        # stays above the one of the step that failed on the old target, so the two never share a key.
        prior = op.tried[-1] if op.tried else None
        attempt = prior.attempt + 1 if prior is not None and prior.step == first else 1
        return _start(op_subject, op, first, attempt, facts)
    if cur.step not in steps_of(op.kind):
        # Only a writer of the op subject could have recorded it (the promoter, the gateway, the
        # operator): a step this kind of operation does not have is not run, and does not wedge
        # the fleet either (every later decision would fail on the missing transition).
        return Append(
            subject=op_subject,
            event=OperationAborted(
                at=facts.now, op_id=op.op_id, step=cur.step, error=f"{cur.step} is not a step of a {op.kind}"
            ),
            why="a step that does not belong to this operation was recorded",
        )
    spec = KINDS[op.kind]
    if (
        spec.yields_to_failover
        and view.policy.auto_failover
        and not any(s.step == spec.no_abort_from for s in op.steps)
    ):
        health = active_health(view, facts.now)
        if health.health == "failed":
            return Append(
                subject=op_subject,
                event=OperationAborted(
                    at=facts.now,
                    op_id=op.op_id,
                    step=cur.step,
                    error=f"the active failed ({health.why}): abandoned so that failover can go on",
                ),
                why="auto-failover goes before a rolling change",
            )
    if cur.state == "started":
        return _resume(view, op, cur, facts)
    # A skipped step (best effort, not applicable: `not_applicable`) is followed as a completed one.
    nxt = TRANSITIONS[(op.kind, cur.step, "completed" if cur.state == "skipped" else cur.state)]
    if nxt == ABORT:
        error = cur.error or cur.error_code or "failed"
        onward = cascade(view, op, cur, facts)
        if onward is not None:
            return onward
        if op.tried:
            error = f"{error} (after {', '.join(t.target for t in op.tried)} failed too)"
        return Append(
            subject=op_subject,
            event=OperationAborted(at=facts.now, op_id=op.op_id, step=cur.step, error=error),
            why=f"{cur.step} failed before the flip: routing does not move",
        )
    if nxt == COMPLETE:
        return _finish(view, op, facts)
    if nxt == "flip":
        refusal = flip_refusal(view, op)
        if refusal:
            return Append(
                subject=op_subject,
                event=OperationAborted(at=facts.now, op_id=op.op_id, step="flip", error=refusal),
                why="the flip's precondition does not hold",
            )
    return _start(op_subject, op, nxt, 1, facts)


def cascade(view: FleetView, op: OperationView, cur: StepView, facts: Facts) -> Append | None:
    """A cascading promotion (`cascade`: auto-failover, `haru promote` without a target) whose target
    failed a step before the flip moves on to the next fit standby in the ranking
    (`haru.core.ranking`), in the same operation; None when it is not one, or no fit standby is left
    (the operation then aborts, naming every standby it tried)."""
    if op.kind != "promotion" or not op.cascade or cur.state != "failed" or STEPS[cur.step].on != "target":
        return None
    tried = frozenset({op.target, op.source, *(t.target for t in op.tried)})
    onward = ranking.first_fit(view, excluding=tried)
    if not onward:
        return None
    error = cur.error or cur.error_code or "failed"
    return Append(
        subject=subjects.op(view.fleet),
        event=PromotionRetargeted(
            at=facts.now, op_id=op.op_id, target=onward, previous=op.target, step=cur.step, error=error
        ),
        why=f"{op.target} failed {cur.step} before the flip ({error}): the next fit standby, {onward}, takes over",
    )


def _start(subject: str, op: OperationView, step: str, attempt: int, facts: Facts) -> Append:
    return Append(
        subject=subject,
        event=StepStarted(at=facts.now, op_id=op.op_id, step=step, attempt=attempt),  # type: ignore[arg-type]
        why=STEPS[step].what,
    )


def _resume(view: FleetView, op: OperationView, cur: StepView, facts: Facts) -> Append | None:
    """A started step with no outcome: someone runs it, or its runner died."""
    if (op.op_id, cur.step, cur.attempt) in facts.running:
        return None
    if cur.step == "flip" and view.route_revision != op.route_revision:
        # The runner died between route_moved and step_completed: read the outcome from the route.
        if view.active == op.target:
            return Append(
                subject=subjects.op(view.fleet),
                event=StepCompleted(
                    at=facts.now,
                    op_id=op.op_id,
                    step="flip",
                    detail=f"route moved to {op.target} (revision {view.route_revision})",
                ),
                why="the route already points at the target",
            )
        return Append(
            subject=subjects.op(view.fleet),
            event=StepFailed(
                at=facts.now,
                op_id=op.op_id,
                step="flip",
                error_code="route_moved_elsewhere",
                error=f"the route moved to {view.active or 'nowhere'} (revision {view.route_revision}) since "
                f"revision {op.route_revision} this operation was decided against",
            ),
            why="another writer moved the route",
        )
    mine_before_restart = bool(facts.me) and facts.step_by == facts.me
    started = cur.at
    expired = started is None or facts.now - started >= timedelta(milliseconds=lease_ms(cur.step, view.policy))
    if mine_before_restart or expired or runner_gone(facts):
        return _start(subjects.op(view.fleet), op, cur.step, cur.attempt + 1, facts)
    return None


def runner_gone(facts: Facts) -> bool:
    """Whether the promoter running the started step is dead by its silence on haru.alive: not heard
    for `runner_timeout_ms`, or never heard since we have listened that long."""
    timeout = facts.runner_timeout_ms
    if not timeout or not facts.step_by or facts.step_by == facts.me:
        return False
    if facts.runner_silent_ms is None:
        return facts.listening_ms >= timeout
    return facts.runner_silent_ms >= timeout


def flip_refusal(view: FleetView, op: OperationView) -> str:
    """Why the pointer must not move to the target now ('' = it may). The decider asks before it
    starts the flip, and the promoter asks again before it appends `route_moved`: a `step_started`
    for the flip that someone else recorded is not a probe."""
    if "flip" not in flow(op.kind):
        return f"a {op.kind} never moves the route"
    if not probed(op):
        return f"{op.target}'s models were not probed in this operation"
    target = view.domains.get(op.target)
    if target is None:
        return f"domain {op.target} is no longer declared"
    if target.reachable is False:
        return f"{op.target} became unreachable after its probe"
    return ""


def _finish(view: FleetView, op: OperationView, facts: Facts) -> Append:
    """The tail of an operation: eligibility, then operation_completed."""
    subject = subjects.op(view.fleet)
    if "flip" in flow(op.kind):  # the route moved to the target: the target serves, the other is the standby
        target = view.domains.get(op.target)
        if target is not None and not target.eligible:
            return Append(
                subject=subject,
                event=EligibilityChanged(
                    at=facts.now, domain=op.target, eligible=True, why="promoted: probed and serving"
                ),
                why="a domain that was probed and now serves is healthy",
            )
        old = other_domain(view, op)
        dv = view.domains.get(old) if old else None
        if dv is not None and dv.eligible:
            why = _unfit_as_standby(view, dv, step_record(op, "settle_old_active"), step_record(op, "apply_old_active"))
            if why:
                return Append(
                    subject=subject,
                    event=EligibilityChanged(at=facts.now, domain=old, eligible=False, why=why),
                    why="the old active cannot be a standby",
                )
    elif op.kind == "weighting":
        if not canary.applied(view, op):
            return canary.weights_set(view, op, facts.now)
    elif op.kind == "teardown":
        dv = view.domains.get(op.target)
        if dv is not None and dv.eligible:
            return Append(
                subject=subject,
                event=EligibilityChanged(at=facts.now, domain=op.target, eligible=False, why=TORN_DOWN),
                why="a domain with no host cannot be the standby",
            )
    else:
        dv = view.domains.get(op.target)
        if dv is not None and not dv.eligible:
            return Append(
                subject=subject,
                event=EligibilityChanged(
                    at=facts.now, domain=op.target, eligible=True, why="recovered: asleep with training started"
                ),
                why="the recovered domain is a standby again",
            )
    return Append(subject=subject, event=OperationCompleted(at=facts.now, op_id=op.op_id), why="every step done")


def _unfit_as_standby(view: FleetView, dv: DomainView, settle: StepView | None, applied: StepView | None = None) -> str:
    if dv.reachable is False:
        return f"agent of {dv.name} unreachable"
    if dv.signalled:
        return f"{dv.name} is about to go ({dv.signalled})"
    for gpu in dv.gpus:
        if gpu.present is False:
            return f"GPU {gpu.index} of {dv.name} detached"
    if applied is not None and applied.state == "failed":
        return f"could not apply the layout change: {applied.error or applied.error_code}"
    if settle is not None and settle.state == "failed":
        return f"could not be put to sleep and given training: {settle.error or settle.error_code}"
    return ""


def command_for(view: FleetView, op: OperationView, step: str) -> tuple[str, list[tuple[str, Command, int]]]:
    """The domain a step acts on and the commands to send it: [(verb, command, timeout_ms)]."""
    domain = step_domain(view, op, step)
    # The route revision the step is decided against: after the flip, the new one, so the old
    # active's agent learns it is now the standby before it is told to train.
    cmd = Command(op_id=op.op_id, route_revision=max(op.route_revision, view.route_revision), decl_seq=op.decl_seq)
    return domain, [(verb, cmd, verb_timeout_ms(verb, view.policy)) for verb in STEPS[step].verbs]


def step_outcome(
    op: OperationView, step: str, replies: list[tuple[str, Reply]], *, now: datetime, took_ms: int
) -> StepCompleted | StepFailed:
    """The record of a step from its agents' replies (stops at the first reply that is not ok)."""
    details: list[str] = []
    for verb, reply in replies:
        if not reply.ok:
            code = reply.error.code if reply.error else "command_failed"
            message = reply.error.message if reply.error else (reply.detail or f"{verb} failed")
            return StepFailed(
                at=now,
                op_id=op.op_id,
                step=step,  # type: ignore[arg-type]
                error_code=code,
                error=f"{verb}: {message}",
                took_ms=took_ms,
            )
        if reply.detail:
            details.append(reply.detail if len(replies) == 1 else f"{verb}: {reply.detail}")
    return StepCompleted(at=now, op_id=op.op_id, step=step, detail="; ".join(details), took_ms=took_ms)  # type: ignore[arg-type]


# --------------------------------------------------------------------- no operation in flight


Health = Literal["ok", "degraded", "failed"]


class ActiveHealth(msgspec.Struct, frozen=True, kw_only=True):
    health: Health
    reason: str = ""  # domain_unreachable | gpu_detached | degraded
    why: str = ""
    since: datetime | None = None


def served(dv: DomainView) -> list[str]:
    """The models a domain serves: declared and not refused by the planner."""
    return [name for name, mv in dv.models.items() if mv.admitted is not False]


def active_health(view: FleetView, now: datetime) -> ActiveHealth:
    """Whether the active domain is ok, degraded (and since when), or failed (and why)."""
    dv = view.domains.get(view.active)
    if dv is None:
        return ActiveHealth(health="failed", reason="retired", why=f"active domain {view.active} is not declared")
    if dv.reachable is False:
        return ActiveHealth(
            health="failed",
            reason="domain_unreachable",
            why=f"{dv.name} unreachable (heartbeats silent)",
            since=dv.reachability_since,
        )
    signal = signalled(dv)  # about to go: move before it does
    if signal is not None:
        return signal
    hosting = {dv.models[m].gpu_index for m in served(dv)}
    for gpu in dv.gpus:
        if gpu.present is False and gpu.index in hosting:
            return ActiveHealth(
                health="failed",
                reason="gpu_detached",
                why=f"GPU {gpu.index} of {dv.name} detached",
                since=gpu.observed_at,
            )
    degraded_since: datetime | None = None
    why = ""
    for name in served(dv):
        state = dv.models[name].residency
        if isinstance(state, Lost) and state.reason == "gpu_detached":
            return ActiveHealth(
                health="failed", reason="gpu_detached", why=f"{name} on {dv.name} lost: gpu_detached", since=state.since
            )
        if isinstance(state, (Lost, Failed)):
            label = f"lost: {state.reason}" if isinstance(state, Lost) else "failed"
            since = state.since or now
            if degraded_since is None or since < degraded_since:
                degraded_since, why = since, f"{name} on {dv.name} {label}"
    if degraded_since is None and not _reloading(view):
        return ActiveHealth(health="ok")
    faster = faster_path(view)  # a cold reload the standby beats: failed now, not after the grace
    if faster is not None:
        return faster
    if degraded_since is None:
        return ActiveHealth(health="ok")
    grace = timedelta(milliseconds=view.policy.degraded_grace_ms)
    if now - degraded_since >= grace:
        return ActiveHealth(
            health="failed",
            reason="degraded",
            why=f"{why} for over degraded_grace_ms ({view.policy.degraded_grace_ms} ms)",
            since=degraded_since,
        )
    return ActiveHealth(health="degraded", reason="degraded", why=why, since=degraded_since)


_READY_TO_PROMOTE = (Sleeping, Resident, Waking)

# --------------------------------------------------------------------------------- seeing it coming


def signalled(dv: DomainView) -> ActiveHealth | None:
    """A domain whose agent recorded a sign that it is about to go (`failure_signalled`: a provider's
    preemption notice, an NVML critical XID, ECC double-bit errors or pages pending retirement) is
    failed now, while it still serves: the promotion off it is planned, not a recovery. The request's
    reason is the signal's source, its cause the `failure_signalled` event."""
    if not dv.signalled:
        return None
    source = dv.signalled.split(":", 1)[0]
    return ActiveHealth(
        health="failed", reason=source, why=f"{dv.name} is about to go: {dv.signalled}", since=dv.signalled_at
    )


# ------------------------------------------------------------------------------- the faster path
# A model lost for one of these comes back only by a cold reload (the agent restarts its runtime).

COLD_RELOAD: frozenset[str] = frozenset({"process_exited", "evicted", "unhealthy"})


def _cold_reload(state: object) -> bool:
    """Lost for a cold-reload reason, or loading again after such a loss (a restart, attempt > 1)."""
    if isinstance(state, Lost):
        return state.reason in COLD_RELOAD
    return isinstance(state, Loading) and state.attempt > 1


def reload_ms(policy: Policy, mv: ModelView) -> int:
    """How long a model lost on the active takes to serve again there by itself, in ms (0: not a cold
    reload, or its warm-up was never measured): its measured warm-up (`ModelView.load_ms`), after the
    agent's restart backoff while it is still lost (the agent waits at least `restart_backoff_ms` before
    it starts the runtime again; a restart already loading has waited it out)."""
    state = mv.residency
    if not _cold_reload(state) or not mv.load_ms:
        return 0
    return mv.load_ms + (policy.restart_backoff_ms if isinstance(state, Lost) else 0)


def _reloading(view: FleetView) -> bool:
    dv = view.domains.get(view.active)
    return dv is not None and any(_cold_reload(dv.models[m].residency) for m in served(dv))


def standby_serves_in(view: FleetView, standby: DomainView, models: list[str]) -> tuple[int, bool]:
    """How soon `standby` would serve `models` once promoted, in ms, and whether that was measured.
    Measured: each model's last wake and probe (`ModelView.wake_ms`, folded from the log). A model never
    woken yet is estimated from the policy: a resident one needs its probe alone (`probe_estimate_ms`),
    a sleeping one its declared VRAM at `wake_estimate_bytes_per_s` plus the probe. The figure is the
    slowest model's; it is measured only when every model's is."""
    policy = view.policy
    slowest, measured = 0, True
    for name in models:
        mv = standby.models.get(name)
        if mv is None:
            continue
        if mv.wake_ms:
            ms = mv.wake_ms
        else:
            measured = False
            ms = policy.probe_estimate_ms
            if not isinstance(mv.residency, Resident) and policy.wake_estimate_bytes_per_s:
                ms += mv.vram_bytes * 1000 // policy.wake_estimate_bytes_per_s
        slowest = max(slowest, ms)
    return slowest, measured


def faster_path(view: FleetView) -> ActiveHealth | None:
    """The active failed at once, with both figures in `why`, when models on it are lost for a reason
    whose recovery is a cold reload and the standby would serve sooner: its wake (and probe) against
    the active's measured warm-up (`ModelView.load_ms`, folded from the log). The standby's figure is
    its measured wake (`ModelView.wake_ms`), or, before it ever woke, an estimate from its declared
    sizes and the policy (`standby_serves_in`), said so in `why`. None when no such loss, the warm-up
    was never measured, or the standby is not faster (or not fit): the loss is then a degradation,
    failed after `degraded_grace_ms` as before."""
    dv = view.domains.get(view.active)
    candidate = view.standby()
    standby = view.domains.get(candidate)
    if dv is None or standby is None or standby_unfit(view, candidate, dv):
        return None
    slowest: tuple[int, str, ModelView] | None = None
    for name in served(dv):
        mv = dv.models[name]
        ms = reload_ms(view.policy, mv)
        if ms and (slowest is None or ms > slowest[0]):
            slowest = (ms, name, mv)
    if slowest is None:
        return None
    back_ms, name, mv = slowest
    state = mv.residency
    wanted = [m for m in served(dv) if m in standby.models]
    if not wanted:
        return None
    wake_ms, measured = standby_serves_in(view, standby, wanted)
    if wake_ms >= back_ms:
        return None
    how = (
        "measured wake and probe"
        if measured
        else f"ESTIMATED, no wake measured yet: declared VRAM at {view.policy.wake_estimate_bytes_per_s} B/s "
        f"plus a {view.policy.probe_estimate_ms} ms probe"
    )
    label = f"lost: {state.reason}" if isinstance(state, Lost) else "reloading"
    backoff = f" after the {back_ms - mv.load_ms} ms restart backoff" if back_ms > mv.load_ms else ""
    return ActiveHealth(
        health="failed",
        reason="faster_path",
        why=f"{name} on {dv.name} {label}; its cold reload takes {mv.load_ms} ms (measured warm-up){backoff} and "
        f"standby {candidate} serves after {wake_ms} ms ({how}): the faster path wins",
        since=state.since,
    )


def standby_unfit(view: FleetView, candidate: str, serving: DomainView | None) -> str:
    """Why `candidate` must not be promoted ('' = it may). `serving` is the domain it would replace.
    The fitness test is the ranking's (`haru.core.ranking.unfit`)."""
    dv = view.domains.get(candidate)
    if dv is None:
        if len(view.domains) == 1:
            return "a single-domain fleet: there is nothing to fail over to"
        return "no standby domain declared"
    return ranking.unfit(view, dv, serving)


def retry_ms(policy: Policy) -> int:
    """How long an automatic operation that aborted waits before it is requested again."""
    return max(policy.degraded_grace_ms, policy.heartbeat_timeout_ms)


def _backing_off(view: FleetView, kind: str, target: str, now: datetime) -> OperationView | None:
    last = view.last_operation
    if last is None or last.state != "aborted" or last.kind != kind or last.target != target:
        return None
    if last.finished_at is not None and now - last.finished_at >= timedelta(milliseconds=retry_ms(view.policy)):
        return None
    return last


def failover_retry_ms(policy: Policy, attempt: int) -> int:
    """The pause after automatic failover attempt `attempt` aborted: failover_retry_ms doubled per
    attempt, capped at failover_retry_max_ms."""
    return min(policy.failover_retry_ms << max(0, min(attempt - 1, 30)), policy.failover_retry_max_ms)


class Retry(msgspec.Struct, frozen=True, kw_only=True):
    """What to do about the last aborted automatic failover onto a candidate, while the active is unfit."""

    attempt: int = 1  # the attempt to request now (when `wait` and `why` are empty)
    wait: bool = False  # within the backoff: request nothing yet (the abort is the record)
    why: str = ""  # gave up the fast retries: said once as failover_declined


def retry_after_abort(view: FleetView, candidate: str, now: datetime) -> Retry:
    """An automatic promotion onto `candidate` that aborted (its standby's step failed: the trainer's
    memory not released yet, a wake that ran out of memory) is retried promptly, not after
    `retry_ms`: after `failover_retry_ms(attempt)`, each attempt a new `promotion_requested` with its
    `attempt` number, at most `failover_retry_attempts` in a row. Past the cap it gives up the fast
    retries, says why, and the usual backoff of an aborted operation (`retry_ms`) applies. A manual
    promotion that aborted keeps the usual backoff."""
    last = view.last_operation
    policy = view.policy
    if last is None or last.state != "aborted" or last.kind != "promotion" or last.target != candidate:
        return Retry()
    since = now - last.finished_at if last.finished_at is not None else timedelta(0)
    if last.reason == "manual" or last.attempt >= policy.failover_retry_attempts:
        if since >= timedelta(milliseconds=retry_ms(policy)):
            return Retry()
        if last.reason == "manual":
            return Retry(
                why=f"the last promotion onto {candidate} aborted ({last.error or 'failed'}); "
                f"retrying after {retry_ms(policy)} ms"
            )
        return Retry(
            why=f"gave up retrying the failover onto {candidate} after {last.attempt} attempts "
            f"(failover_retry_attempts), the last aborted: {last.error or 'failed'}; "
            f"next try after {retry_ms(policy)} ms"
        )
    if since < timedelta(milliseconds=failover_retry_ms(policy, last.attempt)):
        return Retry(wait=True)
    return Retry(attempt=last.attempt + 1)


def next_operation(view: FleetView, facts: Facts) -> Append | None:
    """With no operation in flight: first route, auto-failover, demotions that keep the standby a standby."""
    op_subject = subjects.op(view.fleet)
    now = facts.now
    retry = _teardown_retry(view, facts)  # a host that may still be billed comes first, route or not
    if retry is not None:
        return retry
    if not view.active:
        return _first_route(view, facts)
    health = active_health(view, now)
    if health.health == "failed":
        if not view.policy.auto_failover:
            return None
        # The best fit standby (ranked: declared order, then measured fitness); with none fit, the
        # first-ranked one, whose unfitness the decline names.
        candidate = ranking.first_fit(view) or view.standby()
        why = standby_unfit(view, candidate, view.domains.get(view.active))
        if why and len(view.domains) > 2:
            why = f"no fit standby (fleet unprotected): {why}"
        again = Retry()
        if not why:
            again = retry_after_abort(view, candidate, now)  # an aborted failover: retried promptly, bounded
            if again.wait:
                return None
            why = again.why
        if why:
            # Once per distinct reason and incident: the failure's onset is part of the reason.
            onset = f" since {health.since.isoformat(timespec='milliseconds')}" if health.since else ""
            full = f"{health.why}{onset}; {why}"
            if full == view.declined:
                return None
            return Append(
                subject=op_subject,
                event=FailoverDeclined(at=now, domain=view.active, candidate=candidate, why=full),
                why="the active failed and the standby cannot take over",
            )
        return Append(
            subject=op_subject,
            event=PromotionRequested(
                at=now,
                op_id=facts.new_op_id,
                target=candidate,
                source=view.active,
                reason=health.reason,
                detail=health.why,
                route_revision=view.route_revision,
                attempt=again.attempt,
                cascade=True,
            ),
            why=f"auto-failover: {health.why}" + (f" (attempt {again.attempt})" if again.attempt > 1 else ""),
        )
    provisioning = _provisioning(view, facts)
    if provisioning is not None:
        return provisioning
    for name, dv in view.domains.items():
        if name == view.active:
            continue
        reason = _demotion_reason(view, dv)
        if reason and _backing_off(view, "demotion", name, now) is None and not _already_done(view, dv, reason):
            return Append(
                subject=op_subject,
                event=DemotionRequested(
                    at=now, op_id=facts.new_op_id, target=name, reason=reason, route_revision=view.route_revision
                ),
                why=f"keep {name} a standby: {reason}",
            )
    return None


def _teardown_retry(view: FleetView, facts: Facts) -> Append | None:
    """A teardown that failed (its `down` step, in a teardown or a replace) is asked again after the
    retry backoff, until one succeeds: a host that may still be running and billed is never forgotten."""
    now = facts.now
    last = view.last_operation
    if (
        last is None
        or last.state != "aborted"
        or last.kind not in ("teardown", "replace")
        or not any(s.step == "down" and s.state == "failed" for s in last.steps)
        or last.target not in view.domains
    ):
        return None
    if last.finished_at is not None and now - last.finished_at < timedelta(milliseconds=retry_ms(view.policy)):
        return None
    return Append(
        subject=subjects.op(view.fleet),
        event=TeardownRequested(
            at=now,
            op_id=facts.new_op_id,
            target=last.target,
            reason="teardown_failed",
            detail=f"the teardown in {last.op_id} failed: {last.error}",
        ),
        why=f"a failed teardown of {last.target} is asked again: its host may still be running and billed",
    )


def _provisioning(view: FleetView, facts: Facts) -> Append | None:
    """The fleet's auto-replace of a failed domain.

    Auto-replace (policy `auto_replace`, off by default): a skypilot/skyserve domain that is not the
    active and is not eligible as standby (the failover recorded why: its GPU detached, its agent
    unreachable) gets a `replace`, unless the last provisioning operation aborted less than
    `launch_cooldown_ms` (or the usual retry backoff) ago, or `max_launches_per_hour` launches were
    started in the last hour (the service counts them: `facts.launches_last_hour`)."""
    now = facts.now
    last = view.last_operation
    op_subject = subjects.op(view.fleet)
    policy = view.policy
    if not policy.auto_replace:
        return None
    for name, dv in view.domains.items():
        if (
            name == view.active
            or dv.provider not in ("skypilot", "skyserve")
            or dv.eligible
            or dv.ineligible_why == TORN_DOWN
        ):
            continue
        if last is not None and last.state == "aborted" and last.kind in PROVISIONING_KINDS and last.target == name:
            cool = max(policy.launch_cooldown_ms, retry_ms(policy))
            if last.finished_at is not None and now - last.finished_at < timedelta(milliseconds=cool):
                continue  # cooling down after a failed launch
        if policy.max_launches_per_hour and facts.launches_last_hour >= policy.max_launches_per_hour:
            continue  # over the fleet's launch budget for this hour
        return Append(
            subject=op_subject,
            event=ReplaceRequested(
                at=now,
                op_id=facts.new_op_id,
                target=name,
                reason="auto_replace",
                detail=f"{name} is not fit to be the standby: {dv.ineligible_why or 'ineligible'}",
            ),
            why=f"auto_replace: {name} failed ({dv.ineligible_why or 'ineligible'}); a new host replaces it",
        )
    return None


def _demotion_reason(view: FleetView, dv: DomainView) -> str:
    """Why a non-active domain should be put to sleep and given training now ('' = it should not)."""
    if dv.reachable is not True:
        return ""
    states = [dv.models[m].residency for m in served(dv)]
    hosting = {dv.models[m].gpu_index for m in served(dv)}
    if any(g.present is False and g.index in hosting for g in dv.gpus):
        return ""
    if not dv.eligible:
        if states and all(isinstance(s, (Resident, Sleeping)) for s in states):
            return "recovered"
        return ""
    if carries_share(view, dv.name):
        return ""  # a canary: awake on purpose
    # Awake only counts for a runtime that can sleep: one without a sleep mode (llama-server, a vLLM
    # whose platform has none: `Resident.sleeps`) serves the standby role resident, and asking it to
    # sleep would change nothing.
    awake = [
        m
        for m in served(dv)
        if isinstance(r := dv.models[m].residency, Resident) and r.sleeps and can_sleep(dv.models[m].runtime)
    ]
    if awake and not any(isinstance(s, (Waking,)) or state_name(s) == "loading" for s in states):
        return "standby_awake"
    return ""


def carries_share(view: FleetView, name: str) -> bool:
    """Whether a domain other than the active has a share of traffic (a canary: haru.core.weights), or a
    weighting in flight is waking it for one."""
    if name != view.active and any(w.get(name, 0) > 0 for w in (view.weights, *view.model_weights.values())):
        return True
    op = view.operation
    return op is not None and op.state == "running" and op.kind == "weighting" and op.target == name


def _already_done(view: FleetView, dv: DomainView, reason: str) -> bool:
    """Whether the last operation was this same demotion, and none of its inputs changed since.

    The inputs of `_demotion_reason` are the domain's reachability, eligibility, GPU presence and its
    models' residency (a completed demotion leaves the domain eligible, and a GPU that went away
    shows in its models' residency). A demotion that finished without changing any of them would only finish the
    same way again: it is not requested twice (whatever made it change nothing is in its record).
    """
    last = view.last_operation
    if last is None or last.kind != "demotion" or last.target != dv.name or last.reason != reason:
        return False
    if last.state != "completed":
        return False  # an aborted one is retried after its backoff (`_backing_off`)
    if (
        dv.reachability_since is not None
        and last.requested_at is not None
        and dv.reachability_since > last.requested_at
    ):
        return False
    for m in served(dv):
        if dv.models[m].residency.seq > last.seq:
            return False
    return True  # (a GPU that went away or came back shows in its models' residency)


def _first_route(view: FleetView, facts: Facts) -> Append | None:
    """No route_moved yet: promote the first declared domain through the normal path.

    Once the first domain is reachable with its models resident or asleep, and every other domain
    has been heard from (or found silent) and has finished loading (bounded by degraded_grace_ms).
    """
    names = list(view.domains)
    first = names[0]
    # Every domain heard from (reachable), or known silent: a dead standby does not keep a fleet
    # from serving; the settle step then records it not eligible, and it rejoins when it recovers.
    if view.domains[first].reachable is not True or any(view.domains[n].reachable is None for n in names):
        return None
    dv = view.domains[first]
    if not dv.eligible:
        return None
    states = [dv.models[m].residency for m in served(dv)]
    if not states or not all(isinstance(s, _READY_TO_PROMOTE) for s in states):
        return None
    if _backing_off(view, "promotion", first, facts.now) is not None:
        return None
    # Let the other domains' runtimes finish loading first, so the settle step can put them to sleep
    # (bounded: a model loading for longer than degraded_grace_ms does not hold the first route back).
    grace = timedelta(milliseconds=view.policy.degraded_grace_ms)
    for name in names[1:]:
        other = view.domains[name]
        if other.reachable is False:
            continue
        for m in served(other):
            state = other.models[m].residency
            if state_name(state) == "unknown":
                return None
            if state_name(state) == "loading" and (state.since is None or facts.now - state.since < grace):
                return None
    return Append(
        subject=subjects.op(view.fleet),
        event=PromotionRequested(
            at=facts.now,
            op_id=facts.new_op_id,
            target=first,
            source="",
            reason="initial",
            detail=f"no route yet: {first} is the first declared domain",
            route_revision=view.route_revision,
        ),
        why="first route",
    )


# ------------------------------------------------------------------------------ manual requests

RequestStatus = Literal["noop", "accepted", "joined", "conflict", "refused", "not_found", "invalid"]


class Judgment(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to a manual request; `event` is what to append when it is accepted."""

    status: RequestStatus
    op_id: str = ""
    message: str = ""
    event: Event | None = None


RequestRule = Callable[[FleetView, str, str, str, datetime], Judgment]
"""(view, target, op_id, by, now) -> the verdict on a request of one kind, once the generic checks
(a known fleet and target, no other operation in flight) have passed."""


def _promotion_rule(view: FleetView, target: str, op_id: str, by: str, now: datetime) -> Judgment:
    if view.active == target:
        return Judgment(status="noop", message=f"{target} is already active in fleet {view.fleet}")
    event = PromotionRequested(
        at=now,
        by=by,
        op_id=op_id,
        target=target,
        source=view.active,
        reason="manual",
        route_revision=view.route_revision,
    )
    return Judgment(status="accepted", op_id=op_id, message=f"promotion of {target} accepted", event=event)


def _demotion_rule(view: FleetView, target: str, op_id: str, by: str, now: datetime) -> Judgment:
    if view.active == target:
        return Judgment(
            status="refused",
            message=f"{target} is the active domain of fleet {view.fleet}; promote the standby instead "
            f"(haru promote {view.standby() or '<standby>'})",
        )
    event = DemotionRequested(
        at=now, by=by, op_id=op_id, target=target, reason="manual", route_revision=view.route_revision
    )
    return Judgment(status="accepted", op_id=op_id, message=f"demotion of {target} accepted", event=event)


def _rolling_rule(view: FleetView, target: str, op_id: str, by: str, now: datetime) -> Judgment:
    if not view.active:
        return Judgment(
            status="refused",
            message=f"fleet {view.fleet} has no route yet: there is nothing to roll through; "
            f"the agents apply the declarations as they start",
        )
    if view.active == target:
        return Judgment(
            status="refused",
            message=f"{target} is the active domain of fleet {view.fleet}: a rolling change goes "
            f"through the standby (haru roll {view.standby() or '<standby>'})",
        )
    dv = view.domains[target]
    if dv.reachable is not True:
        return Judgment(
            status="refused",
            message=f"standby {target} is {'unreachable' if dv.reachable is False else 'not heard from yet'}: "
            f"a rolling change needs it to take over",
        )
    if not dv.eligible:
        return Judgment(
            status="refused", message=f"standby {target} is not eligible: {dv.ineligible_why or 'not recovered'}"
        )
    event = RollingRequested(
        at=now,
        by=by,
        op_id=op_id,
        target=target,
        source=view.active,
        reason="manual",
        route_revision=view.route_revision,
        decl_seq=view.decl_seq,
    )
    return Judgment(status="accepted", op_id=op_id, message=f"rolling change through {target} accepted", event=event)


def _provisioning_rule(kind: str) -> RequestRule:
    request = KINDS[kind].request

    def rule(view: FleetView, target: str, op_id: str, by: str, now: datetime) -> Judgment:
        dv = view.domains[target]
        if dv.provider not in ("skypilot", "skyserve"):
            return Judgment(
                status="refused",
                message=f"{target} is a {dv.provider} domain: Haru launches and tears down "
                "only skypilot/skyserve domains (set its provider and provision block, then `haru apply`)",
            )
        if view.active == target:
            return Judgment(
                status="refused",
                message=f"{target} is the active domain of fleet {view.fleet}: promote "
                f"the standby first (haru promote {view.standby() or '<standby>'}), then {kind} {target}",
            )
        if kind == "provision" and dv.reachable is True:
            return Judgment(
                status="noop",
                message=f"{target} already has a running agent; to move it to a new host, use `haru replace {target}`",
            )
        event = request(at=now, by=by, op_id=op_id, target=target)
        return Judgment(status="accepted", op_id=op_id, message=f"{kind} of {target} accepted", event=event)

    return rule


REQUEST_RULES: dict[str, RequestRule] = {
    "promotion": _promotion_rule,
    "demotion": _demotion_rule,
    "rolling": _rolling_rule,
    **{kind: _provisioning_rule(kind) for kind in PROVISIONING_KINDS},
}
"""Per kind, whether a manual request is a no-op, refused, or accepted (and its request event)."""


def judge_request(view: FleetView | None, kind: OpKind, target: str, *, op_id: str, by: str, now: datetime) -> Judgment:
    """Whether a manual request of `kind` on `target` is a no-op, joins, conflicts, is refused, or is accepted."""
    rule = REQUEST_RULES.get(kind)
    if rule is None:
        known = ", ".join(REQUEST_RULES)
        return Judgment(status="refused", message=f"no operation kind {kind!r} can be requested (known: {known})")
    if view is None or not view.domains:
        return Judgment(
            status="not_found", message="no such fleet (or it declares no domains); declare it with `haru apply`"
        )
    fleet = view.fleet
    if target not in view.domains:
        known = ", ".join(view.domains) or "none"
        return Judgment(status="not_found", message=f"no domain {target!r} in fleet {fleet} (declared: {known})")
    op = view.operation if view.operation is not None and view.operation.state == "running" else None
    if op is not None:
        if op.kind == kind and op.target == target:
            return Judgment(status="joined", op_id=op.op_id, message=f"joined {op.kind} of {target} already in flight")
        return Judgment(
            status="conflict",
            op_id=op.op_id,
            message=f"{op.kind} of {op.target} ({op.op_id}) is in flight: one operation at a time per fleet; "
            f"follow it with `haru op {op.op_id} --fleet {fleet}`, or abort it with `haru op abort {op.op_id}`",
        )
    return rule(view, target, op_id, by, now)


def judge_abort(view: FleetView | None, op_id: str, *, by: str, now: datetime, why: str = "") -> Judgment:
    """Whether the operator may abort the operation in flight (`op_id` '' = whichever is in flight).

    Refused once the kind's `no_abort_from` step has started (the route may be moving: the operation
    finishes, its later steps are best effort). The abort is `operation_aborted` on the op subject,
    appended against the op subject's last sequence: a step started meanwhile makes it conflict, and
    the request is judged again on the newer view."""
    if view is None or not view.domains:
        return Judgment(status="not_found", message="no such fleet (or it declares no domains)")
    op = view.operation if view.operation is not None and view.operation.state == "running" else None
    if op is None or (op_id and op.op_id != op_id):
        last = view.last_operation
        if op_id and last is not None and last.op_id == op_id:
            return Judgment(status="noop", op_id=op_id, message=f"{op_id} already {last.state}")
        what = f"operation {op_id} is not in flight" if op_id else "no operation is in flight"
        return Judgment(
            status="not_found", op_id=op_id, message=f"{what} in fleet {view.fleet}; list them with `haru op`"
        )
    spec = KINDS.get(op.kind)
    stop = spec.no_abort_from if spec is not None else ""
    if stop and any(s.step == stop for s in op.steps):
        return Judgment(
            status="refused",
            op_id=op.op_id,
            message=f"{op.kind} {op.op_id} has started its {stop} step: it can no longer be aborted (routing may be "
            f"moving); follow it with `haru op {op.op_id}`",
        )
    cur = last_step(op)
    error = f"aborted by {by or 'the operator'}" + (f": {why}" if why else "")
    event = OperationAborted(at=now, by=by, op_id=op.op_id, step=cur.step if cur is not None else "", error=error)
    return Judgment(status="accepted", op_id=op.op_id, message=f"{op.kind} {op.op_id} aborted", event=event)


def tables_markdown() -> str:
    """The two tables as Markdown, for docs/promoter.md (a unit test checks the doc carries them)."""
    lines = ["| step | acts on | agent verbs | bounded by (policy) | on failure |", "|---|---|---|---|---|"]
    for kind in KINDS:
        for step in flow(kind):
            spec = STEPS[step]
            verbs = ", ".join(f"`{v}`" for v in spec.verbs) or (
                "(route_moved CAS)"
                if spec.run == "flip"
                else f"(runner `{spec.run}`: sky, docs/provisioning.md)"
                if spec.run in ("launch", "down")
                else f"(runner `{spec.run}`)"
            )
            bound = " + ".join(f"`{b}`" for b in spec.bound)
            failure = TRANSITIONS[(kind, step, "failed")]
            lines.append(f"| {kind}: `{step}` | {spec.on} | {verbs} | {bound} | {failure} |")
    lines += ["", "| kind | after | outcome | next |", "|---|---|---|---|"]
    for (op_kind, after, outcome), nxt in TRANSITIONS.items():
        lines.append(f"| {op_kind} | {after or '(request)'} | {outcome} | {nxt} |")
    return "\n".join(lines)
