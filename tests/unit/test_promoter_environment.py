"""The promoter's environment is read once, by `haru promoter`, and passed down as values: no module of
haru/promoter/ reads it, and a bad value is refused at start with the variable named."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from haru.log.memory import MemoryLog
from haru.promoter import Promoter
from tests.support import haru
from tests.support.source import reads_environment

pytestmark = pytest.mark.timeout(60)

PROMOTER = Path(__file__).resolve().parents[2] / "haru" / "promoter"


def test_no_module_of_the_promoter_reads_the_environment():
    found = {
        path.name: lines
        for path in sorted(PROMOTER.glob("*.py"))
        if (lines := reads_environment(ast.parse(path.read_text())))
    }
    assert found == {}, f"read the environment in haru/cli/promote.py and pass the value down: {found}"


def test_the_promoter_takes_its_test_switches_as_values_not_from_the_environment(monkeypatch):
    monkeypatch.setenv("HARU_PROMOTER_STEP_DELAY_MS", "5000")
    p = Promoter(MemoryLog(writer="promoter:test"), identity="promoter:test")
    assert p.step_delay_ms == 0
    assert Promoter(MemoryLog(writer="promoter:test"), identity="promoter:test", step_delay_ms=300).step_delay_ms == 300


def test_haru_promoter_refuses_a_step_delay_that_is_not_a_number_and_names_it():
    # refused before any connection is tried: the URL below has no server
    out = haru("promoter", "--nats-url", "nats://127.0.0.1:9", env={"HARU_PROMOTER_STEP_DELAY_MS": "soon"})
    assert out.returncode != 0
    assert "HARU_PROMOTER_STEP_DELAY_MS='soon'" in out.stderr and "milliseconds" in out.stderr
