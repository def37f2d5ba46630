"""What `haru why <base>:<adapter>` draws for a LoRA adapter served at run time (docs/adapters.md): every
version's `adapter_published` (the run, its data and metrics), what each domain's runtime said of it
(`adapter_state_changed`, with its evaluation probe) and the promoter's `adapter_routed` decisions (a canary, a
promotion, a rollback with its evidence). Each decision names the runtime's event it rests on as its cause and
each runtime event the publication, so the tree reads from the served version down to the run that made it."""

from __future__ import annotations

from haru.core import events as ev
from haru.core import subjects
from haru.core.authority import misplaced
from haru.core.errors import LogDamaged
from haru.log.record import Record
from haru.log.seam import EventReader

__all__ = ["adapter_records"]


async def _read(log: EventReader, subject_filter: str, damage: list[LogDamaged]) -> list[Record]:
    try:
        return await log.history(subject_filter, strict=True)
    except LogDamaged as exc:
        damage.append(exc)
        return exc.records or []


def _splits(served: str) -> list[tuple[str, str]]:
    """Every (base, adapter) reading of `served` (a base model id may hold colons itself)."""
    return [(served[:i], served[i + 1 :]) for i, c in enumerate(served) if c == ":" and 0 < i < len(served) - 1]


async def adapter_records(
    log: EventReader, fleet: str, served: str, domain: str, damage: list[LogDamaged]
) -> dict[int, Record]:
    """The adapter `served`'s records by sequence ({} when no adapter of that id was ever published)."""
    if not _splits(served):
        return {}
    training = await _read(log, f"{subjects.EVT}.{subjects.check_name('fleet', fleet)}.*.training.*", damage)
    out: dict[int, Record] = {}
    for base, adapter in _splits(served):
        published = [
            r
            for r in training
            if isinstance(r.event, ev.AdapterPublished)
            and r.event.base_model == base
            and r.event.adapter == adapter
            and not misplaced(r.subject, r.event)
        ]
        if not published:
            continue
        out.update((r.seq, r) for r in published)
        for r in await _read(log, subjects.model_events(fleet, base, domain or "*"), damage):
            e = r.event
            if isinstance(e, ev.AdapterStateChanged) and e.adapter == adapter and not misplaced(r.subject, e):
                out[r.seq] = r
        for r in await _read(log, subjects.weights(fleet), damage):
            e = r.event
            if isinstance(e, ev.AdapterRouted) and e.model == base and e.adapter == adapter:
                if not misplaced(r.subject, e):
                    out[r.seq] = r
    return out
