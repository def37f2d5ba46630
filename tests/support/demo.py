"""`haru up --demo` as the end-to-end tests drive it: a demo layout on free ports, the process tree it starts,
and stopping and reaping that tree.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from openai import OpenAI

from haru.agents.gpu import process_tree, read_parents
from haru.host import procfs
from tests.support import haru
from tests.support.ports import lasting_port
from tests.support.wait import wait_until_sync

REPO = Path(__file__).resolve().parents[2]


def demo_layout_with_free_ports(dst: Path, src: str = "demo-fleet.json") -> Path:
    doc = json.loads((REPO / "deploy" / "examples" / src).read_text())
    for domain in doc["domains"]:
        domain["serving_url"] = f"http://127.0.0.1:{lasting_port()}"
        for slot in domain["slots"]:
            for model in slot.get("models", []):
                # no fixed port: each runtime takes a free one as it starts, and a new one on each restart,
                # so a port another test's process grabbed meanwhile costs one restart, not the model
                model.pop("port", None)
    dst.write_text(json.dumps(doc))
    return dst


def up_argv(layout: Path, *extra: str, ready: Path | None = None, port: int | None = None) -> list[str]:
    """`haru up --demo` on a free gateway port and an ephemeral NATS port, with `layout`; `extra` before the
    common options (`--real`, `--host`, `--metrics-port` ...); `--ready-file` when `ready` is given."""
    argv = [sys.executable, "-m", "haru.cli", "up", "--demo", *extra, "--nats-port", "0"]
    argv += ["--port", str(port or lasting_port()), "--layout", str(layout)]
    if ready is not None:
        argv += ["--ready-file", str(ready), "--log-level", "info"]
    return argv


def launch_up(
    out: Path, layout: Path, env: dict[str, str], *extra: str, name: str = "up"
) -> tuple[subprocess.Popen, Path]:
    """Start `haru up --demo` (see `up_argv`) from the repository root, its output in `out/<name>.out`/`.err`;
    returns the process and the ready file it will write once it serves."""
    ready = out / f"{name}.ready.json"
    proc = subprocess.Popen(
        up_argv(layout, *extra, ready=ready),
        stdout=open(out / f"{name}.out", "wb"),
        stderr=open(out / f"{name}.err", "wb"),
        env=env,
        cwd=REPO,
    )
    return proc, ready


def wait_ready(ready: Path, timeout_s: float = 60, what: str = "haru up to be ready") -> dict:
    """The ready file's contents (gateway_url, nats_url ...) once `haru up` has written it."""
    return wait_until_sync(
        lambda: ready.exists() and json.loads(ready.read_text()),
        timeout_s,
        interval_s=0.25,
        what=what,
        retry_on=(Exception,),
    )


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


def chat(client: OpenAI, model: str) -> str:
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=16)
    return out.choices[0].message.content


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
