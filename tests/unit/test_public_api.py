"""`haru/__init__.py` states the public API: every name in `haru.__all__` imports from `haru` and is the
object its home module defines, and `import haru` stays light (the names load when first used)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import haru

# What the project's docs tell a program to embed (docs/projector.md, docs/gateway.md).
EMBEDDED = {"RouteWatcher", "RouteIntent", "Target", "EventLog", "Gateway", "GatewayConfig", "HaruError"}


def test_the_public_api_names_what_the_docs_tell_programs_to_embed():
    assert set(haru.__all__) == EMBEDDED
    assert len(haru.__all__) == len(set(haru.__all__))


@pytest.mark.parametrize("name", sorted(EMBEDDED))
def test_each_public_name_imports_from_haru_and_is_its_home_modules_object(name):
    value = getattr(importlib.import_module("haru"), name)
    home = importlib.import_module(value.__module__)
    assert getattr(home, name) is value
    namespace: dict[str, object] = {}
    exec(f"from haru import {name}", namespace)
    assert namespace[name] is value
    assert name in dir(haru)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        haru.Nope  # noqa: B018


def test_importing_haru_loads_no_io_library_until_a_name_is_used():
    code = (
        "import sys, haru, haru.core.fold; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'nats', 'aiohttp', 'structlog'})); "
        "from haru import RouteWatcher; "
        "print('nats' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["[]", "True"], out
