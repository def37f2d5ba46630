"""Weighted routing: a model whose route intent gives a share of its traffic to a domain other than
the active one is answered by a `Split`, which sends request i to `table[i % len(table)]`
(haru.core.weights.spread: smooth weighted round robin, so every run of requests is within one
request per domain of its share). Pure but for the counter a `Split` keeps.

A domain gets its share only while its answer for the model, in the intent's `weighted`, is `ready`
and it has a URL; otherwise its share goes to the active domain (the promoter rolls such a canary back
and records why). The active's own answer still decides first: a model the active cannot serve is
refused as before, never sent to a canary alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from haru.core.views import RouteIntent, Target
from haru.core.weights import split_of, spread

__all__ = ["Split", "apply_splits", "carry_rotation", "target_url"]

F = TypeVar("F")


class Split(Generic[F]):
    """One model's split: `pick()` is the forward for the next request."""

    __slots__ = ("table", "weights", "_n")

    def __init__(self, table: tuple[F, ...], weights: dict[str, int]) -> None:
        self.table = table
        self.weights = weights  # the split in force (domains that cannot take their share folded into the active's)
        self._n = 0

    def pick(self) -> F:
        n = self._n
        self._n = n + 1
        return self.table[n % len(self.table)]


def target_url(target: Target, model: str) -> str:
    if target.serve == "direct":
        return target.model_urls.get(model, "")
    return target.serving_url


def apply_splits(
    intent: RouteIntent | None,
    entries: dict[str, object],
    is_forward: Callable[[object], bool],
    forward: Callable[[str, str, str], F],
) -> dict[str, object]:
    """`entries` with a `Split` for every model whose split sends a share elsewhere than the active.
    `forward(url, domain, model)` makes the forward to another domain; `is_forward` tells a forward
    to the active (a ready model) from a refusal."""
    if intent is None or intent.active is None or not (intent.weights or intent.model_weights):
        return entries
    active = intent.active.domain
    out = dict(entries)
    for model, entry in entries.items():
        if not is_forward(entry):
            continue
        split = split_of(intent.weights, intent.model_weights, model, active)
        if len(split) < 2:
            continue
        ways: dict[str, F] = {}
        effective: dict[str, int] = {active: 0}
        for domain, share in split.items():
            if domain == active or share <= 0:
                continue
            w = intent.weighted.get(domain)
            answer = w.answers.get(model) if w is not None else None
            url = target_url(w.target, model) if w is not None else ""
            if w is None or answer is None or answer.answer != "ready" or not url or not w.target.eligible:
                continue  # not ready there: its share stays with the active
            ways[domain] = forward(url, domain, model)
            effective[domain] = share
        effective[active] = 100 - sum(w for d, w in effective.items() if d != active)
        if len(effective) < 2:
            continue
        order = spread(effective)
        out[model] = Split(tuple(entry if d == active else ways[d] for d in order), effective)
    return out


def carry_rotation(old: dict[str, object], new: dict[str, object]) -> None:
    """A fleet's routes compiled again (a new view or intent) keep each unchanged split's place in its
    rotation, so frequent updates do not restart every split at the active and skew the shares."""
    for model, entry in new.items():
        before = old.get(model)
        if (
            type(entry) is Split
            and type(before) is Split
            and before.weights == entry.weights
            and len(before.table) == len(entry.table)
        ):
            entry._n = before._n
