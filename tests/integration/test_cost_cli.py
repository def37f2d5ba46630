"""`haru cost` through a real nats-server: the scripted day (tests/support/cost_day.py) appended to the log,
read back by the CLI, agrees with the figures worked out by hand; `--as-of` costs the day as the log knew it
before SkyPilot's cost report was recorded."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.support import cost_day as day

ROOT = Path(__file__).resolve().parents[2]


def haru(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "haru.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def cost(url: str, *more: str) -> subprocess.CompletedProcess[str]:
    return haru(
        "cost", "--fleet", day.FLEET, "--since", "2026-12-01T00:00:00Z", "--until", "2026-12-02T00:00:00Z",
        "--nats-url", url, *more,
    )  # fmt: skip


@pytest.mark.timeout(120)
async def test_haru_cost_agrees_with_the_day_worked_out_by_hand(nats_server, event_log):
    # everything but the teardown's cost report first, so `--as-of` can ask what was known before it
    (report,) = [i for i, (_, e) in enumerate(day.SCRIPT) if getattr(e, "costs", None)]
    last: dict[str, int] = {}
    for i, (subject, e) in enumerate(day.SCRIPT):
        if i != report:
            last[subject] = await event_log.append(subject, e, expect=last.get(subject, 0))
    await asyncio.sleep(0.05)
    before_report = datetime.now(UTC)
    await asyncio.sleep(0.05)
    subject, e = day.SCRIPT[report]
    await event_log.append(subject, e, expect=last[subject])

    r = await asyncio.to_thread(cost, nats_server.url, "--json")
    assert r.returncode == 0, r.stderr
    got, want = json.loads(r.stdout), day.expected()
    for d in ("a", "b"):
        for cls, seconds in want["seconds"][d].items():
            assert got["domains"][d]["seconds"][cls] == seconds, (d, cls)
            assert got["domains"][d]["cost"][cls] == want["cost_by_class"][d][cls], (d, cls)
    for key in ("cost", "serving_cost", "ha_premium", "harvested", "net_cost", "two_hot_replicas", "difference"):
        assert got[key] == want[key], key
    assert got["per_million_tokens"] == want["per_million_tokens"]
    assert [(f["op_id"], f["seconds"]) for f in got["failovers"]] == [(f[0], f[4]) for f in day.FAILOVERS]

    table = await asyncio.to_thread(cost, nats_server.url)
    assert table.returncode == 0, table.stderr
    assert f"cost of the fleet             {want['cost']}" in table.stdout
    assert "unreachable" in table.stdout and "skypilot" in table.stdout
    assert f"{want['per_million_tokens']['with_ha']} with HA" in table.stdout

    then = await asyncio.to_thread(cost, nats_server.url, "--json", "--as-of", before_report.isoformat())
    assert then.returncode == 0, then.stderr
    known = json.loads(then.stdout)
    assert [p["source"] for p in known["domains"]["b"]["prices"]] == ["layout"]  # no cost report yet
    assert known["domains"]["a"] == got["domains"]["a"] and known["cost"] != got["cost"]


@pytest.mark.timeout(60)
async def test_haru_cost_says_what_is_wrong(nats_server, event_log):
    r = await asyncio.to_thread(cost, nats_server.url)
    assert r.returncode == 3 and "no history for fleet 'day'" in r.stderr
    r = await asyncio.to_thread(haru, "cost", "--fleet", "day", "--until", "yesterday", "--nats-url", nats_server.url)
    assert r.returncode == 2 and "not an ISO-8601 time" in r.stderr
