"""The log seam's declaration against both logs, for what the type checker does not compare: default
values. mypy (haru/log/conformance.py) checks that EventLog and MemoryLog have every member of every
Protocol in haru/log/seam.py with compatible types, but not that a default is the same (a `strict`
that defaults to True on one log and False on the other type-checks, and changes what a caller gets).
"""

from __future__ import annotations

import inspect

import pytest

from haru.log import seam
from haru.log.eventlog import EventLog
from haru.log.memory import MemoryLog

PROTOCOLS = [seam.Followable, seam.EventReader, seam.EventWriter, seam.ViewStore, seam.IntentStore, seam.Log]


def members(protocol: type) -> list[str]:
    return sorted(n for n, v in vars(protocol).items() if inspect.isfunction(v) and not n.startswith("_"))


def shape(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("log", [EventLog, MemoryLog], ids=lambda c: c.__name__)
def test_every_method_of_the_seam_has_the_declared_parameters_and_defaults(protocol, log):
    assert members(protocol), f"{protocol.__name__} declares no methods"
    for name in members(protocol):
        assert shape(getattr(log, name)) == shape(getattr(protocol, name)), f"{log.__name__}.{name}"
