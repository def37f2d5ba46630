"""Checkpoints: where a fleet's history stood, so readers start there instead of at sequence 1.

Pure. The projector writes a `checkpoint` event on `haru.evt.<fleet>.checkpoint` every
`CHECKPOINT_EVERY` events of the fleet (`projections/projector.py`): the chain head (sequence and
body hash) of every subject of the fleet at `upto`, and the fleet's view folded up to `upto`.

- `haru verify --since-checkpoint` seeds each subject's chain with the heads of the newest
  checkpoint of its fleet (after checking every head against the store: same subject, same body
  hash) and walks only what came after; `haru verify` without it walks everything, as before.
- A projector with no stored view (KV lost, or `haru projector --from-checkpoint`) starts each
  fleet from its newest checkpoint's view and replays from `upto + 1`.

A checkpoint is trusted the way any event is: it stands on a subject only the projector role may
write (`haru.core.authority`), in a hash chain of its own. A full `haru verify` proves what it vouches for.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

import msgspec

from haru.core import events as ev
from haru.core.views import FleetView

CHECKPOINT_EVERY = 10_000  # events of a fleet between two checkpoints

Heads = dict[str, tuple[int, str]]  # subject -> (seq, sha256 hex of its body)


def build(
    fleet: str, *, upto: int, events: int, heads: Mapping[str, tuple[int, str]], view: FleetView, now: datetime
) -> ev.Checkpoint:
    """The checkpoint of `fleet` at `upto`: `heads` are every subject's last (seq, hash) at or below it,
    `view` the fleet's view folded up to it."""
    complete = msgspec.structs.replace(view, checkpoint=max(view.checkpoint, upto))
    return ev.Checkpoint(
        at=now,
        fleet=fleet,
        upto=upto,
        events=events,
        heads=[ev.ChainHead(subject=s, seq=q, hash=h) for s, (q, h) in sorted(heads.items())],
        view=msgspec.to_builtins(complete),
    )


def heads_of(cp: ev.Checkpoint) -> Heads:
    return {h.subject: (h.seq, h.hash) for h in cp.heads}


def view_of(cp: ev.Checkpoint) -> FleetView | None:
    """The view the checkpoint carries (None when it cannot be read as a FleetView of this version)."""
    try:
        view = msgspec.convert(cp.view, FleetView)
    except (msgspec.ValidationError, TypeError):
        return None
    return view if view.fleet == cp.fleet else None
