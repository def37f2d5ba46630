"""How the adapter events change a `FleetView` (pure): `FleetView.adapters`, one `AdapterView` per served id
`<base>:<adapter>` (haru.core.adapters). Called by `haru.core.fold`'s table."""

from __future__ import annotations

from typing import Any

import msgspec

from haru.core import events as ev
from haru.core.adapters import AdapterChange, AdapterCopy, AdapterVersion, AdapterView, served_id
from haru.core.fold_anomalies import anomaly
from haru.core.views import FleetView

__all__ = ["adapter_published", "adapter_routed", "adapter_state_changed"]


def _with(view: FleetView, av: AdapterView) -> FleetView:
    return msgspec.structs.replace(view, adapters={**view.adapters, av.served: av})


def _view_of(view: FleetView, model: str, adapter: str) -> AdapterView:
    return view.adapters.get(served_id(model, adapter)) or AdapterView(model=model, adapter=adapter)


def adapter_published(view: FleetView, e: ev.AdapterPublished, seq: int) -> FleetView:
    av = _view_of(view, e.base_model, e.adapter)
    if e.version in av.versions:
        return anomaly(
            view, f"seq {seq}: adapter {av.served!r} version {e.version!r} was already published; kept the first", e.at
        )
    version = AdapterVersion(
        version=e.version,
        object_name=e.object_name,
        digest=e.digest,
        size_bytes=e.size_bytes,
        rank=e.rank,
        domain=e.domain,
        slot=e.slot,
        data=e.data,
        metrics=dict(e.metrics),
        published_at=e.at,
        seq=seq,
    )
    return _with(view, _replace_av(av, versions={**av.versions, e.version: version}))


def adapter_state_changed(view: FleetView, e: ev.AdapterStateChanged, seq: int) -> FleetView:
    av = _view_of(view, e.model, e.adapter)
    copy = AdapterCopy(
        domain=e.domain,
        version=e.version,
        state=e.state,
        detail=e.detail,
        runtime_name=e.runtime_name,
        took_ms=e.took_ms,
        probe=e.probe,
        probe_detail=e.probe_detail,
        at=e.at,
        seq=seq,
    )
    return _with(view, _replace_av(av, copies={**av.copies, f"{e.domain}/{e.version}": copy}))


def adapter_routed(view: FleetView, e: ev.AdapterRouted, seq: int) -> FleetView:
    av = _view_of(view, e.model, e.adapter)
    rolled_back = dict(av.rolled_back)
    if e.reason == "rolled_back" and e.version:
        rolled_back[e.version] = e.detail or "rolled back"
    change = AdapterChange(reason=e.reason, version=e.version, detail=e.detail, by=e.by, at=e.at, seq=seq)
    av = _replace_av(
        av,
        current=e.current,
        canary=e.canary,
        percent=e.percent if e.canary else 0,
        previous=e.previous,
        routed_seq=seq,
        change=change,
        rolled_back=rolled_back,
    )
    return _with(view, av)


def _replace_av(av: AdapterView, **changes: Any) -> AdapterView:
    return msgspec.structs.replace(av, **changes)
