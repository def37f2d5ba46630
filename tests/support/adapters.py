"""Adapter events for the fold and gate tests: a published version, a routing decision, a runtime's state."""

from __future__ import annotations

from haru.core import events as ev
from haru.core import subjects as sj
from tests.support.fold import F, at

BASE = "qwen3.6:27b"
SERVED = f"{BASE}:sql"


def published(version: str, s: float = 1) -> tuple[str, ev.Event]:
    return (
        sj.training(F, "b", "lora"),
        ev.AdapterPublished(
            at=at(s),
            domain="b",
            slot="lora",
            base_model=BASE,
            adapter="sql",
            version=version,
            object_name=f"{BASE}:sql@{version}",
            digest="sha256:" + "0" * 64,
            size_bytes=1024,
            rank=8,
            data="data/sql.jsonl sha256:ab",
            metrics={"loss": 0.5},
        ),
    )


def routed(s: float = 2, **fields) -> tuple[str, ev.Event]:
    return (sj.weights(F), ev.AdapterRouted(at=at(s), model=BASE, adapter="sql", **fields))


def state(version: str, st: str, domain: str = "a", detail: str = "") -> tuple[str, ev.Event]:
    return (
        sj.model(F, domain, BASE),
        ev.AdapterStateChanged(
            at=at(3), domain=domain, model=BASE, adapter="sql", version=version, state=st, detail=detail
        ),
    )
