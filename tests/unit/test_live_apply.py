"""The pure parts of applying a layout live: which models change, and the path each change takes."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec

from haru.agents.config import diff_models
from haru.core import events as ev
from haru.core.apply import change_paths, waits_on_active
from haru.core.specs import ModelSpec

T = datetime(2026, 11, 30, tzinfo=UTC)


def spec(name: str, **kw) -> ModelSpec:
    return ModelSpec(name=name, slot="chat", gpu_index=0, **kw)


def test_diff_models_by_name_and_whole_spec():
    old = [spec("m1"), spec("m2"), spec("m3")]
    new = [spec("m1"), msgspec.structs.replace(spec("m2"), context_length=4096), spec("m4")]
    d = diff_models(old, new)
    assert [m.name for m in d.added] == ["m4"]
    assert d.removed == ["m3"]
    assert [m.name for m in d.changed] == ["m2"] and d.changed[0].context_length == 4096
    assert d.unchanged == ["m1"]
    assert diff_models(old, old) == diff_models([], []).__class__(unchanged=["m1", "m2", "m3"])


def test_change_paths_name_the_active_domain_as_the_one_that_waits():
    changed = [ev.ModelChanged(at=T, domain=d, spec=spec("m2")) for d in ("a", "b")]
    lines = change_paths(
        [ev.ModelDeclared(at=T, domain="a", spec=spec("m4")), ev.ModelRetired(at=T, domain="b", model="m3"), *changed],
        active="b",
    )
    by = {line.split(":", 1)[0]: line for line in lines}
    assert "started live" in by["a/m4"] and "stopped live" in by["b/m3"]
    assert "replaced live" in by["a/m2"]  # a is the standby here
    assert "ACTIVE" in by["b/m2"] and "rolls through the standby" in by["b/m2"] and "then b" in by["b/m2"]
    assert waits_on_active([*changed], "b") == ["b/m2"] and waits_on_active([*changed], "") == []
