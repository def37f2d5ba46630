"""`haru up --demo` supervises its children: each one killed is restarted and the log says why; a
crash loop is backed off and said; a failover reaches clients while the projector is stopped.

Real processes: haru up, nats-server, projector, promoter, two agents with simulated runtimes.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from openai import OpenAI

from haru.host.children import alive, start_time
from tests.support import haru
from tests.support.demo import chat
from tests.support.wait import wait_until_sync

pytestmark = pytest.mark.timeout(240)


def children(home) -> dict[str, int]:
    return json.loads((home / "up.json").read_text())["children"]


def logged(tmp_err, event: str, **fields) -> list[dict]:
    out = []
    for line in tmp_err.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == event and all(rec.get(k) == v for k, v in fields.items()):
            out.append(rec)
    return out


def healthz(url: str, strict: bool = True) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + ("/healthz?strict=1" if strict else "/healthz"), timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def err_file(demo) -> object:
    return demo["home"].parent / "up.err"


def test_each_child_killed_is_restarted_and_the_log_says_why(demo):
    home, env = demo["home"], demo["env"]
    client = OpenAI(base_url=demo["gateway_url"] + "/v1", api_key="unused", max_retries=0, timeout=20)
    wait_until_sync(
        lambda: chat(client, "qwen3-0.6b"), 90, interval_s=0.25, what="chat through the gateway", retry_on=(Exception,)
    )
    for name in ("agent b", "projector", "promoter", "nats-server"):
        pid = children(home)[name]
        demo["tree"].add(pid)
        os.kill(pid, signal.SIGKILL)
        new = wait_until_sync(
            lambda name=name, pid=pid: (p := children(home)[name]) != pid and alive(p, start_time(p)) and p,
            60,
            interval_s=0.25,
            what=f"{name} restarted",
            retry_on=(Exception,),
        )
        demo["tree"].add(new)
        died = wait_until_sync(
            lambda name=name: logged(err_file(demo), "up.child_died", child=name),
            10,
            interval_s=0.25,
            what=f"the log to say why {name} died",
            retry_on=(Exception,),
        )
        assert died[-1]["why"] == "killed by SIGKILL", died
        assert logged(err_file(demo), "up.child_restarted", child=name, pid=new)
    # the whole demo works again: chat, a clean bill of health, and an intact history
    wait_until_sync(
        lambda: chat(client, "qwen3-0.6b"), 90, interval_s=0.25, what="chat after the restarts", retry_on=(Exception,)
    )
    status, body = wait_until_sync(
        lambda: (r := healthz(demo["gateway_url"]))[0] == 200 and r,
        60,
        interval_s=0.25,
        what="healthz ok",
        retry_on=(Exception,),
    )
    assert body["status"] == "ok" and body["down"] == [], body
    verify = haru("verify", nats_url=demo["nats_url"], env=env)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_crash_loop_is_backed_off_and_said_then_recovers(demo):
    home = demo["home"]
    conf = home / "demo" / "agents" / "b.json"
    good = conf.read_text()
    conf.write_text("{ this is not json")
    pid = children(home)["agent b"]
    demo["tree"].add(pid)
    os.kill(pid, signal.SIGKILL)
    loop = wait_until_sync(
        lambda: logged(err_file(demo), "up.crash_loop", child="agent b"),
        90,
        interval_s=0.25,
        what="the crash loop to be said",
        retry_on=(Exception,),
    )
    assert loop[0]["failures_in_a_row"] >= 3 and "keeps dying" in loop[0]["message"], loop
    delays = [
        r["restart_in_s"]
        for r in logged(err_file(demo), "up.child_died", child="agent b")
        + logged(err_file(demo), "up.crash_loop", child="agent b")
    ]
    assert delays == sorted(delays) and delays[-1] > delays[0], delays  # it backs off
    conf.write_text(good)

    def settled():
        p = children(home)["agent b"]
        demo["tree"].add(p)
        if not alive(p, start_time(p)):
            return None
        time.sleep(2.0)  # and stays up
        return alive(p, start_time(p)) and p

    wait_until_sync(settled, 90, interval_s=0.25, what="agent b back for good", retry_on=(Exception,))


def test_a_failover_reaches_clients_with_the_projector_stopped(demo):
    home, env, gw = demo["home"], demo["env"], demo["gateway_url"]
    client = OpenAI(base_url=gw + "/v1", api_key="unused", max_retries=0, timeout=20)
    first = wait_until_sync(
        lambda: chat(client, "qwen3-0.6b"), 90, interval_s=0.25, what="chat through the gateway", retry_on=(Exception,)
    )
    assert first.startswith("[domain a]"), first
    projector = children(home)["projector"]
    os.kill(projector, signal.SIGSTOP)  # hung, not dead: the supervisor sees nothing, the heartbeat stops
    try:
        status, body = wait_until_sync(
            lambda: (r := healthz(gw))[1]["down"] == ["projector"] and r,
            30,
            interval_s=0.25,
            what="healthz to name the projector",
            retry_on=(Exception,),
        )
        assert status == 503 and body["status"] == "degraded", body
        promote = haru("promote", "b", "--wait", "--timeout", "90", nats_url=demo["nats_url"], env=env, timeout=120)
        assert promote.returncode == 0, promote.stdout + promote.stderr
        answer = wait_until_sync(
            lambda: (lambda a: a if a.startswith("[domain b]") else None)(chat(client, "qwen3-0.6b")),
            30,
            interval_s=0.2,
            what="chat answered by b",
            retry_on=(Exception,),
        )
        assert answer.startswith("[domain b]")
    finally:
        os.kill(projector, signal.SIGCONT)
    wait_until_sync(lambda: healthz(gw)[0] == 200, 30, interval_s=0.25, what="healthz ok again", retry_on=(Exception,))
