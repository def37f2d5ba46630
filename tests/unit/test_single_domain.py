"""A single-domain fleet (`haru serve`): the first route goes to its one domain, and when it fails the
promoter says there is nothing to fail over to, once, instead of promoting or staying silent."""

from __future__ import annotations

from haru.core import subjects
from haru.core.events import (
    AdmissionDecided,
    DomainDeclared,
    FailoverDeclined,
    FleetDeclared,
    GpuObserved,
    ModelDeclared,
    PromotionRequested,
)
from haru.core.fold import empty, evolve
from haru.core.specs import DomainSpec, GpuSpec, ModelSpec
from tests.support.decider import POLICY, T0, F, at, facts, only, reachable, resident, routed


def single(*events):
    view = empty(F)
    base = [
        (subjects.decl(F), FleetDeclared(at=T0, fleet=F, policy=POLICY)),
        (
            subjects.decl(F),
            DomainDeclared(at=T0, spec=DomainSpec(name="local", gpus=[GpuSpec(index=0, memory_bytes=24 << 30)])),
        ),
        (subjects.decl(F), ModelDeclared(at=T0, domain="local", spec=ModelSpec(name="m1", slot="chat", gpu_index=0))),
        (
            subjects.decl(F),
            AdmissionDecided(at=T0, domain="local", name="m1", gpu_index=0, admitted=True, vram_bytes=1),
        ),
    ]
    for seq, (subject, event) in enumerate([*base, *events], start=1):
        view = evolve(view, event, seq=seq, subject=subject)
    return view


def test_the_first_route_goes_to_the_one_domain():
    view = single(reachable("local"), resident("local", "m1"))
    event = only(view, facts(silent_ms={"local": 100}))
    assert isinstance(event, PromotionRequested) and event.target == "local" and event.reason == "initial"


def test_a_failed_single_domain_is_declined_with_nothing_to_fail_over_to():
    detached = (subjects.gpu(F, "local", 0), GpuObserved(at=at(5), domain="local", index=0, present=False))
    view = single(reachable("local"), resident("local", "m1"), routed("local"), detached)
    f = facts(ms=10, silent_ms={"local": 100})
    event = only(view, f)
    assert isinstance(event, FailoverDeclined), event
    assert event.domain == "local" and event.candidate == ""
    assert "a single-domain fleet: there is nothing to fail over to" in event.why
    view = evolve(view, event, seq=view.seq + 1, subject=subjects.op(F))
    assert only(view, f) is None  # said once
