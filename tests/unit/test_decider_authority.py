"""The decider against what only a writer of the op subject could record (the promoter, the
gateway, the operator): a step an operation does not have, a flip started before the probe. Given
events, when decide, then appends; no such record wedges the fleet or moves the route unprobed."""

from __future__ import annotations

from haru.core.events import DemotionRequested, OperationAborted, StepCompleted, StepFailed, StepStarted
from haru.core.saga import lease_ms
from haru.promoter.drive import flip_refusal
from tests.support.decider import OP, POLICY, at, facts, given, healthy_fleet, only, requested, through


def test_a_step_a_demotion_does_not_have_aborts_it_instead_of_wedging_the_fleet():
    view = given(
        *healthy_fleet(),
        (OP, DemotionRequested(at=at(1), op_id="op-d", target="b")),
        (OP, StepStarted(at=at(2), op_id="op-d", step="wake")),
        (OP, StepFailed(at=at(3), op_id="op-d", step="wake", error="forged")),
    )
    event = only(view)  # before: KeyError ('demotion', 'wake', 'failed') on every round, the op running for ever
    assert isinstance(event, OperationAborted) and event.op_id == "op-d"
    assert event.error == "wake is not a step of a demotion"


def test_a_flip_started_in_a_demotion_is_aborted_not_run():
    view = given(
        *healthy_fleet(),
        (OP, DemotionRequested(at=at(1), op_id="op-d", target="b")),
        (OP, StepStarted(at=at(2), op_id="op-d", step="flip")),
    )
    event = only(view, facts(ms=60_000))
    assert isinstance(event, OperationAborted) and event.step == "flip"


def test_a_flip_started_before_the_probe_is_refused_when_it_is_run():
    base = given(*healthy_fleet())
    view = given(
        *healthy_fleet(),
        requested(revision=base.route_revision),
        *through("wake"),
        (OP, StepStarted(at=at(5), op_id="op-1", step="flip")),
    )
    # The decider re-starts a started step whose lease ran out ...
    event = only(view, facts(ms=5 + lease_ms("flip", POLICY)))
    assert isinstance(event, StepStarted) and event.step == "flip" and event.attempt == 2
    # ... and what runs it asks first: no probe completed in this operation, so no route move.
    assert flip_refusal(view, view.operation) == "b's models were not probed in this operation"
    probed = given(*healthy_fleet(), requested(revision=base.route_revision), *through("flip"))
    assert flip_refusal(probed, probed.operation) == ""
    demotion = given(*healthy_fleet(), (OP, DemotionRequested(at=at(1), op_id="op-d", target="b")))
    assert flip_refusal(demotion, demotion.operation) == "a demotion never moves the route"


def test_steps_of_the_operation_still_flow():
    base = given(*healthy_fleet())
    view = given(
        *healthy_fleet(),
        requested(revision=base.route_revision),
        *through("probe"),
        (OP, StepStarted(at=at(4), op_id="op-1", step="probe")),
        (OP, StepCompleted(at=at(5), op_id="op-1", step="probe")),
    )
    event = only(view)
    assert isinstance(event, StepStarted) and event.step == "flip"
