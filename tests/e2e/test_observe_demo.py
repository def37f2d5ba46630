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
import re
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import haru
from tests.support.chromium import CHROMIUM, CHROMIUM_ARGS, need_chromium
from tests.support.demo import REPO, demo_layout_with_free_ports, launch_up, stop_and_reap, wait_ready
from tests.support.wait import wait_until_sync

TOKEN = "console-test-token"
FLEET = "default"
# Where screenshots go (CI keeps this directory as the tests' artifacts; default: the test's tmp dir).
ARTIFACTS = os.environ.get("HARU_TEST_ARTIFACTS", "")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("observe")
    home = tmp / "home"
    layout = demo_layout_with_free_ports(tmp / "demo.json")
    env = {
        **os.environ,
        "HARU_HOME": str(home),
        "HARU_NO_UVLOOP": "1",
        "HARU_API_TOKEN": TOKEN,
        "HARU_PROMOTER_STEP_DELAY_MS": "300",  # steps that last a moment, so a browser can watch them advance
    }
    env.pop("HARU_NATS_URL", None)
    env.pop("HARU_METRICS_PORT", None)
    proc, ready = launch_up(tmp, layout, env, "--host", "127.0.0.1", "--metrics-port", "0")
    tree: set[int] = set()
    try:
        info = wait_ready(ready, 90)
        info.update(home=home, env=env, proc=proc, tmp=tmp)
        # Routed onto a, with b asleep and training: the starting point every test expects.
        wait_until_sync(
            lambda: _settled(info),
            90,
            interval_s=0.5,
            what="the first route and a settled standby",
            retry_on=(Exception,),
        )
        yield info
    finally:
        stop_and_reap(proc, tree, wait_s=60)


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
    return wait_until_sync(
        lambda: (lambda v: v if v["active"] == "b" and not v.get("operation") else None)(_status(demo)),
        90,
        interval_s=0.5,
        what="the failover onto b to finish",
        retry_on=(Exception,),
    )


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
            ops[ev["op_id"]] = {
                "kind": kind.split("_")[0],
                "reason": ev["reason"],
                "requested": ev["at"],
                "outcome": None,
                "seconds": None,
                "seq": rec["seq"],
            }
        elif kind in ("operation_completed", "operation_aborted") and ev["op_id"] in ops:
            op = ops[ev["op_id"]]
            op["outcome"] = "completed" if kind == "operation_completed" else "aborted"
            op["seconds"] = (datetime.fromisoformat(ev["at"]) - datetime.fromisoformat(op["requested"])).total_seconds()
            op["finished_seq"] = rec["seq"]
    return ops


def _failovers_in_log(demo) -> int:
    return sum(
        1
        for op in operations_from_log(demo).values()
        if op["kind"] == "promotion" and op["outcome"] == "completed" and op["reason"] not in ("manual", "initial")
    )


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


# ------------------------------------------------------------------------------------------ console


def http_status(url: str, token: str | None = None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


# Records every (step, state) the page shows, and every route text, as the DOM changes.
WATCH_JS = """
() => {
  window.__seen = [];
  window.__routes = [];
  window.__notReloaded = true;
  const note = () => {
    for (const el of document.querySelectorAll('[data-testid^="step-"]')) {
      const key = el.dataset.testid.slice(5) + ':' + el.dataset.state;
      if (window.__seen[window.__seen.length - 1] !== key && !window.__seen.includes(key)) window.__seen.push(key);
    }
    const r = document.getElementById('route').textContent;
    if (window.__routes[window.__routes.length - 1] !== r) window.__routes.push(r);
  };
  new MutationObserver(note).observe(document.body, {subtree: true, childList: true, attributes: true});
  note();
}
"""


@pytest.mark.timeout(300)
def test_console_shows_a_failover_live_and_promotes_through_the_control_api(demo):
    need_chromium()
    from playwright.sync_api import expect, sync_playwright

    gw = demo["gateway_url"]
    shots = Path(ARTIFACTS) if ARTIFACTS else demo["tmp"] / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)

    # The token is required for everything with data; the page itself holds none.
    assert http_status(gw + "/ui") == 200
    assert http_status(gw + "/ui/app.js") == 200
    assert http_status(gw + "/ui/events") == 401
    assert http_status(gw + f"/ui/api/operations?fleet={FLEET}") == 401
    assert http_status(gw + f"/ui/api/why?fleet={FLEET}&model=qwen3-0.6b") == 401
    assert http_status(gw + f"/ui/api/operations?fleet={FLEET}", TOKEN) == 200

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.set_default_timeout(60_000)
            page.goto(gw + "/ui")

            # No token: the page asks for one, refuses a wrong one, connects with the right one.
            expect(page.locator("#login")).to_be_visible()
            page.fill("#token", "wrong")
            page.click("#login-ok")
            expect(page.locator("#login-error")).to_have_text("That token was refused.")
            page.fill("#token", TOKEN)
            page.click("#login-ok")
            expect(page.locator("#conn")).to_have_attribute("data-state", "live")

            # The fleet at a glance: a active with its models resident, b standby asleep and training.
            expect(page.locator('[data-testid="domain-a"] .badge.active')).to_be_visible()
            for model in ("qwen3-0.6b", "Qwen/Qwen3-4B-Instruct", "qwen3.6:27b-sim"):
                expect(page.locator(f'[data-testid="model-a-{model}"]')).to_have_attribute("data-state", "resident")
                expect(page.locator(f'[data-testid="model-b-{model}"]')).to_have_attribute("data-state", "sleeping")
            expect(page.locator('[data-testid="training-b-lora"]')).to_contain_text("running")
            expect(page.locator('[data-testid="gpu-a-0"]')).to_contain_text("held 21.0 GiB")
            expect(page.locator("#route")).to_contain_text("→ a")
            page.screenshot(path=str(shots / "console-1280x800-before.png"))

            # The provider takes a's GPU back: the page follows without a reload.
            page.evaluate(WATCH_JS)
            assert haru("sim", "detach-gpu", "a", env=demo["env"]).returncode == 0
            expect(page.locator('[data-testid="model-a-qwen3-0.6b"]')).to_have_attribute("data-state", "lost")
            expect(page.locator('[data-testid="model-a-qwen3-0.6b"]')).to_contain_text("gpu_detached")
            expect(page.locator('[data-testid="gpu-a-0"]')).to_contain_text("detached")
            expect(page.locator('[data-testid="op-current"]')).to_contain_text("promotion of b")
            expect(page.locator("#route")).to_contain_text("→ b", timeout=90_000)
            expect(page.locator('[data-testid="op-current"] .badge')).to_have_text("completed", timeout=90_000)
            expect(page.locator('[data-testid="domain-b"] .badge.active')).to_be_visible()
            for model in ("qwen3-0.6b", "Qwen/Qwen3-4B-Instruct", "qwen3.6:27b-sim"):
                expect(page.locator(f'[data-testid="model-b-{model}"]')).to_have_attribute("data-state", "resident")
            seen = page.evaluate("window.__seen")
            routes = page.evaluate("window.__routes")
            assert page.evaluate("window.__notReloaded") is True
            # the six steps advanced one by one: each seen running, then completed, in the flow's order
            flow = ["stop_training", "verify_gpu", "wake", "probe", "flip", "settle_old_active"]
            for step in flow[:-1]:
                assert f"{step}:completed" in seen, seen
            # settling the old active is best effort: its GPU is gone, so it is skipped, with why (not failed)
            assert "settle_old_active:skipped" in seen, seen
            assert "settle_old_active:failed" not in seen, seen
            started = [k.split(":")[0] for k in seen if k.endswith(":started")]
            assert len(started) >= 4 and started == [s for s in flow if s in started], seen
            assert any("→ a" in r for r in routes) and "→ b" in routes[-1], routes
            page.screenshot(path=str(shots / "console-1280x800-after-failover.png"))

            # Past operations list the failover with its steps and durations.
            past = page.locator('[data-testid="op-past"] details.op').first
            expect(past).to_contain_text("promotion of b")
            expect(past).to_contain_text("gpu_detached")
            past.locator("summary").click()
            expect(past.locator("tbody tr")).to_have_count(6)

            # A model's history, newest first, with sequences; and verify's verdict.
            page.locator('[data-testid="model-a-qwen3-0.6b"] td.model button').click()
            items = page.locator('[data-testid="timeline"] li[data-seq]')
            expect(items.first).to_be_visible()
            seqs = [int(s) for s in items.evaluate_all("els => els.map(e => e.dataset.seq)")]
            types = items.evaluate_all("els => els.map(e => e.dataset.type)")
            assert seqs == sorted(seqs, reverse=True) and len(seqs) >= 5, seqs
            assert "model_lost" in types and "route_moved" in types and "model_resident" in types, types
            page.click("#verify-btn")
            expect(page.locator('[data-testid="verify"]')).to_contain_text("history intact")
            page.screenshot(path=str(shots / "console-1280x800-timeline.png"))
            page.click("#tl-close")

            # Promote a through the control API, with a confirmation: 202, the operation starts.
            page.click('[data-testid="promote-a"]')
            expect(page.locator("#confirm")).to_be_visible()
            page.click('[data-testid="confirm-ok"]')
            expect(page.locator('[data-testid="toast-code"]')).to_have_text("202")
            expect(page.locator('[data-testid="toast"]')).to_contain_text("accepted")
            expect(page.locator('[data-testid="op-current"]')).to_contain_text("promotion of a")
            # a's GPU is still gone: the operation aborts and routing stays on b
            expect(page.locator('[data-testid="op-current"]')).to_contain_text("aborted", timeout=90_000)
            expect(page.locator("#route")).to_contain_text("→ b")
            page.screenshot(path=str(shots / "console-1280x800-promote.png"))

            # A phone-sized screen gets the same page in one column.
            phone = browser.new_page(viewport={"width": 390, "height": 844})
            phone.goto(gw + f"/ui#token={TOKEN}")
            expect(phone.locator("#conn")).to_have_attribute("data-state", "live", timeout=60_000)
            expect(phone.locator('[data-testid="domain-b"] .badge.active')).to_be_visible(timeout=60_000)
            width = phone.evaluate("document.documentElement.scrollWidth")
            assert width <= 390, f"the page is {width}px wide on a 390px screen"
            phone.screenshot(path=str(shots / "console-390x844.png"), full_page=True)
            assert errors == [], errors
        finally:
            browser.close()


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
            want = sum(
                1 for o in ops if (o["kind"], o["reason"], o["outcome"]) == (op["kind"], op["reason"], op["outcome"])
            )
            got = value(
                up,
                "haru_promoter_operations_total",
                fleet=FLEET,
                kind=op["kind"],
                reason=op["reason"],
                outcome=op["outcome"],
            )
            if got != want:
                return None
        return ops, up

    ops, up = wait_until_sync(
        promoter_agrees, 30, interval_s=0.5, what="the promoter's metrics to match the log", retry_on=(Exception,)
    )
    failovers = [
        o
        for o in ops
        if o["kind"] == "promotion" and o["outcome"] == "completed" and o["reason"] not in ("manual", "initial")
    ]
    assert len(failovers) >= 1
    assert value(up, "haru_promoter_failovers_total", fleet=FLEET, reason="gpu_detached") == sum(
        1 for o in failovers if o["reason"] == "gpu_detached"
    )
    assert sum(v for _, v in up["haru_promoter_failovers_total"]) == len(failovers)
    last = max(ops, key=lambda o: o["finished_seq"])
    got = value(
        up, "haru_promoter_last_operation_duration_seconds", fleet=FLEET, kind=last["kind"], outcome=last["outcome"]
    )
    assert abs(got - last["seconds"]) < 1e-3, (got, last)
    assert value(up, "haru_promoter_failover_duration_seconds_count", fleet=FLEET, reason="gpu_detached") == sum(
        1 for o in failovers if o["reason"] == "gpu_detached"
    )
    assert (
        abs(
            value(up, "haru_promoter_failover_duration_seconds_sum", fleet=FLEET, reason="gpu_detached")
            - sum(o["seconds"] for o in failovers if o["reason"] == "gpu_detached")
        )
        < 1e-3
    )
    # six steps of every completed promotion, each timed
    completed_promotions = sum(1 for o in ops if o["kind"] == "promotion" and o["outcome"] == "completed")
    assert (
        value(up, "haru_promoter_step_duration_seconds_count", fleet=FLEET, step="flip", outcome="completed")
        == completed_promotions
    )
    view = _status(demo)
    assert value(up, "haru_promoter_route_revision", fleet=FLEET) == view["route_revision"]
    assert value(up, "haru_promoter_operation_running_seconds", fleet=FLEET) == 0  # nothing in flight
    assert value(up, "haru_promoter_active_health", fleet=FLEET, domain="b", health="ok") == 1

    # The projector folded the whole log and is not behind it.
    def projector_caught_up():
        up = scrape(urls["up"])
        last_seq = json.loads(
            haru("history", "--limit", "1", "--json", nats_url=demo["nats_url"], env=demo["env"]).stdout
        )[-1]["seq"]
        if value(up, "haru_projector_last_seq") != last_seq:
            return None
        return up, last_seq

    up, last_seq = wait_until_sync(
        projector_caught_up, 30, interval_s=0.5, what="the projector to be caught up", retry_on=(Exception,)
    )
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
            assert value(a, "haru_agent_model_state", fleet=FLEET, domain="a", model=name, state=state) == 1, (
                name,
                state,
            )
        for name, mv in view["domains"]["b"]["models"].items():
            state = mv["residency"]["state"]
            assert state == "resident"
            assert value(b, "haru_agent_model_state", fleet=FLEET, domain="b", model=name, state="resident") == 1
            assert (
                value(b, "haru_agent_model_state_seconds", fleet=FLEET, domain="b", model=name, state="resident") >= 0
            )
            assert (
                value(b, "haru_agent_model_vram_bytes", fleet=FLEET, domain="b", model=name, gpu=str(mv["gpu_index"]))
                == mv["vram_bytes"]
            )
        held = sum(mv["vram_bytes"] for mv in view["domains"]["b"]["models"].values() if mv["gpu_index"] == 0)
        assert value(b, "haru_agent_gpu_memory_held_bytes", fleet=FLEET, domain="b", gpu="0") == held
        assert (
            value(b, "haru_agent_gpu_memory_used_bytes", fleet=FLEET, domain="b", gpu="0")
            == view["domains"]["b"]["gpus"][0]["memory_used_bytes"]
        )
        for slot, tv in view["domains"]["b"]["training"].items():
            assert value(b, "haru_agent_training_running", fleet=FLEET, domain="b", slot=slot) == (
                1 if tv["running"] else 0
            )
        assert value(b, "haru_agent_route_revision", fleet=FLEET, domain="b") == view["route_revision"]
        return True

    wait_until_sync(
        agents_agree, 30, interval_s=0.5, what="the agents' metrics to match the fleet view", retry_on=(Exception,)
    )


# ------------------------------------------------------------------------------- dashboards, alerts

DEPLOY = REPO / "deploy"
METRIC = re.compile(r"\bharu_[a-z0-9_]+")
SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def exposed_names(demo) -> set[str]:
    """Every family and sample name the demo's processes expose (gateway, haru up, both agents)."""
    names: set[str] = set()
    pages = [(url, None) for url in demo["metrics"].values()] + [(demo["gateway_url"] + "/metrics", TOKEN)]
    for url, token in pages:
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        with urllib.request.urlopen(req, timeout=10) as resp:
            for family in text_string_to_metric_families(resp.read().decode()):
                names.add(family.name)
                names.update(s.name for s in family.samples)
    return names


def known(name: str, names: set[str]) -> bool:
    if name in names:
        return True
    return any(name.endswith(sfx) and name[: -len(sfx)] in names for sfx in SUFFIXES)


def dashboard_exprs(dash: dict) -> list[str]:
    exprs = []
    for panel in dash["panels"]:
        exprs += [t["expr"] for t in panel.get("targets", [])]
    exprs += [a["expr"] for a in dash["annotations"]["list"] if "expr" in a]
    for var in dash["templating"]["list"]:
        q = var.get("query")
        exprs.append(q["query"] if isinstance(q, dict) else str(q or ""))
    return exprs


def test_grafana_dashboard_and_alert_rules_reference_only_metrics_that_exist(demo):
    dash = json.loads((DEPLOY / "grafana" / "haru-fleet.json").read_text())
    # What Grafana needs to import it: a title and uid, an integer schema version, panels with unique
    # ids, a type, a grid position inside 24 columns, and queries on the chosen Prometheus data source.
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        g = p["gridPos"]
        assert p["type"] and g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["targets"], p["title"]
            for t in p["targets"]:
                assert t["expr"].strip() and t["refId"] and t["datasource"]["uid"] == "${datasource}", p["title"]
    assert {v["name"] for v in dash["templating"]["list"]} >= {"datasource", "fleet"}

    rules = (DEPLOY / "prometheus" / "haru-alerts.yml").read_text()
    used_by_dashboard = {m for e in dashboard_exprs(dash) for m in METRIC.findall(e)}
    used_by_rules = set(METRIC.findall(rules))
    assert len(used_by_dashboard) >= 25 and len(used_by_rules) >= 8

    detach_active_and_wait(demo)  # so that failover counters have children
    names = exposed_names(demo)
    missing = sorted(m for m in used_by_dashboard | used_by_rules if not known(m, names))
    assert missing == [], f"referenced but not exposed by any Haru process: {missing}"
