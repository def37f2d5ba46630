"""The test suite's own shape: a test module imports helpers from tests/support and gets shared fixtures from a
conftest.py, never from another test module (whose fixtures would be redefined by every test that names them, and
whose import would run that module's own setup). The benchmarks, which reuse the tests' helpers, are held to the
same."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
    return out


def is_test_module(name: str) -> bool:
    """`tests.<folder>.<module>` outside tests/support, or a bare `test_x` / `conftest` (pytest's rootdir-relative
    import, which only works by accident of sys.path)."""
    parts = name.split(".")
    if parts[0] == "tests":
        return len(parts) > 1 and parts[1] != "support"
    return parts[0].startswith("test_") or parts[0] == "conftest"


def test_no_test_module_imports_another_test_module():
    found = [
        f"{path.relative_to(TESTS.parent)}:{line}: imports {name}"
        for path in sorted([*TESTS.rglob("*.py"), *(TESTS.parent / "bench").glob("*.py")])
        for line, name in imported_modules(path)
        if is_test_module(name)
    ]
    assert not found, "move what is shared to tests/support (helpers) or a conftest.py (fixtures):\n" + "\n".join(found)
