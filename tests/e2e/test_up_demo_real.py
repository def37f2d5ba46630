"""End to end: `haru up --demo --real`, the demo fleet on real llama-servers, as a newcomer runs it.

Two agents, each with two llama-server processes (CPU, tiny generated models), a simulated trainer
on the standby; chat through the gateway with the OpenAI SDK; left alone, the fleet stays quiet; SIGTERM
leaves no process behind. The binary comes from `python -m haru.agents.runtimes.llama_build` (`.ci/run`).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from openai import OpenAI

from tests.support import haru
from tests.support.demo import (
    alive,
    demo_layout_with_free_ports,
    descendants,
    events_left_alone,
    launch_up,
    stop_and_reap,
    wait_ready,
)
from tests.support.llama import llama_binary
from tests.support.wait import wait_until_sync

pytestmark = [pytest.mark.llama, pytest.mark.timeout(240)]


@pytest.fixture
def real_demo(tmp_path):
    llama = llama_binary()
    home = tmp_path / "home"
    layout = demo_layout_with_free_ports(tmp_path / "demo-real.json", "demo-fleet-real.json")
    env = {**os.environ, "HARU_HOME": str(home), "HARU_NO_UVLOOP": "1", "HARU_LLAMA_SERVER": str(llama)}
    env.pop("HARU_NATS_URL", None)
    env.pop("HARU_API_TOKEN", None)
    proc, ready = launch_up(tmp_path, layout, env, "--real")
    tree: set[int] = set()
    try:
        info = wait_ready(ready, 60, "haru up --demo --real to be ready")
        yield {**info, "home": home, "env": env, "proc": proc, "tree": tree}
    finally:
        stop_and_reap(proc, tree, wait_s=60)


def exe(pid: int) -> str:
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return ""


def test_the_real_demo_chats_stays_quiet_and_stops_cleanly(real_demo):
    env, nats_url = real_demo["env"], real_demo["nats_url"]
    client = OpenAI(base_url=real_demo["gateway_url"] + "/v1", api_key="unused", max_retries=0, timeout=30)

    def chat(model: str, **kw):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0, **kw
        )

    first = wait_until_sync(
        lambda: chat("tiny-chat"), 90, interval_s=0.25, what="chat through the gateway", retry_on=(Exception,)
    )
    assert first.model == "tiny-chat" and first.choices[0].finish_reason in ("length", "stop")
    assert chat("tiny:story").choices[0].message.content is not None
    chunks = list(chat("tiny-chat", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == first.choices[0].message.content

    # The standby keeps its llama-servers resident (no sleep mode) and trains beside them.
    def settled():
        view = json.loads(haru("status", "--json", nats_url=nats_url, env=env).stdout)
        b = view["domains"]["b"]
        return (
            view["active"] == "a"
            and view.get("operation") is None
            and all(m["residency"]["state"] == "resident" for m in b["models"].values())
            and any(t["running"] for t in b["training"].values())
        )

    wait_until_sync(settled, 90, interval_s=0.25, what="b a resident standby, training", retry_on=(Exception,))
    tree = descendants(real_demo["proc"].pid)
    real_demo["tree"] |= tree
    servers = [pid for pid in tree if exe(pid) == "llama-server"]
    assert len(servers) == 4, [(pid, exe(pid)) for pid in tree]  # two models on each of two domains

    time.sleep(2)
    appended = events_left_alone(env, nats_url)
    print("appended while left alone:", appended)
    assert len(appended) <= 4, appended  # issue 12: ~20,000 events in 30 s before the promoter settled

    proc = real_demo["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    time.sleep(0.5)
    left = [pid for pid in tree if alive(pid)]
    assert left == [], f"left behind: {[(pid, exe(pid)) for pid in left]}"
