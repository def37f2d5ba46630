"""The sagas as data: what each kind of operation is, what each step does, what follows each outcome.

Pure: tables and the arithmetic read from them. The promoter drives operations by these tables
(haru.promoter.drive), the gateway and its console draw them (the stepper's columns), `haru op`
and docs/promoter.md print them. `KINDS` says what each kind of operation is (its request event,
the step from which it can no longer be aborted), `STEPS` says what each step does (on which domain,
which agent verbs or which runner, bounded by which policy values) and `TRANSITIONS` says what
follows each outcome, per kind. A new kind is a request event (`haru.core.events.OperationRequested`),
a `KINDS` row, its `TRANSITIONS` rows, any new `STEPS`, and a request rule
(`haru.core.requests.REQUEST_RULES`): docs/promoter.md, "Adding an operation kind".

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec

from haru.core.events import (
    DemotionRequested,
    OperationRequested,
    PromotionRequested,
    ProvisionRequested,
    ReplaceRequested,
    RollingRequested,
    TeardownRequested,
    WeightingRequested,
)
from haru.core.specs import Policy
from haru.core.views import OperationView, StepView

OpKind = str  # a key of KINDS
Outcome = Literal["requested", "completed", "failed"]

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
        what="append route_moved on the route subject, expecting its real last sequence, if the route has not "
        "moved since",
    ),
    "settle_old_active": StepSpec(
        on="other",
        verbs=("sleep", "start_training"),
        bound=("router_ack_timeout_ms", "drain_ms", "command_timeout_ms", "command_timeout_ms"),
        fatal=False,
        run="settle",
        what="best effort: wait until the routers that follow the fleet applied the new route (router_ack_timeout_ms), "
        "let the old active's requests in flight finish (drain_ms), put it to sleep, start its training",
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
        what="make a standby domain active: stop its training, wake and probe it, flip the route, settle the old "
        "active",
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


def last_step(op: OperationView) -> StepView | None:
    return op.steps[-1] if op.steps else None


def step_record(op: OperationView, step: str) -> StepView | None:
    """The latest record of `step` in the operation."""
    for sv in reversed(op.steps):
        if sv.step == step:
            return sv
    return None


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
