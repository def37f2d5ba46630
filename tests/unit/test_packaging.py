"""Haru installs one top-level name, `haru`: the services in the repository's agents/, gateway/ and
projections/ install as haru.agents, haru.gateway and haru.projections (haru/agents etc. are links
to those folders), so a `pip install haru` next to a package that owns `agents` (OpenAI's Agents SDK:
`from agents import Agent`) leaves both working."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("agents", "gateway", "projections")
OLD_IMPORT = re.compile(rf"^\s*(from|import) ({'|'.join(SERVICES)})(\.|\s|$)", re.M)


def test_the_service_folders_are_linked_under_haru():
    for name in SERVICES:
        link = REPO / "haru" / name
        assert link.is_symlink() and link.resolve() == (REPO / name).resolve(), link


def test_no_code_imports_a_service_by_its_top_level_name():
    offenders = []
    for top in ("haru", *SERVICES, "tests", "bench", "deploy"):
        for p in (REPO / top).rglob("*.py"):
            if (
                ".venv" in p.parts
                or p == Path(__file__)
                or (top == "haru" and p.relative_to(REPO / "haru").parts[0] in SERVICES)
            ):
                continue
            for m in OLD_IMPORT.finditer(p.read_text()):
                offenders.append(f"{p.relative_to(REPO)}: {m.group(0).strip()}")
    assert not offenders, "import the services as haru.agents / haru.gateway / haru.projections:\n" + "\n".join(
        offenders
    )


def test_the_wheel_takes_only_the_haru_name():
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert conf["tool"]["setuptools"]["packages"]["find"]["include"] == ["haru", "haru.*"]
    assert conf["tool"]["importlinter"]["root_packages"] == ["haru"]


def test_installed_haru_works_beside_another_package_named_agents(tmp_path):
    """The installed tree (links followed, as the wheel holds it) with a stand-in for the Agents SDK on
    the same path: both import, and the demo layout ships inside the package."""
    site = tmp_path / "site"
    shutil.copytree(REPO / "haru", site / "haru", symlinks=False, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (site / "agents").mkdir()
    (site / "agents" / "__init__.py").write_text("class Agent:\n    SDK = True\n")
    probe = textwrap.dedent(
        f"""
        from agents import Agent
        assert Agent.SDK
        import haru.agents.agent, haru.gateway.server, haru.projections.projector, haru.cli, haru.up.compose
        from haru.up.demo_layout import DEMO_LAYOUT
        assert DEMO_LAYOUT.is_file(), DEMO_LAYOUT
        from haru.gateway.console import Console  # its page is package data, found through the package
        from haru.gateway.routing import RoutingTable
        assert all(body for body, _ in Console(RoutingTable(), None)._static.values())
        assert haru.agents.agent.__file__.startswith({str(site)!r}), haru.agents.agent.__file__
        print("ok")
    """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    # -S: no .pth files, so the editable install's finder cannot hand out the repository's haru; the
    # dependencies come from the same site-packages, appended after the installed tree
    deps = [p for p in sys.path if p.endswith("site-packages")]
    out = subprocess.run(
        [sys.executable, "-S", "-c", f"import sys; sys.path += {deps!r}\n" + probe],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
