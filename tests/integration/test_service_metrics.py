"""`haru projector --metrics-port` and `haru promoter --metrics-port` as real processes: each serves
/metrics whose figures match the log it follows, and a second service on a taken port is refused
with a message naming the port and the fix."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from datetime import UTC, datetime

from prometheus_client.parser import text_string_to_metric_families

from haru.core import subjects
from haru.core.events import RouteMoved
from haru.log.apply import apply
from tests.support.control import layout
from tests.support.ports import lasting_port
from tests.support.wait import wait_until


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def start(*argv: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "haru.cli", *argv, "--log-format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HARU_NO_UVLOOP": "1", **(env or {})},
    )


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(10)


async def test_projector_and_promoter_serve_metrics_that_match_the_log(nats_server, event_log):
    await apply(event_log, layout("http://127.0.0.1:1", "http://127.0.0.1:2"), datetime.now(UTC))
    route_seq = await event_log.append(subjects.route("ops"), RouteMoved(at=datetime.now(UTC), active="a"), expect=0)
    last = await event_log.last_seq()
    p_port, q_port = lasting_port(), lasting_port()
    projector = start("projector", "--nats-url", nats_server.url, "--metrics-port", str(p_port))
    # the environment works as well as the flag
    promoter = start("promoter", "--nats-url", nats_server.url, env={"HARU_METRICS_PORT": str(q_port)})
    try:

        def projector_caught_up():
            # the handler folds (last_seq) before the flusher writes the view: wait for both
            m = scrape(p_port)
            done = m["haru_projector_last_seq"][0][1] == last and m["haru_projector_view_writes_total"][0][1] >= 1
            return m if done else None

        m = await wait_until(projector_caught_up, 30.0, interval_s=0.2, retry_on=(Exception,))
        assert m["haru_projector_events_folded_total"][0][1] == last
        assert m["haru_projector_lag_events"][0][1] == 0

        def costed():  # the accounting's gauges, computed in the background after a scrape asked
            m = scrape(p_port)
            return m if m.get("haru_cost_seconds") else None

        m = await wait_until(costed, 30.0, interval_s=0.2, retry_on=(Exception,))
        assert {s[0]["domain"] for s in m["haru_cost_seconds"] if s[0]["fleet"] == "ops"} == {"a", "b"}
        assert m["haru_cost_window_seconds"] == [({}, 86400.0)]

        def promoter_folded():
            m = scrape(q_port)
            return m if m["haru_promoter_events_folded"][0][1] >= last else None

        m = await wait_until(promoter_folded, 30.0, interval_s=0.2, retry_on=(Exception,))
        assert m["haru_promoter_route_revision"] == [({"fleet": "ops"}, route_seq)]
        assert ({"fleet": "ops"}, 0.0) in m["haru_promoter_operation_running_seconds"]

        # A second projector on the same port: refused, naming the port and the fix.
        clash = start("projector", "--nats-url", nats_server.url, "--metrics-port", str(p_port))
        _, err = clash.communicate(timeout=30)
        assert clash.returncode != 0
        assert f"cannot serve metrics on 127.0.0.1:{p_port}" in err and "--metrics-port" in err, err
    finally:
        assert stop(projector) == 0
        assert stop(promoter) == 0
