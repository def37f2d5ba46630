"""A small YAML writer for the task and service files Haru submits: mappings, lists, strings,
numbers, booleans and None, in block style, keys in the order given.

Strings are written double-quoted with JSON escapes (valid YAML), except multi-line scripts
(`setup`, `run`), which are written as literal blocks so `--dry-run` reads like a hand-written task.
Haru does not depend on a YAML library for this; the tests read every output back with PyYAML and
SkyPilot's own schema.
"""

from __future__ import annotations

import json

__all__ = ["dump"]


def dump(value: object) -> str:
    lines: list[str] = []
    _block(value, 0, lines)
    return "\n".join(lines) + "\n"


def _scalar(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    raise TypeError(f"cannot write {type(value).__name__} as YAML")


def _literal_ok(text: str) -> bool:
    """A literal block keeps text exactly when it has no tabs or trailing spaces on any line and
    does not start with a space or a blank line."""
    if "\n" not in text.rstrip("\n") or text != text.lstrip(" \n") or "\t" in text or "\r" in text:
        return False
    return all(line == line.rstrip(" ") for line in text.split("\n"))


def _literal(text: str, indent: int) -> list[str]:
    body = text.rstrip("\n")
    trailing = len(text) - len(body)
    chomp = "-" if trailing == 0 else ("" if trailing == 1 else "+")
    pad = " " * indent
    return [f"|{chomp}"] + [pad + line if line else "" for line in body.split("\n")] + [""] * max(0, trailing - 1)


def _block(value: object, indent: int, lines: list[str]) -> None:
    pad = " " * indent
    if isinstance(value, dict):
        if not value:
            lines.append(pad + "{}")
        for key, item in value.items():
            k = key if isinstance(key, str) and key.replace("_", "a").isalnum() else _scalar(str(key))
            _entry(f"{pad}{k}:", item, indent, lines)
    elif isinstance(value, list):
        if not value:
            lines.append(pad + "[]")
        for item in value:
            _entry(f"{pad}-", item, indent, lines)
    else:
        lines.append(pad + _scalar(value))


def _entry(head: str, item: object, indent: int, lines: list[str]) -> None:
    if isinstance(item, dict) and item:
        lines.append(head)
        _block(item, indent + 2, lines)
    elif isinstance(item, list) and item:
        lines.append(head)
        _block(item, indent + 2, lines)
    elif isinstance(item, dict):
        lines.append(f"{head} {{}}")
    elif isinstance(item, list):
        lines.append(f"{head} []")
    elif isinstance(item, str) and _literal_ok(item):
        block = _literal(item, indent + 2)
        lines.append(f"{head} {block[0]}")
        lines.extend(block[1:])
    else:
        lines.append(f"{head} {_scalar(item)}")
