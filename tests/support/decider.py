"""The promotion decider's test language: a fleet at a fixed clock (`at(ms)`), the view folded from events
(`given`), the facts of a moment (`facts`) and what the decider appends (`only`).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from haru.core import subjects
from haru.core.events import (
    AdmissionDecided,
    DomainDeclared,
    DomainReachable,
    DomainUnreachable,
    FleetDeclared,
    ModelDeclared,
    ModelResident,
    ModelSleeping,
    PromotionRequested,
    RouteMoved,
    StepCompleted,
    StepStarted,
)
from haru.core.fold import evolve
from haru.core.saga import flow
from haru.core.specs import DomainSpec, GpuSpec, ModelSpec, Policy
from haru.promoter.decider import decide
from haru.promoter.decisions import Facts

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
F = "default"
OP = subjects.op(F)
ROUTE = subjects.route(F)
POLICY = Policy(
    heartbeat_timeout_ms=1000,
    degraded_grace_ms=5000,
    command_timeout_ms=2000,
    wake_timeout_ms=4000,
    probe_timeout_ms=3000,
    training_grace_ms=1000,
)


def at(ms: int) -> datetime:
    return T0 + timedelta(milliseconds=ms)


def declarations(policy: Policy = POLICY, models=("m1", "m2")) -> list[tuple[str, object]]:
    """The fleet's declarations: two domains a, b, each with `models`, admitted."""
    base: list[tuple[str, object]] = [(subjects.decl(F), FleetDeclared(at=T0, fleet=F, policy=policy))]
    for d in ("a", "b"):
        base.append(
            (
                subjects.decl(F),
                DomainDeclared(at=T0, spec=DomainSpec(name=d, gpus=[GpuSpec(index=0, memory_bytes=24 << 30)])),
            )
        )
        for m in models:
            base.append(
                (subjects.decl(F), ModelDeclared(at=T0, domain=d, spec=ModelSpec(name=m, slot="chat", gpu_index=0)))
            )
            base.append(
                (
                    subjects.decl(F),
                    AdmissionDecided(at=T0, domain=d, name=m, gpu_index=0, admitted=True, vram_bytes=1),
                )
            )
    return base


def given(*events_on: tuple[str, object], policy: Policy = POLICY, models=("m1", "m2"), declare=True):
    """A view folded from declarations (two domains a, b, each with models) plus `events_on`."""
    seq = 0
    view = None
    from haru.core.fold import empty

    view = empty(F)
    base = declarations(policy, models) if declare else []
    for subject, event in [*base, *events_on]:
        seq += 1
        view = evolve(view, event, seq=seq, subject=subject)
    return view


def resident(domain: str, model: str, ms: int = 0):
    return (subjects.model(F, domain, model), ModelResident(at=at(ms), domain=domain, model=model))


def sleeping(domain: str, model: str, ms: int = 0):
    return (subjects.model(F, domain, model), ModelSleeping(at=at(ms), domain=domain, model=model))


def reachable(domain: str, ms: int = 0):
    return (subjects.liveness(F, domain), DomainReachable(at=at(ms), domain=domain))


def unreachable(domain: str, ms: int = 0):
    return (subjects.liveness(F, domain), DomainUnreachable(at=at(ms), domain=domain, silent_ms=1500))


def routed(active: str, ms: int = 0, op_id: str = "op-0"):
    return (ROUTE, RouteMoved(at=at(ms), active=active, op_id=op_id))


def healthy_fleet(active: str = "a"):
    """a active and resident, b standby and asleep, both reachable."""
    standby = "b" if active == "a" else "a"
    return [
        reachable("a"),
        reachable("b"),
        resident(active, "m1"),
        resident(active, "m2"),
        sleeping(standby, "m1"),
        sleeping(standby, "m2"),
        routed(active),
    ]


def facts(ms: int = 10, **kw) -> Facts:
    kw.setdefault("silent_ms", {"a": 100, "b": 100})
    kw.setdefault("listening_ms", 60_000)
    kw.setdefault("me", "promoter:test")
    kw.setdefault("new_op_id", "op-new")
    return Facts(now=at(ms), **kw)


def op_appends(view, f: Facts | None = None):
    """The decisions on the op/route subjects (liveness verdicts left out)."""
    return [a for a in decide(view, f or facts()) if "liveness" not in a.subject]


def only(view, f: Facts | None = None):
    out = op_appends(view, f)
    assert len(out) <= 1
    return out[0].event if out else None


def requested(target="b", source="a", op_id="op-1", revision=None, ms=1):
    return (
        OP,
        PromotionRequested(
            at=at(ms), op_id=op_id, target=target, source=source, route_revision=revision if revision is not None else 0
        ),
    )


def through(step: str, op_id="op-1"):
    steps = flow("promotion")
    out = []
    for s in steps[: steps.index(step)]:
        out += [(OP, StepStarted(at=at(2), op_id=op_id, step=s)), (OP, StepCompleted(at=at(3), op_id=op_id, step=s))]
    return out
