"""Reading the product's own source in tests: which lines of a module reach for the environment."""

from __future__ import annotations

import ast


def reads_environment(tree: ast.AST) -> list[int]:
    """Lines that name `os.environ`, `os.getenv` or `environ` imported from os."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(a.name in ("environ", "getenv", "environb") for a in node.names):
                lines.append(node.lineno)
    return lines
