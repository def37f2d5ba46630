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


# ---------------------------------------------------------------------------- publishing, as a trainer does


def write_adapter(path, *, rank: int = 8, says: str = "") -> None:
    """An adapter's directory as the simulated vLLM reads it (`haru_sim_says`: what it answers as)."""
    import json

    path.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    if says:
        config["haru_sim_says"] = says
    (path / "adapter_config.json").write_text(json.dumps(config))
    (path / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")


async def publish(
    log,
    directory,
    *,
    base: str,
    adapter: str,
    version: str,
    fleet: str = F,
    domain: str = "b",
    slot: str = "lora",
    rank: int = 8,
    digest: str = "",
) -> int:
    """Publish `directory` as the training contract says: one tar object in haru_adapters, then
    `adapter_published` on the training slot's subject. Returns the event's sequence."""
    from datetime import UTC, datetime

    from haru.agents.publishing import pack
    from haru.log.training_objects import JsObjects

    data = pack(directory)
    name = f"{base}:{adapter}@{version}"
    got = (await JsObjects(log.js, sj.ADAPTERS_BUCKET).put(name, data)).digest
    subject = sj.training(fleet, domain, slot)
    event = ev.AdapterPublished(
        at=datetime.now(UTC), domain=domain, slot=slot, base_model=base, adapter=adapter, version=version,
        object_name=name, digest=digest or got, size_bytes=len(data), rank=rank, data="tests/data.jsonl",
        metrics={"loss": 0.25},
    )  # fmt: skip
    return await log.append(subject, event, expect=await log.last_seq_of(subject))


async def canaried_then_promoted(log, served: str, version: str, *, fleet: str = F, timeout: float = 30.0):
    """Wait until `version` of `served` (`<base>:<adapter>`) takes all its traffic, and check that it got there
    as a canary first: the promoter's `adapter_routed` on the fleet's weights subject says `canary_started`
    for it before `promoted` (the history, not the view: a short canary may be over before a poll sees it).
    Returns the view."""
    from tests.support.promoter import wait_view

    view = await wait_view(
        log,
        lambda v: served in v.adapters and v.adapters[served].current == version,
        timeout=timeout,
        fleet=fleet,
        what=f"{version} of {served} promoted",
    )
    adapter = served.split(":", 1)[1]
    reasons = [
        e.reason
        for r in await log.history(sj.weights(fleet))
        if isinstance(e := r.event, ev.AdapterRouted) and e.adapter == adapter and version in (e.version, e.canary)
    ]
    assert "canary_started" in reasons and "promoted" in reasons, reasons
    assert reasons.index("canary_started") < reasons.index("promoted"), reasons
    return view
