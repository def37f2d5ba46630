"""Every producer writes `cause`: real agents on the simulator, a real promoter, `haru apply`.

A fleet lives through a first route, a detached GPU on the active (failover), the GPU coming back
(the old active demoted to standby), a manual promotion back, a standby runtime killed (restarted),
a promotion that fails at the wake (aborted) and a shutdown of both agents. Then,
for every event production code wrote: the cause is set where one exists (`haru.core.causes.expects_cause`)
and names an event of the right kind (`haru.core.causes.EXPECTED`) that is the right one (same domain,
same operation and step, the GPU observation that showed the GPU gone, the probe the flip relied
on). `haru why --json` then draws the real tree with no missing link.
"""

from __future__ import annotations

import json
import signal
from datetime import UTC, datetime

import pytest

from haru.core import causes, subjects
from haru.core import events as ev
from haru.core.saga import STEPS
from haru.log.requests import request_operation
from tests.support import haru
from tests.support.agent_harness import sim_fault
from tests.support.failover_sim import FLEET, endpoint_of_b, serving, sim, sim_agents, steady
from tests.support.promoter import op_events, promoters, view_of, wait_view
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(240)

SEEN_AT_LEAST = {
    "admission_decided",
    "model_loading",
    "model_resident",
    "model_sleeping",
    "model_waking",
    "model_lost",
    "model_stopped",
    "training_started",
    "training_stopped",
    "domain_reachable",
    "promotion_requested",
    "demotion_requested",
    "step_started",
    "step_completed",
    "step_failed",
    "operation_completed",
    "operation_aborted",
    "eligibility_changed",
    "route_moved",
}


def _domain_of(e) -> str:
    return getattr(e, "domain", "")


def right_cause(rec, cause_rec) -> str:
    """'' when `cause_rec` is the right cause of `rec`, else why not."""
    e, c = rec.event, cause_rec.event
    tag, ctag = ev.tag_of(e), ev.tag_of(c)
    if ctag not in causes.EXPECTED[tag]:
        return f"{tag} cites a {ctag}"
    if isinstance(e, ev.ModelLost):
        if not (isinstance(c, ev.GpuObserved) and c.present is False and c.domain == e.domain):
            return "a gpu_detached loss must cite the observation of its domain's GPU gone"
    if isinstance(c, ev.StepStarted) and tag.startswith(("model_", "training_")):
        verbs = STEPS[c.step].verbs
        # (a wake that fails leaves the model asleep: that `model_sleeping` answers the wake)
        wanted = {
            "model_waking": {"wake"},
            "model_sleeping": {"sleep", "wake"},
            "model_resident": {"wake"},
            "training_started": {"start_training"},
            "training_stopped": {"stop_training"},
        }.get(tag)
        if wanted and not wanted & set(verbs):
            return f"{tag} cites step {c.step}, which sends none of {sorted(wanted)}"
    elif _domain_of(e) and _domain_of(c) and tag.startswith(("model_", "training_", "domain_")):
        if _domain_of(e) != _domain_of(c):
            return f"{tag} on {_domain_of(e)} cites an event of {_domain_of(c)}"
    if isinstance(e, (ev.StepCompleted, ev.StepFailed)):
        if not (isinstance(c, ev.StepStarted) and c.op_id == e.op_id and c.step == e.step):
            return "a step outcome must cite its own step_started"
    if isinstance(e, (ev.StepStarted, ev.OperationCompleted, ev.OperationAborted)):
        if getattr(c, "op_id", e.op_id) != e.op_id:
            return "an operation's events cite its own events"
    if isinstance(e, ev.RouteMoved):
        if not (isinstance(c, ev.StepCompleted) and c.step == "probe" and c.op_id == e.op_id):
            return "route_moved must cite its operation's probe"
    if isinstance(e, ev.PromotionRequested) and e.reason == "gpu_detached":
        if _domain_of(c) != e.source:
            return f"a gpu_detached promotion must cite the loss on {e.source}"
    if isinstance(e, ev.AdmissionDecided):
        spec = getattr(c, "spec", None)
        if c.domain != e.domain or getattr(spec, "name", getattr(spec, "slot", "")) != e.name:
            return "an admission must cite its own declaration"
    return ""


async def test_every_producer_cites_the_event_that_caused_it(tmp_path, nats_server, event_log):
    async with sim_agents(tmp_path, nats_server, event_log) as procs:
        async with promoters(nats_server.url):
            await wait_view(event_log, lambda v: steady(v, "a"), timeout=40, fleet=FLEET, what="first route, a active")
            sim(tmp_path, "detach-gpu", "a")
            await wait_view(
                event_log,
                lambda v: v.active == "b" and v.operation is None and not v.domains["a"].eligible,
                timeout=40,
                fleet=FLEET,
                what="b active, a ineligible",
            )
            sim(tmp_path, "attach-gpu", "a")
            await wait_view(event_log, lambda v: steady(v, "b"), timeout=60, fleet=FLEET, what="a standby after attach")
            result = await request_operation(event_log, FLEET, "promotion", "a", by="cli:test", now=datetime.now(UTC))
            assert result.status == "accepted", result
            await wait_view(
                event_log,
                lambda v: serving(v, "a") and v.operation is None,
                timeout=60,
                fleet=FLEET,
                what="a active again",
            )
            before = (await view_of(event_log, FLEET)).domains["b"].models["m1"].residency.seq
            sim(tmp_path, "kill-runtime", "b", "m1")
            await wait_view(
                event_log,
                lambda v: steady(v, "a") and v.domains["b"].models["m1"].residency.seq > before + 2,
                timeout=60,
                fleet=FLEET,
                what="b's m1 restarted and asleep again",
            )
            # a promotion that fails at the wake (CUDA out of memory) and is aborted
            await sim_fault(await endpoint_of_b(event_log), "oom_on_wake")
            failing = await request_operation(event_log, FLEET, "promotion", "b", by="cli:test", now=datetime.now(UTC))
            assert failing.status == "accepted", failing

            async def aborted():
                return any(isinstance(e, ev.OperationAborted) for e in await op_events(event_log, FLEET, failing.op_id))

            await wait_until(aborted, 60, what="the abort")
            await wait_view(
                event_log, lambda v: v.operation is None, timeout=60, fleet=FLEET, what="no operation in flight"
            )
        for p in procs:
            p.signal(signal.SIGINT)  # stopping for good: each unloads its runtimes (model_stopped)
        for p in procs:
            await p.wait(30)

    records = await event_log.history(subjects.fleet_events(FLEET))
    by_seq = {r.seq: r for r in records}
    seen: set[str] = set()
    wrong: list[str] = []
    for rec in records:
        e = rec.event
        assert e is not None
        tag = ev.tag_of(e)
        seen.add(tag)
        if causes.expects_cause(e) and not e.cause:
            wrong.append(f"seq {rec.seq} {tag} ({getattr(e, 'reason', '')}) has no cause")
            continue
        if e.cause:
            cited = by_seq.get(e.cause)
            if cited is None:
                wrong.append(f"seq {rec.seq} {tag} cites seq {e.cause}, not an event of the fleet")
                continue
            why = right_cause(rec, cited)
            if why:
                wrong.append(f"seq {rec.seq} {tag} -> seq {e.cause}: {why}")
    assert not wrong, "\n".join(wrong)
    assert SEEN_AT_LEAST <= seen, f"not exercised: {sorted(SEEN_AT_LEAST - seen)}"

    # Specific links the issue names.
    lost = [r for r in records if isinstance(r.event, ev.ModelLost) and r.event.reason == "gpu_detached"]
    assert lost and all(isinstance(by_seq[r.event.cause].event, ev.GpuObserved) for r in lost)
    promo = [
        r.event for r in records if isinstance(r.event, ev.PromotionRequested) and r.event.reason == "gpu_detached"
    ]
    assert promo and ev.tag_of(by_seq[promo[0].cause].event) in ("model_lost", "gpu_observed")
    manual = [r.event for r in records if isinstance(r.event, ev.PromotionRequested) and r.event.reason == "manual"]
    assert manual and manual[0].cause == 0  # the operator's request is a root
    restarts = [r.event for r in records if isinstance(r.event, ev.ModelLoading) and r.event.attempt > 1]

    def first_of_attempt(e):
        # a reload that waited for its GPU's turn is two loadings (queued, then spawned): the spawned one
        # cites the queued one, which cites the loss
        while isinstance(by_seq[e.cause].event, ev.ModelLoading) and by_seq[e.cause].event.attempt == e.attempt:
            e = by_seq[e.cause].event
        return e

    # a reload follows a loss or a failed load, a GPU that came back (its models are reloaded, not assumed),
    # or an agent's start that found its runtime gone (the attempts continue from the model's subject)
    restart_causes = [ev.tag_of(by_seq[first_of_attempt(e).cause].event) for e in restarts]
    assert "model_lost" in restart_causes, restart_causes
    assert set(restart_causes) <= {"model_lost", "model_failed", "gpu_observed", "agent_started"}, restart_causes
    aborted = [r.event for r in records if isinstance(r.event, ev.OperationAborted)]
    assert aborted and all(
        isinstance(by_seq[a.cause].event, ev.StepFailed) and by_seq[a.cause].event.op_id == a.op_id for a in aborted
    )
    stopped = [r.event for r in records if isinstance(r.event, ev.ModelStopped)]
    assert stopped and all(isinstance(by_seq[s.cause].event, ev.AgentStopping) for s in stopped)

    # `haru why --json` walks the same links: the tree has no missing link, and the failover's waking
    # of b's m1 hangs under the promotion that the loss on a caused.
    out = haru("why", "m1", "--fleet", FLEET, "--json", nats_url=nats_server.url)
    assert out.returncode == 0, out.stderr
    tree = json.loads(out.stdout)

    def nodes(ns):
        for n in ns:
            yield n
            yield from nodes(n["caused"])

    flat = list(nodes(tree))
    assert not [n for n in flat if n["missing_link"]], [n for n in flat if n["missing_link"]]
    failover = next(n for n in flat if n["type"] == "promotion_requested" and n["event"]["reason"] == "gpu_detached")
    under = {n["type"] for n in nodes(failover["caused"])}
    assert {"step_started", "model_waking", "model_resident", "route_moved"} <= under, under
