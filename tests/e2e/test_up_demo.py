"""End to end: `haru up --demo` as a user runs it, a GPU the provider takes back, and the failover.

One real process tree: haru up (embedded nats-server, projector, promoter, gateway) and two agents,
each with three simulated vLLM servers and a simulated trainer. Ports are chosen free so the test
does not collide with a demo the developer may be running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from openai import OpenAI

from haru.agents.gpu import process_tree, read_parents
from haru.host import procfs
from haru.host.natsd import free_port
from tests.support import haru

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]


def demo_layout_with_free_ports(dst: Path, src: str = "demo-fleet.json") -> Path:
    doc = json.loads((REPO / "deploy" / "examples" / src).read_text())
    for domain in doc["domains"]:
        domain["serving_url"] = f"http://127.0.0.1:{free_port()}"
        for slot in domain["slots"]:
            for model in slot.get("models", []):
                # no fixed port: each runtime takes a free one as it starts, and a new one on each restart,
                # so a port another test's process grabbed meanwhile costs one restart, not the model
                model.pop("port", None)
    dst.write_text(json.dumps(doc))
    return dst


def wait_for(what: str, check, timeout: float = 60.0, every: float = 0.25):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - keep polling; report the last failure
            last = exc
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (not `pid` itself), by the agents' own process-tree helper."""
    return set(process_tree({pid}, read_parents())) - {pid}


def alive(pid: int) -> bool:
    return not procfs.gone(pid)  # a zombie is not alive


def stop_and_reap(proc: subprocess.Popen, tree: set[int], wait_s: float = 60) -> list[int]:
    """SIGTERM `proc` (haru up / serve: it stops its children in order), then SIGKILL whatever of its
    process tree is still alive, even when the test failed. Returns the pids that had to be killed."""
    tree |= descendants(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    left = [pid for pid in tree if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


@pytest.fixture
def demo(tmp_path):
    home = tmp_path / "home"
    ready = tmp_path / "ready.json"
    layout = demo_layout_with_free_ports(tmp_path / "demo.json")
    env = {**os.environ, "HARU_HOME": str(home), "HARU_NO_UVLOOP": "1"}
    env.pop("HARU_NATS_URL", None)
    env.pop("HARU_API_TOKEN", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "haru.cli",
            "up",
            "--demo",
            "--nats-port",
            "0",
            "--port",
            str(free_port()),
            "--layout",
            str(layout),
            "--ready-file",
            str(ready),
            "--log-level",
            "info",
        ],
        stdout=open(tmp_path / "up.out", "wb"),
        stderr=open(tmp_path / "up.err", "wb"),
        env=env,
        cwd=REPO,
    )
    tree: set[int] = set()
    try:
        info = wait_for("haru up to be ready", lambda: ready.exists() and json.loads(ready.read_text()), 60)
        info["home"] = home
        info["env"] = env
        info["proc"] = proc
        info["tree"] = tree
        yield info
    finally:
        stop_and_reap(proc, tree, wait_s=60)


def chat(client: OpenAI, model: str) -> str:
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=16)
    return out.choices[0].message.content


def test_demo_chats_fails_over_and_stops_cleanly(demo):
    env, nats_url = demo["env"], demo["nats_url"]
    client = OpenAI(base_url=demo["gateway_url"] + "/v1", api_key="unused", max_retries=0, timeout=20)

    # Within seconds the first domain is probed and routed: chat works, from domain a.
    first = wait_for("chat through the gateway", lambda: chat(client, "qwen3-0.6b"), 60)
    assert first.startswith("[domain a]"), first
    assert chat(client, "Qwen/Qwen3-4B-Instruct").startswith("[domain a]")

    # `haru status` shows the active resident and the standby asleep and training.
    def standby_settled():
        out = haru("status", "--json", nats_url=nats_url, env=env)
        view = json.loads(out.stdout)
        b = view["domains"]["b"]
        asleep = all(m["residency"]["state"] == "sleeping" for m in b["models"].values())
        training = any(t["running"] for t in b["training"].values())
        return asleep and training and view["active"] == "a"

    wait_for("the standby asleep and training", standby_settled, 60)
    status = haru("status", nats_url=nats_url, env=env)
    assert status.returncode == 0, status.stderr
    assert "resident for" in status.stdout and "asleep" in status.stdout

    # The provider takes back domain a's GPU.
    detach = haru("sim", "detach-gpu", "a", env=env)
    assert detach.returncode == 0, detach.stderr

    answer = wait_for(
        "chat answered by the other domain",
        lambda: (lambda a: a if a.startswith("[domain b]") else None)(chat(client, "qwen3-0.6b")),
        60,
        0.5,
    )
    assert answer.startswith("[domain b]")

    # `haru why` tells the story: lost (gpu detached) on a -> promotion of b -> route moved -> resident on b.
    # (The promotion may be triggered by a sibling model's loss, so this model's own loss may be
    # recorded just before or just after the request: the order that matters is by sequence.)
    why = haru("why", "qwen3-0.6b", nats_url=nats_url, env=env)
    assert why.returncode == 0, why.stderr
    assert '"reason":"gpu_detached"' in why.stdout and "promotion_requested" in why.stdout
    tree = json.loads(haru("why", "qwen3-0.6b", "--json", nats_url=nats_url, env=env).stdout)

    def flatten(nodes):
        for n in nodes:
            yield n
            yield from flatten(n["caused"])

    story = list(flatten(tree))
    # the tree is causal: b's wake hangs under the promotion, which hangs under a's loss
    failover = next(n for n in story if n["type"] == "promotion_requested" and n["event"]["reason"] == "gpu_detached")
    assert any(n["type"] == "model_waking" and n["event"]["domain"] == "b" for n in flatten(failover["caused"])), (
        why.stdout
    )
    assert not [n for n in story if n["missing_link"]], why.stdout

    def seq_of(kind, **match):
        return [r["seq"] for r in story if r["type"] == kind and all(r["event"].get(k) == v for k, v in match.items())]

    lost = seq_of("model_lost", domain="a", reason="gpu_detached")
    promoted = seq_of("promotion_requested", target="b", reason="gpu_detached")
    moved = seq_of("route_moved", active="b")
    resident_b = seq_of("model_resident", domain="b")
    assert lost and promoted and moved and resident_b, why.stdout
    assert max(resident_b) > promoted[-1] and moved[-1] > promoted[-1], why.stdout
    assert max(resident_b) > lost[-1], why.stdout

    verify = haru("verify", nats_url=nats_url, env=env)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "history intact" in verify.stdout

    # SIGTERM leaves no process behind.
    proc = demo["proc"]
    tree = descendants(proc.pid)
    demo["tree"] |= tree
    assert len(tree) >= 2 + 6  # two agents and their six runtimes at least (plus nats-server and trainers)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    time.sleep(0.5)
    left = [pid for pid in tree if alive(pid)]
    assert left == [], f"left behind: {left}"


def view_seq(env, nats_url) -> int:
    """The last event of the demo fleet that the projector folded (every event lands in one view)."""
    out = haru("status", "--json", nats_url=nats_url, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["seq"]


def events_left_alone(env, nats_url, seconds: float = 30.0) -> list[str]:
    """What the fleet appended in `seconds` with nobody touching it: `haru history` of those events."""
    before = view_seq(env, nats_url)
    time.sleep(seconds)
    after = view_seq(env, nats_url)
    if after == before:
        return []
    out = haru("history", "--from-seq", str(before + 1), "--json", nats_url=nats_url, env=env)
    assert out.returncode == 0, out.stderr
    return [f"{r['seq']} {r['subject']} {r['type']}" for r in json.loads(out.stdout) if r["seq"] > before]


def test_the_demo_left_alone_settles(demo):
    """Once the standby is asleep and training, 30 s alone append at most 4 events (issue 12)."""
    env, nats_url = demo["env"], demo["nats_url"]

    def settled():
        view = json.loads(haru("status", "--json", nats_url=nats_url, env=env).stdout)
        b = view["domains"]["b"]
        return (
            view["active"] == "a"
            and view.get("operation") is None
            and all(m["residency"]["state"] == "sleeping" for m in b["models"].values())
            and any(t["running"] for t in b["training"].values())
        )

    wait_for("the standby asleep and training", settled, 90)
    time.sleep(2)
    appended = events_left_alone(env, nats_url)
    print("appended while left alone:", appended)
    assert len(appended) <= 4, appended
