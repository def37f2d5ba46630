"""Hypothesis strategies for the fold's property tests: random but well-formed event histories of several
fleets, domains and models.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import strategies as st

from haru.core import events as ev
from haru.core import residency
from haru.core import subjects as sj
from haru.core.sizes import GiB
from haru.core.specs import DomainSpec, GpuSpec, ModelSpec, Policy, TrainingSpec

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
FLEETS = ("default", "edge")
DOMAINS = ("a", "b")
MODELS = ("qwen3.6:27b", "Llama-3.1-8B", "tiny")
STEPS = ("stop_training", "verify_gpu", "wake", "probe", "flip")
RESIDENCY_EVENTS = {
    "model_loading": lambda at, d, m, draw: ev.ModelLoading(at=at, domain=d, model=m, attempt=draw(st.integers(1, 3))),
    "model_resident": lambda at, d, m, draw: ev.ModelResident(
        at=at, domain=d, model=m, warmup_ms=draw(st.integers(0, 9000))
    ),
    "model_sleeping": lambda at, d, m, draw: ev.ModelSleeping(
        at=at, domain=d, model=m, level=draw(st.sampled_from([1, 2]))
    ),
    "model_waking": lambda at, d, m, draw: ev.ModelWaking(at=at, domain=d, model=m),
    "model_lost": lambda at, d, m, draw: ev.ModelLost(
        at=at,
        domain=d,
        model=m,
        reason=draw(st.sampled_from(["evicted", "gpu_detached", "process_exited", "unhealthy"])),
    ),
    "model_failed": lambda at, d, m, draw: ev.ModelFailed(at=at, domain=d, model=m, runtime_said="CUDA OOM"),
    "model_stopped": lambda at, d, m, draw: ev.ModelStopped(at=at, domain=d, model=m),
}


@st.composite
def histories(draw) -> list[tuple[int, str, ev.Event]]:
    """A random legal history across fleets: declarations, then a mix of everything else."""
    items: list[tuple[str, ev.Event]] = []
    clock = [0.0]

    def at() -> datetime:
        clock[0] += draw(st.floats(0.001, 100.0))
        return T0 + timedelta(seconds=clock[0])

    states: dict[tuple[str, str, str], str] = {}
    ops: dict[str, str] = {}
    n_op = [0]
    for fleet in FLEETS[: draw(st.integers(1, 2))]:
        items.append(
            (sj.decl(fleet), ev.FleetDeclared(at=at(), fleet=fleet, policy=Policy(auto_failover=draw(st.booleans()))))
        )
        for d in DOMAINS:
            spec = DomainSpec(
                name=d,
                serving_url=f"http://{d}:9000",
                gpus=[GpuSpec(index=0, memory_bytes=48 * GiB, reserve_bytes=GiB)],
            )
            items.append((sj.decl(fleet), ev.DomainDeclared(at=at(), spec=spec)))
            for m in MODELS[: draw(st.integers(1, 3))]:
                items.append(
                    (
                        sj.decl(fleet),
                        ev.ModelDeclared(
                            at=at(),
                            domain=d,
                            spec=ModelSpec(
                                name=m,
                                slot="s" + str(len(states)),
                                gpu_index=0,
                                vram_bytes=10 * GiB,
                                port=8000 + len(states),
                            ),
                        ),
                    )
                )
                admitted = draw(st.booleans())
                items.append(
                    (
                        sj.decl(fleet),
                        ev.AdmissionDecided(
                            at=at(),
                            domain=d,
                            name=m,
                            gpu_index=0,
                            admitted=admitted,
                            vram_bytes=10 * GiB,
                            short_by_bytes=0 if admitted else GiB,
                        ),
                    )
                )
                states[(fleet, d, m)] = "unknown" if admitted else "not_admitted"
            items.append(
                (
                    sj.decl(fleet),
                    ev.TrainingDeclared(
                        at=at(),
                        domain=d,
                        spec=TrainingSpec(slot="lora", gpu_index=0, command=["t"], checkpoint_dir="/c"),
                    ),
                )
            )
    fleets = sorted({k[0] for k in states})
    for _ in range(draw(st.integers(0, 60))):
        fleet = draw(st.sampled_from(fleets))
        d = draw(st.sampled_from(DOMAINS))
        kind = draw(
            st.sampled_from(
                [
                    "residency",
                    "residency",
                    "residency",
                    "gpu",
                    "training",
                    "agent",
                    "liveness",
                    "op",
                    "route",
                    "eligible",
                    "policy",
                ]
            )
        )
        if kind == "residency":
            m = draw(st.sampled_from([k[2] for k in states if k[0] == fleet and k[1] == d]))
            state = states[(fleet, d, m)]
            legal = [e for (s, e), _ in residency.TRANSITIONS.items() if s == state and e in RESIDENCY_EVENTS]
            if not legal:
                continue
            tag = draw(st.sampled_from(sorted(legal)))
            states[(fleet, d, m)] = residency.TRANSITIONS[(state, tag)]
            items.append((sj.model(fleet, d, m), RESIDENCY_EVENTS[tag](at(), d, m, draw)))
        elif kind == "gpu":
            items.append(
                (
                    sj.gpu(fleet, d, 0),
                    ev.GpuObserved(
                        at=at(),
                        domain=d,
                        index=0,
                        present=draw(st.sampled_from([True, False, None])),
                        memory_used_bytes=draw(st.integers(0, 48 * GiB)),
                    ),
                )
            )
        elif kind == "training":
            if draw(st.booleans()):
                items.append(
                    (
                        sj.training(fleet, d, "lora"),
                        ev.TrainingStarted(at=at(), domain=d, slot="lora", pid=draw(st.integers(2, 9999)), gpu_index=0),
                    )
                )
            else:
                items.append(
                    (
                        sj.training(fleet, d, "lora"),
                        ev.TrainingStopped(
                            at=at(),
                            domain=d,
                            slot="lora",
                            how=draw(st.sampled_from(["exited", "terminated", "killed"])),
                        ),
                    )
                )
        elif kind == "agent":
            event = (
                ev.AgentStarted(at=at(), domain=d, host=d + "-host", pid=1)
                if draw(st.booleans())
                else ev.AgentStopping(at=at(), domain=d)
            )
            items.append((sj.agent(fleet, d), event))
        elif kind == "liveness":
            event = (
                ev.DomainUnreachable(at=at(), domain=d)
                if draw(st.booleans())
                else ev.DomainReachable(at=at(), domain=d)
            )
            items.append((sj.liveness(fleet, d), event))
        elif kind == "op":
            current = ops.get(fleet)
            if current is None:
                n_op[0] += 1
                op_id = f"op{n_op[0]}"
                ops[fleet] = op_id
                req = (
                    ev.PromotionRequested(at=at(), op_id=op_id, target=d)
                    if draw(st.booleans())
                    else ev.DemotionRequested(at=at(), op_id=op_id, target=d)
                )
                items.append((sj.op(fleet), req))
            else:
                step = draw(st.sampled_from(STEPS))
                which = draw(st.sampled_from(["start", "done", "fail", "complete", "abort", "declined"]))
                event = {  # built lazily: only the chosen one takes a time from at()
                    "start": lambda op, step, d: ev.StepStarted(at=at(), op_id=op, step=step),
                    "done": lambda op, step, d: ev.StepCompleted(at=at(), op_id=op, step=step, took_ms=5),
                    "fail": lambda op, step, d: ev.StepFailed(at=at(), op_id=op, step=step, error="x"),
                    "complete": lambda op, step, d: ev.OperationCompleted(at=at(), op_id=op),
                    "abort": lambda op, step, d: ev.OperationAborted(at=at(), op_id=op, step=step, error="x"),
                    "declined": lambda op, step, d: ev.FailoverDeclined(at=at(), domain=d, why="standby lost"),
                }[which](current, step, d)
                if which in ("complete", "abort"):
                    del ops[fleet]
                items.append((sj.op(fleet), event))
        elif kind == "route":
            items.append((sj.route(fleet), ev.RouteMoved(at=at(), active=d)))
        elif kind == "eligible":
            items.append(
                (sj.op(fleet), ev.EligibilityChanged(at=at(), domain=d, eligible=draw(st.booleans()), why="GPU gone"))
            )
        else:
            items.append(
                (
                    sj.decl(fleet),
                    ev.PolicyChanged(at=at(), policy=Policy(degraded_grace_ms=draw(st.integers(1, 10**6)))),
                )
            )
    return [(i + 1, s, e) for i, (s, e) in enumerate(items)]
