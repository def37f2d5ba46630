"""`haru apply` against a real nats-server: only differences are appended, with expected sequences."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from haru.core import subjects
from haru.core.apply import diff, fold_declarations
from haru.core.events import tag_of
from haru.core.layout import load_layout, parse_layout
from haru.core.planner import plan
from haru.core.sizes import GiB, format_gib
from haru.log.apply import apply
from haru.log.eventlog import body_hash

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "deploy/examples/demo-fleet.json"
HEARTH = ROOT / "deploy/examples/hearth.json"
NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def demo_doc() -> dict:
    return json.loads(DEMO.read_text())


def test_diff_against_nothing_declares_everything_once():
    layout = load_layout(DEMO)
    events = diff(fold_declarations([]), layout, plan(layout), NOW)
    tags = [tag_of(e) for e in events]
    assert tags[0] == "fleet_declared"
    assert tags.count("domain_declared") == 2 and tags.count("model_declared") == 6
    assert tags.count("training_declared") == 2 and tags.count("admission_decided") == 8
    # folding what was emitted and diffing again yields nothing
    assert diff(fold_declarations(events), layout, plan(layout), NOW) == []


def test_diff_retires_what_the_layout_dropped_and_changes_admission():
    layout = load_layout(DEMO)
    before = fold_declarations(diff(fold_declarations([]), layout, plan(layout), NOW))
    doc = demo_doc()
    for d in doc["domains"]:
        d["slots"][0]["models"] = [m for m in d["slots"][0]["models"] if m["name"] != "qwen3-0.6b"]
        d["slots"][0]["models"][0]["vram"] = "30GiB"  # Qwen/Qwen3-4B-Instruct no longer fits
    new = parse_layout(doc)
    events = diff(before, new, plan(new), NOW)
    described = [(tag_of(e), getattr(e, "domain", "")) for e in events]
    assert ("model_retired", "a") in described and ("model_retired", "b") in described
    assert sum(1 for t, _ in described if t == "model_changed") == 2
    refused = [e for e in events if tag_of(e) == "admission_decided" and not e.admitted]
    assert {(e.domain, e.name) for e in refused} == {("a", "Qwen/Qwen3-4B-Instruct"), ("b", "Qwen/Qwen3-4B-Instruct")}
    assert all(e.short_by_bytes == 8 * GiB for e in refused)
    # the 27b model is now first fit in 22 GiB after the refusal: still admitted, same numbers -> no event
    assert not any(tag_of(e) == "admission_decided" and e.name == "qwen3.6:27b-sim" for e in events)


async def test_apply_twice_leaves_the_log_unchanged(event_log):
    layout = load_layout(DEMO)
    subject = subjects.decl("default")
    first = await apply(event_log, layout, NOW)
    assert first.seqs and len(first.seqs) == len(first.events)
    stored = await event_log.history(subject)
    assert [r.seq for r in stored] == first.seqs
    # a hash chain: each event's prev is the sha256 of the body before it on the subject
    assert [r.event.prev for r in stored] == [""] + [body_hash(r.data) for r in stored[:-1]]
    assert {r.event.by for r in stored} == {"test"}  # the log fills `by` with its writer id
    second = await apply(event_log, layout, NOW)
    assert second.events == [] and second.seqs == []
    assert len(await event_log.history(subject)) == len(stored)


async def test_changed_policy_appends_exactly_one_policy_changed(event_log):
    doc = demo_doc()
    await apply(event_log, parse_layout(doc), NOW)
    before = await event_log.history(subjects.decl("default"))
    doc["policy"]["degraded_grace_ms"] = 45_000
    result = await apply(event_log, parse_layout(doc), NOW)
    after = await event_log.history(subjects.decl("default"))
    new = after[len(before) :]
    assert [tag_of(r.event) for r in new] == ["policy_changed"]
    assert new[0].event.policy.degraded_grace_ms == 45_000 and new[0].event.previous.degraded_grace_ms == 15_000
    assert result.seqs == [new[0].seq]


async def test_dry_run_writes_nothing(event_log):
    layout = load_layout(HEARTH)
    result = await apply(event_log, layout, NOW, dry_run=True)
    assert result.dry_run and result.events and result.seqs == []
    assert await event_log.history(subjects.decl("hearth")) == []
    refused = [e for e in result.events if tag_of(e) == "admission_decided" and not e.admitted]
    assert len(refused) == 6  # three per domain, mirrored


async def test_a_racing_writer_is_absorbed_by_rereading(event_log):
    """Another apply lands between our read and our append: we re-read and append only what is left."""
    layout = load_layout(DEMO)
    subject = subjects.decl("default")

    class RacingLog:
        """The real log, with a competing apply of the same layout slipped in before our first append."""

        def __init__(self, log):
            self.log, self.raced = log, False

        async def history(self, s):
            return await self.log.history(s)

        async def append(self, s, event, *, expect):
            if not self.raced:
                self.raced = True
                await apply(self.log, layout, NOW)
            return await self.log.append(s, event, expect=expect)

    result = await apply(RacingLog(event_log), layout, NOW)
    assert result.attempts == 2 and result.events == []
    tags = [tag_of(r.event) for r in await event_log.history(subject)]
    assert tags.count("fleet_declared") == 1 and tags.count("model_declared") == 6


def haru(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "haru.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


@pytest.mark.timeout(120)
def test_cli_apply_dry_run_then_apply_then_noop(nats_server):
    url = nats_server.url
    r = haru("apply", "-f", str(HEARTH), "--dry-run", "--nats-url", url)
    assert r.returncode == 0, r.stderr
    assert "42.0 / 44.2 GiB held  (5 declared, 2 admitted)" in r.stdout
    assert "gemma4:26b                   not admitted — short by 14.8 GiB" in r.stdout
    assert "short by 15.8 GiB" in r.stdout and "short by 17.8 GiB" in r.stdout
    assert "dry run: would append" in r.stdout

    r = haru("apply", "-f", str(HEARTH), "--nats-url", url, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["fleet"] == "hearth" and not out["dry_run"] and out["changes"]
    assert {(n["name"], format_gib(n["short_by_bytes"])) for n in out["not_admitted"]} == {
        ("gemma4:26b", "14.8 GiB"),
        ("qwen3.6:27b", "15.8 GiB"),
        ("gemma4-extract:31b", "17.8 GiB"),
    }
    assert len(out["not_admitted"]) == 6 and {n["domain"] for n in out["not_admitted"]} == {"a6000-east", "a6000-west"}

    r = haru("apply", "-f", str(HEARTH), "--nats-url", url)
    assert r.returncode == 0, r.stderr
    assert "up to date: nothing to append" in r.stdout


def test_cli_apply_bad_layout_says_where(tmp_path):
    doc = demo_doc()
    doc["domains"][1]["gpus"][0]["memory"] = "lots"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    r = haru("apply", "-f", str(path), "--nats-url", "nats://127.0.0.1:1")
    assert r.returncode == 1
    assert "$.domains[1].gpus[0].memory" in r.stderr and "Fix:" in r.stderr


def test_cli_dry_run_without_nats_validates_prints_the_plan_and_exits_0():
    r = haru("apply", "-f", str(HEARTH), "--dry-run", "--nats-url", "nats://127.0.0.1:1")
    assert r.returncode == 0, r.stderr  # the layout is valid: that is what a dry run checks
    assert "42.0 / 44.2 GiB held  (5 declared, 2 admitted)" in r.stdout
    assert "dry run without the running state" in r.stdout and "were not read" in r.stdout


async def test_the_cli_applies_a_three_domain_layout_and_its_status_ranks_the_standbys(nats_server, event_log):
    """`haru apply` of the shipped three-domain demo layout, through the real CLI on a real server: every
    domain declared and planned, and the status of its history ranking the two that are not active once
    the route is set."""
    import asyncio

    from haru.core.events import RouteMoved
    from tests.support import haru

    path = Path(__file__).resolve().parents[2] / "haru" / "up" / "demo" / "demo-fleet-3.json"
    out = await asyncio.to_thread(haru, "apply", "-f", str(path), nats_url=nats_server.url)
    assert out.returncode == 0, out.stdout + out.stderr
    records = await event_log.history(subjects.decl("default"))
    declared = {r.event.spec.name for r in records if tag_of(r.event) == "domain_declared"}
    assert declared == {"a", "b", "c"}
    admitted = {
        (r.event.domain, r.event.name) for r in records if tag_of(r.event) == "admission_decided" and r.event.admitted
    }
    assert {d for d, _ in admitted} == {"a", "b", "c"} and len(admitted) == 12  # 3 models and a training slot each
    await event_log.append(subjects.route("default"), RouteMoved(at=NOW, active="a"), expect=0)
    from haru.core.fold import fold
    from haru.projections.status import render

    history = await event_log.history(subjects.fleet_events("default"))
    text = render(fold((r.seq, r.subject, r.event) for r in history)["default"], NOW)
    assert "b  (standby #1)" in text and "c  (standby #2)" in text
    # nothing heard from the agents yet: no standby can take over, and status says so
    assert "standbys: none of 2 fit: UNPROTECTED" in text
    assert "1. b  not fit: standby b has not been heard from" in text
