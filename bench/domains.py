"""What more failure domains per fleet cost: the fold, `haru status` and the route intent at 2, 4 and 8
domains, printed as ratios against 2 domains measured in the same run (goal: no worse than linear).

    .venv/bin/python bench/domains.py [--events-per-domain 2000] [--repeat 5]

Pure CPU, no I/O: each fleet's history is synthetic but shaped like a real one (per domain: its
declarations and admissions, three models on one GPU, an agent start, liveness, GPU observations and
residency cycles: resident, asleep, woken with a measured wake, with a training slot started and
stopped), plus a failover now and then, with its steps and route_moved. A standby writes more
events a round than the active (its wakes), so a fleet's events grow a little faster than N: linear
for the fold is the ratio of the events folded (the cost per event stays flat); for status and the
route intent (one view of N domains), N/2.

Printed per size: the fold of the whole history (and per event), `haru status` rendered from the
view, the route intent (which ranks the standbys), its JSON size, and each ratio against 2 domains
with the linear figure beside it. Timings are the best of `--repeat`.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from haru.core import events as ev
from haru.core import subjects
from haru.core.fold import fold
from haru.core.intents import intent
from haru.core.specs import DomainSpec, GpuSpec, ModelSpec, Policy, TrainingSpec
from haru.core.views import view_encoder
from haru.projections.status import render

F = "bench"
T0 = datetime(2026, 12, 2, tzinfo=UTC)
MODELS = ("qwen3-0.6b", "Qwen/Qwen3-4B-Instruct", "qwen3.6:27b-sim")
NAMES = "abcdefgh"


def history(n: int, per_domain: int) -> list[tuple[int, str, ev.Event]]:
    """(seq, subject, event) for a fleet of `n` domains with about `per_domain` events each."""
    out: list[tuple[int, str, ev.Event]] = []
    seq = 0

    def add(subject: str, event: ev.Event) -> None:
        nonlocal seq
        seq += 1
        out.append((seq, subject, event))

    def at(ms: int) -> datetime:
        return T0 + timedelta(milliseconds=ms)

    names = NAMES[:n]
    decl, op, route = subjects.decl(F), subjects.op(F), subjects.route(F)
    add(decl, ev.FleetDeclared(at=T0, fleet=F, policy=Policy()))
    for d in names:
        add(decl, ev.DomainDeclared(at=T0, spec=DomainSpec(name=d, gpus=[GpuSpec(index=0, memory_bytes=80 << 30)])))
        for m in MODELS:
            add(
                decl,
                ev.ModelDeclared(at=T0, domain=d, spec=ModelSpec(name=m, slot="chat", gpu_index=0, vram_bytes=8 << 30)),
            )
            add(decl, ev.AdmissionDecided(at=T0, domain=d, name=m, gpu_index=0, admitted=True, vram_bytes=8 << 30))
        add(
            decl,
            ev.TrainingDeclared(
                at=T0,
                domain=d,
                spec=TrainingSpec(
                    slot="lora", gpu_index=0, command=["train"], checkpoint_dir="/ck", vram_bytes=8 << 30
                ),
            ),
        )
        add(subjects.agent(F, d), ev.AgentStarted(at=T0, domain=d, host=f"host-{d}", pid=100))
        add(subjects.liveness(F, d), ev.DomainReachable(at=T0, domain=d))
    active = names[0]
    add(route, ev.RouteMoved(at=T0, active=active))
    ms = 0
    rounds = max(1, per_domain // 12)
    for r in range(rounds):
        ms += 1000
        for d in names:
            for m in MODELS:
                s = subjects.model(F, d, m)
                if d == active:
                    add(s, ev.ModelResident(at=at(ms), domain=d, model=m))
                else:
                    add(s, ev.ModelSleeping(at=at(ms), domain=d, model=m))
                    add(s, ev.ModelWaking(at=at(ms + 1), domain=d, model=m))
                    add(s, ev.ModelResident(at=at(ms + 300), domain=d, model=m, warmup_ms=300))
            add(
                subjects.gpu(F, d, 0),
                ev.GpuObserved(
                    at=at(ms),
                    domain=d,
                    index=0,
                    present=True,
                    memory_total_bytes=80 << 30,
                    memory_used_bytes=(r % 7) << 30,
                ),
            )
            t = subjects.training(F, d, "lora")
            add(t, ev.TrainingStarted(at=at(ms), domain=d, slot="lora", gpu_index=0, pid=200 + r))
            add(t, ev.TrainingStopped(at=at(ms + 500), domain=d, slot="lora", how="terminated"))
        if r and r % max(1, 500 // 12) == 0:  # a failover now and then: to the next domain in turn
            target = names[(names.index(active) + 1) % n]
            op_id = f"op-{r}"
            add(
                op,
                ev.PromotionRequested(
                    at=at(ms), op_id=op_id, target=target, source=active, reason="gpu_detached", cascade=True
                ),
            )
            for step in ("stop_training", "verify_gpu", "wake", "probe", "flip"):
                add(op, ev.StepStarted(at=at(ms), op_id=op_id, step=step))  # type: ignore[arg-type]
                add(op, ev.StepCompleted(at=at(ms + 10), op_id=op_id, step=step))  # type: ignore[arg-type]
            add(route, ev.RouteMoved(at=at(ms + 20), active=target, previous=active, op_id=op_id))
            add(op, ev.OperationCompleted(at=at(ms + 30), op_id=op_id))
            active = target
    return out


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(args: argparse.Namespace) -> None:
    sizes = (2, 4, 8)
    rows = []
    inner = 500
    for n in sizes:
        h = history(n, args.events_per_domain)
        view = fold(h)[F]
        now = T0 + timedelta(days=1)
        fold_s = best(lambda h=h: fold(h), args.repeat)
        status_s = best(lambda view=view, now=now: [render(view, now) for _ in range(inner)], args.repeat) / inner
        intent_s = best(lambda view=view: [intent(view) for _ in range(inner)], args.repeat) / inner
        ri = intent(view)
        size = len(view_encoder.encode(ri))
        rows.append((n, len(h), fold_s, status_s, intent_s, size, len(ri.standbys), ri.protection))
    base = rows[0]
    print(
        "fold, status and route intent per fleet size "
        f"({args.events_per_domain} events per domain; best of {args.repeat})"
    )
    print(
        f"{'domains':>7} {'events':>7} {'fold ms':>9} {'µs/event':>9} "
        f"{'status µs':>10} {'intent µs':>10} {'intent B':>9}  standbys"
    )
    for n, events, fold_s, status_s, intent_s, size, standbys, protection in rows:
        print(
            f"{n:>7} {events:>7} {fold_s * 1e3:>9.1f} {fold_s / events * 1e6:>9.2f} {status_s * 1e6:>10.1f} "
            f"{intent_s * 1e6:>10.1f} {size:>9}  {standbys} ranked, {protection}"
        )
    print()
    print("ratios against 2 domains (linear: the events ratio for the fold, N/2 for status and the intent):")
    worst = 0.0
    for n, events, fold_s, status_s, intent_s, size, _, _ in rows[1:]:
        checks = []
        for label, value, against in (
            ("fold", fold_s / base[2], events / base[1]),
            ("status", status_s / base[3], n / base[0]),
            ("intent", intent_s / base[4], n / base[0]),
        ):
            worst = max(worst, value / against)
            checks.append(f"{label} {value:.2f}x (linear {against:.2f})")
        print(f"  {n} domains: " + "   ".join(checks) + f"   intent bytes {size / base[5]:.2f}x")
    print(
        f"goal <= linear: {'met' if worst <= 1.10 else 'NOT met'} (worst cost / linear = {worst:.2f}; "
        "10% allowed for a shared machine's noise)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events-per-domain", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=9)
    main(parser.parse_args())
