"""The demo layouts ship inside the haru package (so `haru up --demo` runs from an installed wheel),
and deploy/examples/ keeps the same files for operators: the two copies stay equal."""

from __future__ import annotations

from pathlib import Path

import pytest

from haru.core.layout import load_layout
from haru.up.compose import DEMO_LAYOUT, REAL_DEMO_LAYOUT

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("shipped", [DEMO_LAYOUT, REAL_DEMO_LAYOUT], ids=lambda p: p.name)
def test_the_shipped_demo_layout_is_the_operators_example(shipped):
    assert shipped.is_relative_to(ROOT / "haru"), f"{shipped} must be inside the haru package (package data)"
    example = ROOT / "deploy" / "examples" / shipped.name
    assert shipped.read_bytes() == example.read_bytes(), \
        f"{shipped.relative_to(ROOT)} and {example.relative_to(ROOT)} differ: copy the one you changed over the other"
    assert load_layout(shipped).domains


def test_the_wheel_ships_the_demo_layouts():
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["haru"]
    shipped = {p.relative_to(ROOT / "haru") for p in (DEMO_LAYOUT, REAL_DEMO_LAYOUT)}
    assert all(any(p.match(pattern) for pattern in data) for p in shipped), (shipped, data)
