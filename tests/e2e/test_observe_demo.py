"""Seeing the fleet, end to end: every process's /metrics after a failover, the shipped Grafana
dashboard against a real scrape, and the web console in a real headless Chromium.

One `haru up --demo` (with HARU_API_TOKEN set, bound to loopback) is shared by the module's tests:
it is the heaviest thing a test can start on two cores. The tests run in file order (the console
test drives the failover and clicks promote); each one also stands alone: it makes the failover
happen itself when it has not happened yet.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from haru.natsd import free_port
from tests.e2e.test_up_demo import REPO, alive, demo_layout_with_free_ports, descendants, wait_for
from tests.support import haru

TOKEN = "console-test-token"
FLEET = "default"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("observe")
    home = tmp / "home"
    ready = tmp / "ready.json"
    layout = demo_layout_with_free_ports(tmp / "demo.json")
    env = {**os.environ, "HARU_HOME": str(home), "HARU_NO_UVLOOP": "1", "HARU_API_TOKEN": TOKEN}
    env.pop("HARU_NATS_URL", None)
    env.pop("HARU_METRICS_PORT", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "haru.cli", "up", "--demo", "--nats-port", "0", "--host", "127.0.0.1",
         "--port", str(free_port()), "--metrics-port", "0", "--layout", str(layout), "--ready-file", str(ready),
         "--log-level", "info"],
        stdout=open(tmp / "up.out", "wb"), stderr=open(tmp / "up.err", "wb"), env=env, cwd=REPO,
    )
    tree: set[int] = set()
    try:
        info = wait_for("haru up to be ready", lambda: ready.exists() and json.loads(ready.read_text()), 90)
        info.update(home=home, env=env, proc=proc, tmp=tmp)
        # Routed onto a, with b asleep and training: the starting point every test expects.
        wait_for("the first route and a settled standby", lambda: _settled(info), 90, 0.5)
        yield info
    finally:
        tree |= descendants(proc.pid)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        for pid in tree:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _status(demo) -> dict:
    out = haru("status", "--json", nats_url=demo["nats_url"], env=demo["env"])
    return json.loads(out.stdout)


def _settled(demo) -> bool:
    view = _status(demo)
    if view.get("active") not in ("a", "b") or view.get("operation"):
        return False
    standby = "b" if view["active"] == "a" else "a"
    return all(m["residency"]["state"] == "sleeping" for m in view["domains"][standby]["models"].values())


def detach_active_and_wait(demo) -> dict:
    """Take the active domain's GPU (unless a failover already happened) and wait for the new route."""
    view = _status(demo)
    if view["active"] == "a" and view["route_revision"] and not _failovers_in_log(demo):
        assert haru("sim", "detach-gpu", "a", env=demo["env"]).returncode == 0
    return wait_for("the failover onto b to finish",
                    lambda: (lambda v: v if v["active"] == "b" and not v.get("operation") else None)(_status(demo)),
                    90, 0.5)


def op_history(demo) -> list[dict]:
    out = haru("history", f"haru.evt.{FLEET}.op", "--json", nats_url=demo["nats_url"], env=demo["env"])
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def operations_from_log(demo) -> dict[str, dict]:
    """op_id -> {kind, reason, outcome, seconds} folded from the op subject's events."""
    ops: dict[str, dict] = {}
    for rec in op_history(demo):
        ev, kind = rec["event"], rec["type"]
        if kind in ("promotion_requested", "demotion_requested"):
            ops[ev["op_id"]] = {"kind": kind.split("_")[0], "reason": ev["reason"], "requested": ev["at"],
                                "outcome": None, "seconds": None, "seq": rec["seq"]}
        elif kind in ("operation_completed", "operation_aborted") and ev["op_id"] in ops:
            op = ops[ev["op_id"]]
            op["outcome"] = "completed" if kind == "operation_completed" else "aborted"
            op["seconds"] = (datetime.fromisoformat(ev["at"]) - datetime.fromisoformat(op["requested"])).total_seconds()
            op["finished_seq"] = rec["seq"]
    return ops


def _failovers_in_log(demo) -> int:
    return sum(1 for op in operations_from_log(demo).values()
               if op["kind"] == "promotion" and op["outcome"] == "completed" and op["reason"] not in ("manual", "initial"))


def scrape(url: str, token: str | None = None) -> dict[str, list]:
    """name -> [(labels, value)] for every sample of a /metrics page, parsed by prometheus-client."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def value(samples: dict[str, list], name: str, **labels) -> float:
    found = [v for lab, v in samples.get(name, []) if all(lab.get(k) == w for k, w in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {found} in {samples.get(name)}"
    return found[0]


# ------------------------------------------------------------------------------------------ metrics


@pytest.mark.timeout(300)
def test_every_process_metrics_agree_with_the_event_log_after_a_failover(demo):
    detach_active_and_wait(demo)
    urls = demo["metrics"]
    assert set(urls) == {"up", "a", "b"}, urls

    # The promoter's counts are the log's: every finished operation by kind/reason/outcome, the
    # failovers, and the last operation's duration from its request to its outcome (event times).
    def promoter_agrees():
        ops = [op for op in operations_from_log(demo).values() if op["outcome"]]
        up = scrape(urls["up"])
        for op in ops:
            want = sum(1 for o in ops if (o["kind"], o["reason"], o["outcome"]) == (op["kind"], op["reason"], op["outcome"]))
            got = value(up, "haru_promoter_operations_total", fleet=FLEET, kind=op["kind"], reason=op["reason"],
                        outcome=op["outcome"])
            if got != want:
                return None
        return ops, up

    ops, up = wait_for("the promoter's metrics to match the log", promoter_agrees, 30, 0.5)
    failovers = [o for o in ops if o["kind"] == "promotion" and o["outcome"] == "completed"
                 and o["reason"] not in ("manual", "initial")]
    assert len(failovers) >= 1
    assert value(up, "haru_promoter_failovers_total", fleet=FLEET, reason="gpu_detached") == \
        sum(1 for o in failovers if o["reason"] == "gpu_detached")
    assert sum(v for _, v in up["haru_promoter_failovers_total"]) == len(failovers)
    last = max(ops, key=lambda o: o["finished_seq"])
    got = value(up, "haru_promoter_last_operation_duration_seconds", fleet=FLEET, kind=last["kind"],
                outcome=last["outcome"])
    assert abs(got - last["seconds"]) < 1e-3, (got, last)
    assert value(up, "haru_promoter_failover_duration_seconds_count", fleet=FLEET, reason="gpu_detached") == \
        sum(1 for o in failovers if o["reason"] == "gpu_detached")
    assert abs(value(up, "haru_promoter_failover_duration_seconds_sum", fleet=FLEET, reason="gpu_detached")
               - sum(o["seconds"] for o in failovers if o["reason"] == "gpu_detached")) < 1e-3
    # six steps of every completed promotion, each timed
    completed_promotions = sum(1 for o in ops if o["kind"] == "promotion" and o["outcome"] == "completed")
    assert value(up, "haru_promoter_step_duration_seconds_count", fleet=FLEET, step="flip",
                 outcome="completed") == completed_promotions
    view = _status(demo)
    assert value(up, "haru_promoter_route_revision", fleet=FLEET) == view["route_revision"]
    assert value(up, "haru_promoter_operation_running_seconds", fleet=FLEET) == 0  # nothing in flight
    assert value(up, "haru_promoter_active_health", fleet=FLEET, domain="b", health="ok") == 1

    # The projector folded the whole log and is not behind it.
    def projector_caught_up():
        up = scrape(urls["up"])
        last_seq = json.loads(haru("history", "--limit", "1", "--json", nats_url=demo["nats_url"],
                                   env=demo["env"]).stdout)[-1]["seq"]
        if value(up, "haru_projector_last_seq") != last_seq:
            return None
        return up, last_seq

    up, last_seq = wait_for("the projector to be caught up", projector_caught_up, 30, 0.5)
    assert value(up, "haru_projector_lag_events") == 0
    assert value(up, "haru_projector_lag_seconds") == 0
    assert value(up, "haru_projector_stream_last_seq") == last_seq
    assert value(up, "haru_projector_events_folded_total") == last_seq  # one fleet, every event on it
    assert value(up, "haru_projector_view_writes_total") >= 1
    assert value(up, "haru_projector_intents_published_total") >= 1 + len(failovers)

    # The agents: a's GPU is gone and its models lost for that reason; b active, resident, not training.
    # (Each agent reads its own state and the view is folded from what they wrote: they agree once
    # the projector has written the last of it, so this is checked until it holds.)
    def agents_agree():
        view = _status(demo)
        a = scrape(urls["a"])
        b = scrape(urls["b"])
        assert value(a, "haru_agent_gpu_present", fleet=FLEET, domain="a", gpu="0") == 0
        assert value(b, "haru_agent_gpu_present", fleet=FLEET, domain="b", gpu="0") == 1
        assert value(b, "haru_agent_role", fleet=FLEET, domain="b", role="active") == 1
        assert value(a, "haru_agent_role", fleet=FLEET, domain="a", role="standby") == 1
        for name, mv in view["domains"]["a"]["models"].items():
            state = mv["residency"]["state"]
            assert value(a, "haru_agent_model_state", fleet=FLEET, domain="a", model=name, state=state) == 1, (name, state)
        for name, mv in view["domains"]["b"]["models"].items():
            state = mv["residency"]["state"]
            assert state == "resident"
            assert value(b, "haru_agent_model_state", fleet=FLEET, domain="b", model=name, state="resident") == 1
            assert value(b, "haru_agent_model_state_seconds", fleet=FLEET, domain="b", model=name, state="resident") >= 0
            assert value(b, "haru_agent_model_vram_bytes", fleet=FLEET, domain="b", model=name,
                         gpu=str(mv["gpu_index"])) == mv["vram_bytes"]
        held = sum(mv["vram_bytes"] for mv in view["domains"]["b"]["models"].values() if mv["gpu_index"] == 0)
        assert value(b, "haru_agent_gpu_memory_held_bytes", fleet=FLEET, domain="b", gpu="0") == held
        assert value(b, "haru_agent_gpu_memory_used_bytes", fleet=FLEET, domain="b", gpu="0") == \
            view["domains"]["b"]["gpus"][0]["memory_used_bytes"]
        for slot, tv in view["domains"]["b"]["training"].items():
            assert value(b, "haru_agent_training_running", fleet=FLEET, domain="b", slot=slot) == (1 if tv["running"] else 0)
        assert value(b, "haru_agent_route_revision", fleet=FLEET, domain="b") == view["route_revision"]
        return True

    wait_for("the agents' metrics to match the fleet view", agents_agree, 30, 0.5)
