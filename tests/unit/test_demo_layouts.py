"""The demo layouts ship inside the haru package (so `haru up --demo` runs from an installed wheel),
and deploy/examples/ keeps the same files for operators: the two copies stay equal."""

from __future__ import annotations

from pathlib import Path

import pytest

from haru.core.layout import load_layout
from haru.up.demo_layout import DEMO_LAYOUT, REAL_DEMO_LAYOUT, demo_layout, widen

THREE_DOMAIN_LAYOUT = DEMO_LAYOUT.parent / "demo-fleet-3.json"

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("shipped", [DEMO_LAYOUT, REAL_DEMO_LAYOUT, THREE_DOMAIN_LAYOUT], ids=lambda p: p.name)
def test_the_shipped_demo_layout_is_the_operators_example(shipped):
    assert shipped.is_relative_to(ROOT / "haru"), f"{shipped} must be inside the haru package (package data)"
    example = ROOT / "deploy" / "examples" / shipped.name
    assert shipped.read_bytes() == example.read_bytes(), (
        f"{shipped.relative_to(ROOT)} and {example.relative_to(ROOT)} differ: copy the one you changed over the other"
    )
    assert load_layout(shipped).domains


def test_the_wheel_ships_the_demo_layouts():
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["haru"]
    shipped = {p.relative_to(ROOT / "haru") for p in (DEMO_LAYOUT, REAL_DEMO_LAYOUT, THREE_DOMAIN_LAYOUT)}
    assert all(any(p.match(pattern) for pattern in data) for p in shipped), (shipped, data)


def test_the_three_domain_demo_layout_is_what_domains_3_builds():
    import json

    built = widen(json.loads(DEMO_LAYOUT.read_text()), 3)
    shipped = json.loads(THREE_DOMAIN_LAYOUT.read_text())
    built.pop("_comment"), shipped.pop("_comment")
    assert shipped == built, "regenerate haru/up/demo/demo-fleet-3.json from widen(demo-fleet.json, 3)"


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_domains_n_gives_a_fleet_of_n_mirroring_domains_with_their_own_ports(n, tmp_path):
    layout = demo_layout(tmp_path, DEMO_LAYOUT, n)
    names = [d.spec.name for d in layout.domains]
    assert names == ["a", "b", "c", "d"][:n]
    ports = [m.port for d in layout.domains for m in d.models]
    assert len(ports) == len(set(ports)), "every model of the demo gets its own port on this one machine"
    urls = [d.spec.serving_url for d in layout.domains]
    assert len(set(urls)) == n
    assert all({m.name for m in d.models} == {m.name for m in layout.domains[0].models} for d in layout.domains)
    checkpoints = {t.checkpoint_dir for d in layout.domains for t in d.training}
    assert len(checkpoints) == n and all(str(tmp_path) in c for c in checkpoints)


def test_domains_out_of_range_is_refused_with_the_range():
    from haru.core.errors import ConfigError

    with pytest.raises(ConfigError, match="1 to 9 domains"):
        widen({"domains": [{"name": "a"}]}, 10)


def test_the_shipped_demo_file_re_applied_to_the_demo_fleet_is_no_change(monkeypatch, tmp_path):
    """`haru up --demo` declares exactly what the shipped file says (the agents resolve a leading `python`
    themselves), so `haru apply -f` of that file changes nothing and rolls no model."""
    from haru.core.launch import with_interpreter
    from haru.core.layout import parse_layout
    from haru.up.demo_layout import demo_layout

    monkeypatch.setenv("HOME", str(tmp_path))  # the default home, ~/.haru, inside this test
    for name in ("demo-fleet.json", "demo-fleet-3.json"):
        shipped = Path(__file__).resolve().parents[2] / "deploy" / "examples" / name
        declared = demo_layout(tmp_path / ".haru", Path(__file__).resolve().parents[2] / "haru" / "up" / "demo" / name)
        assert declared == parse_layout(shipped.read_bytes()), name
    assert with_interpreter(["python", "-m", "x"], "/venv/bin/python3") == ["/venv/bin/python3", "-m", "x"]
    assert with_interpreter(["/usr/bin/python", "t.py"], "/venv/bin/python3") == ["/usr/bin/python", "t.py"]
