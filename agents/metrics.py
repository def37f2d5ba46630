"""The agent's Prometheus metrics, read from the agent's own state when Prometheus scrapes.

Every series carries `fleet` and `domain`; the agent's hot paths (supervision, probes, serving)
count nothing for it.

    haru_agent_model_state{model, state}              1 for the model's residency state, 0 for the others
    haru_agent_model_state_seconds{model, state}      time in the current state (since its event's `at`)
    haru_agent_model_restarts_total{model}            load attempts after the first (restarts)
    haru_agent_model_probe_seconds{model}             the last probe's duration (absent: never probed)
    haru_agent_model_vram_bytes{model, gpu}           declared VRAM of the model
    haru_agent_gpu_present{gpu}                       1 present, 0 detached (absent: no NVML verdict)
    haru_agent_gpu_memory_total_bytes{gpu}            observed
    haru_agent_gpu_memory_used_bytes{gpu}             observed (every process on the card)
    haru_agent_gpu_memory_held_bytes{gpu}             what this agent's children hold by declaration:
                                                      loading/resident/waking models' VRAM, sleeping
                                                      models' residual, running training budgets
    haru_agent_gpu_memory_foreign_bytes{gpu}          used by processes Haru did not start (only when the
                                                      GPU observation accounts per process: `accounted`)
    haru_agent_training_running{slot}                 1 while the slot's process runs
    haru_agent_training_run_seconds{slot}             how long the running (or last) process ran
    haru_agent_role{role}                             1 for active or standby
    haru_agent_route_revision                         the route revision the agent follows
    haru_agent_loop_errors_total{loop}                steps of a long-running loop (heartbeat, gpus, supervise,
                                                      route, declarations) that raised: logged with the
                                                      traceback, and the loop went on
    haru_agent_backlog_events                         appends waiting for the log (agents/appender.py)
    haru_agent_backlog_buffered_total                 appends that went through the backlog
    haru_agent_backlog_coalesced_total                waiting appends dropped by coalescing (a full backlog)
    haru_agent_nats_moves_total                       moves to another NATS server for want of a majority
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from haru.agents.loops import LoopErrors
from haru.core.planner import standby_residual
from haru.core.residency import state_name
from haru.core.specs import Policy
from haru.log.receipts import RegressionCollector

if TYPE_CHECKING:
    from haru.agents.appender import Appender
    from haru.agents.status import Status

# Every residency state, so a dashboard can show 0 for the states a model is not in.
STATES = ("unknown", "loading", "resident", "sleeping", "waking", "lost", "failed", "stopped", "not_admitted")
LOOPS = ("heartbeat", "gpus", "supervise", "route", "declarations")  # the agent's loops, each counted
_HOLDING = frozenset({"loading", "resident", "waking"})


def held_bytes(models: Mapping[str, Any], trainers: Mapping[str, Any], policy: Policy, gpu_index: int) -> int:
    """What this agent's children hold on a GPU, by declaration (the planner's own figures)."""
    held = 0
    for m in models.values():
        if m.spec.gpu_index != gpu_index or m.runtime.kind == "external":
            continue
        name = state_name(m.state)
        if name in _HOLDING:
            held += m.spec.vram_bytes
        elif name == "sleeping":
            held += standby_residual(m.spec, policy)
    for t in trainers.values():
        if t.spec.gpu_index == gpu_index and t.running():
            held += t.spec.vram_bytes
    return held


def foreign_of(observed) -> int | None:
    """Bytes held on the GPU by processes Haru did not start, when the observation accounts for them
    (`accounted` and `foreign: [{pid, used_bytes}]`, issue 12's per-process accounting); else None."""
    if not getattr(observed, "accounted", False):
        return None
    return sum(p.used_bytes for p in getattr(observed, "foreign", ()) or ())


class AgentCollector:
    def __init__(self, status: Status, errors: LoopErrors, appender: Appender | None = None, moves: Any = None) -> None:
        """`status`: the agent's status part (agents/status.py: its role, models, training, GPUs);
        `errors`: the agent's loop errors."""
        self.status = status
        self.errors = errors
        self.appender = appender
        self.moves = moves  # agents/majority.py's MajorityWatch (its `moves`), when the agent runs one

    def collect(self):
        status = self.status
        models, trainers, slots = status.models.models, status.training.trainers, status.live.slots
        base = [status.fleet, status.domain]
        labels = ["fleet", "domain"]
        now = datetime.now(UTC)

        state = GaugeMetricFamily(
            "haru_agent_model_state", "1 for the model's residency state.", labels=labels + ["model", "state"]
        )
        seconds = GaugeMetricFamily(
            "haru_agent_model_state_seconds", "Time in the current residency state.", labels=labels + ["model", "state"]
        )
        restarts = CounterMetricFamily(
            "haru_agent_model_restarts", "Load attempts after the first.", labels=labels + ["model"]
        )
        probe = GaugeMetricFamily(
            "haru_agent_model_probe_seconds", "The last probe's duration.", labels=labels + ["model"]
        )
        vram = GaugeMetricFamily(
            "haru_agent_model_vram_bytes", "Declared VRAM of the model.", labels=labels + ["model", "gpu"]
        )
        for name, m in models.items():
            current = state_name(m.state)
            for s in STATES:
                state.add_metric(base + [name, s], 1 if s == current else 0)
            since = getattr(m.state, "since", None)
            seconds.add_metric(base + [name, current], max(0.0, (now - since).total_seconds()) if since else 0.0)
            restarts.add_metric(base + [name], max(0, m.attempt - 1))
            if m.last_probe is not None or m.probe_ms:
                probe.add_metric(base + [name], m.probe_ms / 1000)
            vram.add_metric(base + [name, str(m.spec.gpu_index)], m.spec.vram_bytes)
        yield from (state, seconds, restarts, probe, vram)

        present = GaugeMetricFamily("haru_agent_gpu_present", "1 present, 0 detached.", labels=labels + ["gpu"])
        total = GaugeMetricFamily("haru_agent_gpu_memory_total_bytes", "GPU memory, observed.", labels=labels + ["gpu"])
        used = GaugeMetricFamily(
            "haru_agent_gpu_memory_used_bytes", "GPU memory used by every process, observed.", labels=labels + ["gpu"]
        )
        held = GaugeMetricFamily(
            "haru_agent_gpu_memory_held_bytes",
            "What this agent's runtimes and training hold, by declaration.",
            labels=labels + ["gpu"],
        )
        foreign = GaugeMetricFamily(
            "haru_agent_gpu_memory_foreign_bytes",
            "GPU memory used by processes that are not this agent's children.",
            labels=labels + ["gpu"],
        )
        for index in slots.gpu_indexes():
            g = [str(index)]
            last = status.gpu_watch.last.get(index)  # the last observation the agent recorded: no NVML call here
            if last is not None:
                if last.present is not None:
                    present.add_metric(base + g, 1 if last.present else 0)
                total.add_metric(base + g, last.memory_total_bytes)
                used.add_metric(base + g, last.memory_used_bytes)
                foreign_bytes = foreign_of(last)
                if foreign_bytes is not None:
                    foreign.add_metric(base + g, foreign_bytes)
            held.add_metric(base + g, held_bytes(models, trainers, slots.policy, index))
        yield from (present, total, used, held, foreign)

        running = GaugeMetricFamily(
            "haru_agent_training_running", "1 while the training slot's process runs.", labels=labels + ["slot"]
        )
        ran = GaugeMetricFamily(
            "haru_agent_training_run_seconds", "How long the running (or last) process ran.", labels=labels + ["slot"]
        )
        for slot, t in trainers.items():
            is_running = t.running()
            running.add_metric(base + [slot], 1 if is_running else 0)
            ended = t.ended
            ms = t.ran_ms() if is_running else (ended.ran_ms if ended is not None else 0)
            ran.add_metric(base + [slot], ms / 1000)
        yield from (running, ran)

        role = GaugeMetricFamily("haru_agent_role", "1 for the agent's role.", labels=labels + ["role"])
        for r in ("active", "standby"):
            role.add_metric(base + [r], 1 if status.role.now == r else 0)
        revision = GaugeMetricFamily(
            "haru_agent_route_revision", "The route revision the agent follows.", labels=labels
        )
        revision.add_metric(base, status.role.revision)
        up = GaugeMetricFamily(
            "haru_agent_start_time_seconds", "When this agent process started (unix time).", labels=labels
        )
        up.add_metric(base, _STARTED)
        yield from (role, revision, up)

        errors = CounterMetricFamily(
            "haru_agent_loop_errors", "Loop steps that raised (logged; the loop went on).", labels=labels + ["loop"]
        )
        for loop in LOOPS:
            errors.add_metric(base + [loop], self.errors[loop])
        yield errors

        backlog = self.appender.backlog if self.appender is not None else None
        if backlog is not None and self.appender is not None:
            waiting = GaugeMetricFamily("haru_agent_backlog_events", "Appends waiting for the log.", labels=labels)
            waiting.add_metric(base, len(backlog))
            buffered = CounterMetricFamily(
                "haru_agent_backlog_buffered", "Appends that went through the backlog.", labels=labels
            )
            buffered.add_metric(base, self.appender.buffered_total)
            coalesced = CounterMetricFamily(
                "haru_agent_backlog_coalesced", "Waiting appends dropped by coalescing.", labels=labels
            )
            coalesced.add_metric(base, backlog.coalesced)
            yield from (waiting, buffered, coalesced)
        if self.moves is not None:
            moves = CounterMetricFamily(
                "haru_agent_nats_moves", "Moves to another NATS server for want of a majority.", labels=labels
            )
            moves.add_metric(base, self.moves.moves)
            yield moves


_STARTED = time.time()


def registry_for(agent: Any) -> CollectorRegistry:
    """The registry a metrics endpoint serves for a running agent (agents/agent.py's `Agent`)."""
    registry = CollectorRegistry()
    registry.register(
        AgentCollector(
            agent.status, agent.loop_errors, getattr(agent, "append", None), getattr(agent, "majority", None)
        )
    )
    guard = getattr(getattr(agent, "log", None), "receipt_guard", None)  # the JetStream log's only
    if guard is not None:
        registry.register(RegressionCollector(guard))  # haru_log_regressions_total
    return registry
