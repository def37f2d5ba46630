"""The reference pages name what the code has: every `haru` command and exit status in docs/cli.md, every
`HARU_` variable the code reads in docs/configuration.md. A command, status or variable added without its
line in the manual fails here."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
from pathlib import Path

import haru.cli
from haru.cli.common import ExitStatus

ROOT = Path(__file__).resolve().parents[2]
CLI_DOC = ROOT / "docs" / "cli.md"
CONFIG_DOC = ROOT / "docs" / "configuration.md"
CODE = [ROOT / "haru", ROOT / "agents", ROOT / "gateway", ROOT / "projections"]


class _Names:
    """Stands in for the subparsers each CLI module registers its commands with, and keeps their names."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def add_parser(self, name: str, **kwargs: object) -> argparse.ArgumentParser:
        self.names.append(name)
        return argparse.ArgumentParser(prog=f"haru {name}")


def commands() -> list[str]:
    """Every top-level `haru` command, found as `haru.cli.build_parser` finds them: each module's `register`."""
    names = _Names()
    for info in pkgutil.iter_modules(haru.cli.__path__):
        if info.name.startswith("_") or info.name == "common":
            continue
        register = getattr(importlib.import_module(f"haru.cli.{info.name}"), "register", None)
        if register is not None:
            register(names)
    return sorted(names.names)


def table_rows(doc: str) -> list[str]:
    return [line for line in doc.splitlines() if line.startswith("| ")]


def documented_commands(doc: str) -> set[str]:
    """The commands the first cells of docs/cli.md's tables name: `haru op`, `haru provision / teardown / replace`."""
    names: set[str] = set()
    for row in table_rows(doc):
        for m in re.finditer(r"haru ([a-z-]+(?: / [a-z-]+)*)", row.split("|")[1]):
            names |= set(m.group(1).split(" / "))
    return names


def test_every_command_has_a_row_in_cli_md():
    missing = sorted(set(commands()) - documented_commands(CLI_DOC.read_text()))
    assert not missing, f"docs/cli.md has no row for: {', '.join(f'haru {c}' for c in missing)}"
    assert "teardown" in documented_commands("| `haru provision / teardown / replace <domain>` | ... |")


def test_every_exit_status_has_a_row_in_cli_md():
    rows = {r.split("|")[1].strip() for r in table_rows(CLI_DOC.read_text())}
    missing = [f"{s.value} ({s.name})" for s in ExitStatus if str(s.value) not in rows]
    assert not missing, f"docs/cli.md's exit-status table lacks: {', '.join(missing)}"


def variables_read() -> set[str]:
    names: set[str] = set()
    for top in CODE:
        for path in top.rglob("*.py"):
            names |= set(re.findall(r"[\"'](HARU_[A-Z0-9_]+)[\"']", path.read_text()))
    return names - {"HARU_EVENTS", "HARU_ROUTE"}  # stream names, not variables


def test_every_variable_the_code_reads_is_in_configuration_md():
    doc = CONFIG_DOC.read_text()
    missing = sorted(v for v in variables_read() if f"`{v}`" not in doc)
    assert not missing, f"docs/configuration.md's environment table lacks: {', '.join(missing)}"
