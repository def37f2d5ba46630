"""The YAML of the task and service files Haru submits: PyYAML's safe dumper, block style, keys in the
order given, and multi-line scripts (`setup`, `run`) as literal blocks, so `--dry-run` reads like a
hand-written task. The tests read every output back with PyYAML and SkyPilot's own schema.
"""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["dump"]


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, text: str) -> Any:
    # A literal block for a script; PyYAML falls back to a quoted scalar where a block cannot keep the
    # text exactly (trailing spaces, tabs, a leading space).
    style = "|" if "\n" in text.rstrip("\n") else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)


def dump(value: object) -> str:
    return yaml.dump(
        value, Dumper=_Dumper, sort_keys=False, allow_unicode=True, default_flow_style=False, width=1 << 16
    )
