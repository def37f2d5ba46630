"""A simulated two-domain fleet for the failover end-to-end tests: its policy, its agents and the views that
say it is steady or serving.
"""

from __future__ import annotations

import contextlib

from haru.core import subjects
from haru.core.layout import load_layout
from haru.core.residency import Resident, Sleeping
from haru.log.apply import apply
from tests.support import haru
from tests.support.agent_harness import AgentProcess, agent_env, kill_agents, write_config, write_layout
from tests.support.clock import now

FLEET = "f"
POLICY = {
    # No test here silences an agent; a 2.5 s bound was crossed by a loaded 2-core machine's scheduling
    # alone (a 2.7 s gap), turning a GPU-detach failover into a heartbeat one.
    "heartbeat_timeout_ms": 6000,
    "degraded_grace_ms": 300,
    "restart_backoff_ms": 1500,
    "restart_backoff_max_ms": 3000,
    "command_timeout_ms": 10000,
    "training_grace_ms": 500,
}


def asleep_and_training(view, domain: str) -> bool:
    dv = view.domains[domain]
    return all(isinstance(m.residency, Sleeping) for m in dv.models.values()) and all(
        t.running for t in dv.training.values()
    )


def serving(view, domain: str) -> bool:
    return view.active == domain and all(
        isinstance(m.residency, Resident) for m in view.domains[domain].models.values()
    )


def steady(view, active: str) -> bool:
    standby = "b" if active == "a" else "a"
    return (
        view.operation is None
        and serving(view, active)
        and asleep_and_training(view, standby)
        and view.domains[standby].eligible
    )


@contextlib.asynccontextmanager
async def sim_agents(tmp_path, nats_server, event_log):
    """Two sim domains, declared, each with its agent (a real subprocess)."""
    layout_path = write_layout(
        tmp_path / "layout.json",
        tmp_path,
        models={"m1": {}, "m2": {"vram": "2GiB"}},
        training={"vram": "8GiB"},
        policy=POLICY,
        fleet=FLEET,
    )
    await apply(event_log, load_layout(layout_path), now())
    procs = []
    try:
        for d in ("a", "b"):
            cfg = write_config(
                tmp_path / f"agent-{d}.json", nats_server.url, tmp_path, domain=d, layout=layout_path, fleet=FLEET
            )
            procs.append(AgentProcess(cfg, tmp_path / f"agent-{d}.log", agent_env()))
        yield procs
    finally:
        kill_agents(procs)


def sim(tmp_path, *args: str) -> None:
    haru("sim", *args, "--sim-root", str(tmp_path / "sim"), check=True)


async def endpoint_of_b(log):
    for rec in reversed(await log.history(subjects.model(FLEET, "b", "m1"))):
        if getattr(rec.event, "endpoint", ""):
            return rec.event.endpoint
    raise AssertionError("no endpoint recorded for b/m1")
