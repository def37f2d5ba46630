"""deploy/prometheus: the scrape configuration and alert rules pass promtool, and the rules' own unit
tests (haru-alerts.test.yml) pass `promtool test rules`.

promtool comes with Debian's `prometheus` package. Without it these tests are skipped, saying how to
get it; with HARU_REQUIRE_PROMTOOL=1 (CI, .ci/run) they fail instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


@pytest.fixture
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        reason = "promtool not found: apt-get install prometheus (it carries promtool)"
        if os.environ.get("HARU_REQUIRE_PROMTOOL") == "1":
            pytest.fail(reason + " [HARU_REQUIRE_PROMTOOL=1]")
        pytest.skip(reason)
    return found


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60)


def test_alert_rules_are_valid(promtool):
    out = run([promtool, "check", "rules", "haru-alerts.yml"], DIR)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 13 rules found" in out.stdout


def test_alert_rules_unit_tests_pass(promtool):
    out = run([promtool, "test", "rules", "haru-alerts.test.yml"], DIR)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_alert_rules_unit_tests_can_fail(promtool, tmp_path):
    """A wrong expectation is reported: the unit tests above are not vacuous."""
    shutil.copy(DIR / "haru-alerts.yml", tmp_path)
    text = (DIR / "haru-alerts.test.yml").read_text()
    assert "GPU 0 of default/a is detached" in text
    (tmp_path / "t.yml").write_text(text.replace("GPU 0 of default/a is detached", "GPU 0 of default/b is detached"))
    out = run([promtool, "test", "rules", "t.yml"], tmp_path)
    assert out.returncode != 0 and "HaruGpuDetached" in out.stdout + out.stderr


def test_scrape_config_is_valid(promtool, tmp_path):
    # The config names the gateway token's file on a Prometheus host; promtool checks that it exists.
    token = tmp_path / "haru_api_token"
    token.write_text("example\n")
    config = (DIR / "prometheus.yml").read_text()
    assert "/etc/prometheus/haru_api_token" in config
    (tmp_path / "prometheus.yml").write_text(config.replace("/etc/prometheus/haru_api_token", str(token)))
    shutil.copy(DIR / "haru-alerts.yml", tmp_path)
    out = run([promtool, "check", "config", "prometheus.yml"], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    for job, port in (
        ("haru-gateway", 8700),
        ("haru-control", 9400),
        ("haru-agent", 9401),
        ("haru-promoter", 9402),
        ("haru-projector", 9403),
    ):
        assert f"job_name: {job}" in config and f":{port}" in config, job
