"""A standby whose runtimes cannot sleep is a standby, and the promoter never repeats itself.

Issue 12 found `standby_awake` demotions in an endless loop (2,253 in 30 s) on a fleet of real
llama-servers: a runtime without a sleep mode never looks asleep, the demotion "succeeds" without
changing anything, and the next decision is the same one. Here: given events, when decide, then
appends; and a property over any fleet (hypothesis): left alone, the decider settles after a
bounded number of operations and then appends nothing, whatever sleep does.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from haru.core import subjects
from haru.core.events import (
    AdmissionDecided,
    DemotionRequested,
    DomainDeclared,
    FleetDeclared,
    ModelDeclared,
    ModelResident,
    ModelSleeping,
    OperationCompleted,
    PromotionRequested,
    RouteMoved,
    StepCompleted,
    StepStarted,
)
from haru.core.fold import empty, evolve
from haru.core.specs import SLEEP_MODE, DomainSpec, GpuSpec, ModelSpec
from haru.promoter.decider import decide
from haru.promoter.decisions import Facts
from tests.support.decider import OP, POLICY, ROUTE, F, at, reachable, routed

RUNTIMES = ("vllm", "llama_server")


class Fleet:
    """A view folded event by event, with the sequence numbers the log would give."""

    def __init__(self, models: dict[str, str]) -> None:
        self.view = empty(F)
        self.seq = 0
        self.fold(subjects.decl(F), FleetDeclared(at=at(0), fleet=F, policy=POLICY))
        for d in ("a", "b"):
            self.fold(
                subjects.decl(F),
                DomainDeclared(at=at(0), spec=DomainSpec(name=d, gpus=[GpuSpec(index=0, memory_bytes=24 << 30)])),
            )
            for name, runtime in models.items():
                spec = ModelSpec(name=name, slot="chat", gpu_index=0, runtime=runtime)  # type: ignore[arg-type]
                self.fold(subjects.decl(F), ModelDeclared(at=at(0), domain=d, spec=spec))
                self.fold(
                    subjects.decl(F),
                    AdmissionDecided(at=at(0), domain=d, name=name, gpu_index=0, admitted=True, vram_bytes=1),
                )

    def fold(self, subject: str, event) -> None:
        self.seq += 1
        self.view = evolve(self.view, event, seq=self.seq, subject=subject)

    def ops(self, ms: int) -> list:
        facts = Facts(
            now=at(ms), me="promoter:me", new_op_id=f"op-{ms}", silent_ms={"a": 10, "b": 10}, listening_ms=60_000
        )
        return [a for a in decide(self.view, facts) if a.subject in (OP, ROUTE)]


def resident(fleet: Fleet, domain: str, model: str, ms: int = 0) -> None:
    fleet.fold(subjects.model(F, domain, model), ModelResident(at=at(ms), domain=domain, model=model))


def asleep(fleet: Fleet, domain: str, model: str, ms: int = 0) -> None:
    fleet.fold(subjects.model(F, domain, model), ModelSleeping(at=at(ms), domain=domain, model=model))


def routed_fleet(models: dict[str, str], standby: dict[str, str]) -> Fleet:
    """a active with every model resident; b's models resident or asleep as given."""
    fleet = Fleet(models)
    for subject, event in (reachable("a"), reachable("b")):
        fleet.fold(subject, event)
    for m in models:
        resident(fleet, "a", m)
        (resident if standby[m] == "resident" else asleep)(fleet, "b", m)
    fleet.fold(*routed("a"))
    return fleet


def test_the_runtime_table_is_the_runtimes_own():
    from haru.agents.runtimes import ExternalRuntime, LlamaServerRuntime, VllmRuntime

    assert {c.kind: c.can_sleep for c in (VllmRuntime, LlamaServerRuntime, ExternalRuntime)} == SLEEP_MODE


def test_a_resident_standby_of_runtimes_without_sleep_is_not_demoted():
    fleet = routed_fleet({"m1": "llama_server", "m2": "llama_server"}, {"m1": "resident", "m2": "resident"})
    assert fleet.ops(10) == []


def test_an_awake_runtime_that_can_sleep_is_still_demoted_beside_one_that_cannot():
    fleet = routed_fleet({"m1": "llama_server", "m2": "vllm"}, {"m1": "resident", "m2": "resident"})
    [append] = fleet.ops(10)
    assert isinstance(append.event, DemotionRequested) and append.event.reason == "standby_awake"
    asleep(fleet, "b", "m2", 11)  # the agent put the vLLM one to sleep; the llama-server one stays resident
    assert fleet.ops(12) == []


def _complete_demotion(fleet: Fleet, op_id: str, ms: int) -> None:
    for step in ("sleep", "start_training"):
        fleet.fold(OP, StepStarted(at=at(ms), op_id=op_id, step=step))
        fleet.fold(OP, StepCompleted(at=at(ms), op_id=op_id, step=step))
    fleet.fold(OP, OperationCompleted(at=at(ms), op_id=op_id))


def test_a_demotion_that_changed_nothing_is_not_requested_again():
    # A vLLM standby whose sleep "succeeded" without the model ever being recorded asleep.
    fleet = routed_fleet({"m1": "vllm"}, {"m1": "resident"})
    [append] = fleet.ops(10)
    fleet.fold(OP, append.event)
    _complete_demotion(fleet, append.event.op_id, 11)
    assert fleet.ops(20) == [] and fleet.ops(60_000) == []
    # Its input changes (recorded asleep, then woken behind the promoter's back): decided afresh.
    asleep(fleet, "b", "m1", 60_001)
    assert fleet.ops(60_002) == []
    resident(fleet, "b", "m1", 60_003)
    [again] = fleet.ops(60_004)
    assert isinstance(again.event, DemotionRequested) and again.event.target == "b"


# ------------------------------------------------------------------------------------ the property

STANDBY = st.sampled_from(["resident", "sleeping"])


@settings(max_examples=150, deadline=None)
@given(
    runtimes=st.lists(st.sampled_from(RUNTIMES), min_size=1, max_size=4),
    standby=st.lists(STANDBY, min_size=4, max_size=4),
    sleep_works=st.booleans(),
    promote_first=st.booleans(),
)
def test_left_alone_the_promoter_settles_and_then_appends_nothing(runtimes, standby, sleep_works, promote_first):
    """Any mix of runtimes, any standby residency, a sleep that works or silently does nothing: at most
    two operations (an optional manual promotion, then one demotion), then silence for a long while.

    The agent is modelled by what it records: `sleep` puts a resident model that can sleep to sleep
    (when `sleep_works`), `wake` wakes a sleeping one, the flip moves the route; nothing else changes.
    """
    models = {f"m{i}": r for i, r in enumerate(runtimes)}
    fleet = routed_fleet(models, {m: standby[i] for i, m in enumerate(models)})
    if promote_first:
        fleet.fold(
            OP,
            PromotionRequested(
                at=at(1),
                op_id="op-manual",
                target="b",
                source="a",
                reason="manual",
                route_revision=fleet.view.route_revision,
            ),
        )

    def on_domain(op, step: str) -> str:
        other = "a" if op.target == "b" else "b"
        return other if step == "settle_old_active" else op.target

    requested = 0
    ms = 10
    quiet = 0
    for _ in range(400):
        ms += 50
        appends = fleet.ops(ms)
        if not appends:
            quiet += 1
            if quiet >= 20:
                break
            ms += 5_000  # time passes: backoffs and leases run out, nothing else happens
            continue
        quiet = 0
        assert len(appends) == 1
        event = appends[0].event
        fleet.fold(appends[0].subject, event)
        if isinstance(event, (DemotionRequested, PromotionRequested)):
            requested += 1
        if not isinstance(event, StepStarted):
            continue
        op = fleet.view.operation
        domain = on_domain(op, event.step)
        for name, runtime in models.items():
            state = type(fleet.view.domains[domain].models[name].residency).__name__
            if (
                event.step in ("sleep", "settle_old_active")
                and state == "Resident"
                and SLEEP_MODE[runtime]
                and sleep_works
            ):
                asleep(fleet, domain, name, ms)
            if event.step == "wake" and state == "Sleeping":
                resident(fleet, domain, name, ms)
        if event.step == "flip":
            fleet.fold(ROUTE, RouteMoved(at=at(ms), active=op.target, previous=fleet.view.active, op_id=op.op_id))
        fleet.fold(OP, StepCompleted(at=at(ms), op_id=op.op_id, step=event.step))
    assert quiet >= 20, "the promoter kept deciding"
    assert requested <= 2, f"{requested} operations requested for a fleet left alone"
    assert fleet.view.operation is None


def test_a_resident_standby_vllm_that_cannot_sleep_is_not_demoted():
    """A vLLM on a platform without sleep mode (learned at launch: `model_resident.sleeps` false) serves
    the standby role resident, like llama-server: no standby_awake demotion for it."""
    fleet = routed_fleet({"m1": "vllm"}, {"m1": "resident"})
    assert len(fleet.ops(10)) == 1  # a vLLM that can sleep: demoted
    fleet = Fleet({"m1": "vllm"})
    for subject, event in (reachable("a"), reachable("b")):
        fleet.fold(subject, event)
    for d in ("a", "b"):
        fleet.fold(subjects.model(F, d, "m1"), ModelResident(at=at(0), domain=d, model="m1", sleeps=False))
    fleet.fold(*routed("a"))
    assert fleet.ops(10) == [] and fleet.ops(60_000) == []
