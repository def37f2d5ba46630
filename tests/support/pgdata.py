"""Event histories for the Postgres read-model tests and benchmark, and a fast way to store them.

`fleet_history(n, ...)` is a seeded, plausible history of `n` messages: two domains per fleet
(static and skypilot providers), models walking the residency state machine, GPUs detached and
given back (their models lost{gpu_detached}), promotions with steps that complete or fail, and
now and then a body that is not a valid event. `store(log, items)` appends raw bodies with
publish_async (a fixture's history needs no sequence checks), ~10x faster than `append`.
"""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime, timedelta

from haru.core import events as ev
from haru.core import subjects
from haru.core.sizes import GiB
from haru.core.specs import DomainSpec, GpuSpec

Item = tuple[str, bytes]

MODELS = ("qwen3.6:27b", "meta-llama/Llama-3.1-8B-Instruct", "mistral-small", "gemma-3-12b")
STEPS_PROMOTION = ("stop_training", "verify_gpu", "wake", "probe", "flip", "settle_old_active")


def domain_declared(fleet: str, name: str, provider: str, region: str, at: datetime) -> Item:
    spec = DomainSpec(
        name=name,
        provider=provider,  # type: ignore[arg-type]
        region=region,
        serving_url=f"http://{name}.internal:8100",
        gpus=[GpuSpec(index=0, memory_bytes=80 * GiB), GpuSpec(index=1, memory_bytes=80 * GiB)],
    )
    return subjects.decl(fleet), ev.encode(ev.DomainDeclared(at=at, spec=spec))


def fleet_history(
    n: int,
    *,
    seed: int = 7,
    start: datetime | None = None,
    fleets: tuple[str, ...] = ("default",),
    invalid_every: int = 997,
) -> list[Item]:
    rnd = random.Random(seed)
    t = start or datetime.now(UTC) - timedelta(days=3)
    items: list[Item] = []

    def tick() -> datetime:
        nonlocal t
        t += timedelta(milliseconds=rnd.randint(1, 400))
        return t

    domains = []
    for fleet in fleets:
        for name, provider, region in (("a", "static", "fra1"), ("b", "skypilot", "us-east-1")):
            items.append(domain_declared(fleet, name, provider, region, tick()))
            domains.append((fleet, name))
    state: dict[tuple[str, str, str], str] = {}
    gpu_present: dict[tuple[str, str, int], bool] = {}
    op_counter = 0

    while len(items) < n:
        roll = rnd.random()
        fleet, domain = rnd.choice(domains)
        if invalid_every and len(items) % invalid_every == invalid_every - 1:
            items.append((subjects.model(fleet, domain, MODELS[0]), b'{"type":"model_lost","domain":1}'))
        elif roll < 0.80:
            model = rnd.choice(MODELS)
            key = (fleet, domain, model)
            items.append(_next_residency(key, state.get(key, "unknown"), state, tick(), rnd))
        elif roll < 0.985:
            index = rnd.randint(0, 1)
            gkey = (fleet, domain, index)
            present = gpu_present.get(gkey, True)
            if present and rnd.random() < 0.15:  # the provider takes the GPU
                gpu_present[gkey] = False
                items.append(_gpu(fleet, domain, index, False, tick(), rnd))
                for model in MODELS:
                    key = (fleet, domain, model)
                    if state.get(key) in ("resident", "loading", "waking", "sleeping") and len(items) < n:
                        state[key] = "lost"
                        body = ev.ModelLost(
                            at=tick(),
                            domain=domain,
                            model=model,
                            reason="gpu_detached",
                            detail=f"GPU {index} is gone (NVML: not found)",
                        )
                        items.append((subjects.model(fleet, domain, model), ev.encode(body)))
            else:
                gpu_present[gkey] = True
                items.append(_gpu(fleet, domain, index, True, tick(), rnd))
        else:
            op_counter += 1
            items.extend(_promotion(fleet, f"op-{op_counter:05d}", domain, rnd, tick))
    return items[:n]


def _gpu(fleet: str, domain: str, index: int, present: bool, at: datetime, rnd: random.Random) -> Item:
    body = ev.GpuObserved(
        at=at,
        domain=domain,
        index=index,
        present=present,
        name="NVIDIA H100 80GB HBM3" if present else "",
        memory_total_bytes=80 * GiB if present else 0,
        memory_used_bytes=rnd.randint(0, 80) * GiB if present else 0,
        processes=[ev.GpuProcess(pid=rnd.randint(100, 60000), used_bytes=GiB)] if present else [],
    )
    return subjects.gpu(fleet, domain, index), ev.encode(body)


_NEXT = {
    "unknown": ("loading",),
    "loading": ("resident", "resident", "resident", "lost", "failed"),
    "resident": ("sleeping", "lost", "stopped", "sleeping"),
    "sleeping": ("waking",),
    "waking": ("resident", "resident", "lost"),
    "lost": ("loading",),
    "failed": ("loading",),
    "stopped": ("loading",),
}


def _next_residency(key, current: str, state: dict, at: datetime, rnd: random.Random) -> Item:
    fleet, domain, model = key
    nxt = rnd.choice(_NEXT[current])
    state[key] = nxt
    common = dict(at=at, domain=domain, model=model, by=f"agent:{fleet}/{domain}@host")
    if nxt == "loading":
        body = ev.ModelLoading(**common, endpoint="http://127.0.0.1:8001", pid=rnd.randint(100, 60000))
    elif nxt == "resident":
        body = ev.ModelResident(**common, endpoint="http://127.0.0.1:8001", warmup_ms=rnd.randint(50, 5000))
    elif nxt == "sleeping":
        body = ev.ModelSleeping(**common, level=1, freed_bytes=40 * GiB)
    elif nxt == "waking":
        body = ev.ModelWaking(**common)
    elif nxt == "lost":
        reason = rnd.choice(("evicted", "process_exited", "unhealthy", "gpu_detached"))
        body = ev.ModelLost(
            **common,
            reason=reason,
            detail=f"probe said {reason}",
            exit_code=137 if reason == "process_exited" else None,
        )
    elif nxt == "failed":
        body = ev.ModelFailed(**common, runtime_said="CUDA out of memory")
    else:
        body = ev.ModelStopped(**common, detail="agent shutdown")
    return subjects.model(fleet, domain, model), ev.encode(body)


def _promotion(fleet: str, op_id: str, target: str, rnd: random.Random, tick) -> list[Item]:
    subject = subjects.op(fleet)
    source = "a" if target == "b" else "b"
    out = [
        (
            subject,
            ev.encode(
                ev.PromotionRequested(at=tick(), op_id=op_id, target=target, source=source, reason="gpu_detached")
            ),
        )
    ]
    for step in STEPS_PROMOTION:
        out.append((subject, ev.encode(ev.StepStarted(at=tick(), op_id=op_id, step=step))))
        took = rnd.randint(5, 3000)
        if rnd.random() < 0.05 and step != "settle_old_active":
            out.append(
                (
                    subject,
                    ev.encode(
                        ev.StepFailed(
                            at=tick(),
                            op_id=op_id,
                            step=step,
                            error_code="timeout",
                            error="the agent did not answer",
                            took_ms=took,
                        )
                    ),
                )
            )
            out.append(
                (
                    subject,
                    ev.encode(ev.OperationAborted(at=tick(), op_id=op_id, step=step, error="the agent did not answer")),
                )
            )
            return out
        out.append((subject, ev.encode(ev.StepCompleted(at=tick(), op_id=op_id, step=step, took_ms=took))))
    out.append((subject, ev.encode(ev.OperationCompleted(at=tick(), op_id=op_id))))
    return out


async def store(log, items: list[Item], *, window: int = 2000, timeout: float = 60.0) -> int:
    """Append raw bodies to HARU_EVENTS as fast as JetStream takes them; returns the last sequence.

    Each message carries the two headers `EventLog.append` writes (an expected-sequence check and a
    Msg-Id), so a replay of this history costs what a replay of a real log does; the check is
    `Nats-Expected-Last-Subject-Sequence` of the subject's previous message, so it always passes.
    """
    from haru.log.eventlog import EXPECTED_LAST_SUBJECT_SEQ, MSG_ID, msg_id

    js = log.js
    first = await log.last_seq()
    last_on: dict[str, int] = {}
    seq = first
    for i in range(0, len(items), window):
        for subject, data in items[i : i + window]:
            seq += 1
            expect = last_on.get(subject, 0)
            headers = {MSG_ID: msg_id(subject, seq, data)}  # unique: repeated bodies are not duplicates
            if first == 0:  # the per-subject sequences are known only when this fills the stream
                headers[EXPECTED_LAST_SUBJECT_SEQ] = str(expect)
            last_on[subject] = seq
            await js.publish_async(subject, data, headers=headers)
        await asyncio.wait_for(js.publish_async_completed(), timeout)
    return await log.last_seq()
