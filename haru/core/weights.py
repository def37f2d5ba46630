"""Traffic weights and canaries: a share of a fleet's (or one model's) traffic on a domain other than
the active one. Pure: no I/O, no clock.

A split is domain -> whole percent, summing to 100; {} is the default, the active domain takes
everything. A fleet has one split for all its models (`weights`) and may override it per model
(`model_weights`). They are recorded by the promoter (`weights_set` on haru.evt.<fleet>.weights),
folded into the `FleetView`, published in the `RouteIntent`, and every router splits by them:

    given = parse_pairs(["b=10"])                       # {"b": 10}
    split = resolve(given, domains=["a", "b"], active="a")   # {"a": 90, "b": 10}
    split_of(intent, "qwen3:0.6b")                      # the model's split, {"a": 100} by default
    table = spread({"a": 90, "b": 10})                  # ("a", ..., "b", ...): request i goes to table[i % len]

Works for any number of domains: a split may give shares to several standbys (each woken and probed
first: one `weighting` operation per domain that gains a share). A split with no share on the active
domain is refused: moving all traffic is a promotion (`haru promote`), which moves the route pointer.

`spread` interleaves the domains by smooth weighted round robin (nginx's), so any run of consecutive
requests is within one request per domain of its exact share: 2,000 requests at 90/10 give 1,800/200.

A gateway reports what it measured of the domains that carry a share on haru.canary.<fleet>.<gateway>
(`CanaryReport`, core NATS, once a second while a fleet has a split); the promoter sums the reports of
a window (`Tally`) and rolls a canary back when they pass the policy (haru.promoter.canary).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime

import msgspec

from haru.core.errors import InvalidWeights
from haru.core.subjects import check_name

__all__ = [
    "CanaryReport",
    "Count",
    "Tally",
    "changed_shares",
    "describe",
    "gaining",
    "lines",
    "parse_pairs",
    "resolve",
    "scope_of",
    "spread",
    "split_of",
]

TOTAL = 100


def parse_pairs(items: Iterable[str]) -> dict[str, int]:
    """`["b=10", "a=90"]` -> {"b": 10, "a": 90}. Raises InvalidWeights naming the bad item and the fix."""
    out: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise InvalidWeights(f"weight {item!r} is not DOMAIN=PERCENT; write it like b=10")
        try:
            check_name("domain", name)
        except ValueError as exc:
            raise InvalidWeights(f"weight {item!r}: {exc}") from exc
        try:
            share = int(value)
        except ValueError:
            raise InvalidWeights(
                f"weight {item!r}: {value!r} is not a whole percent; write it like {name}=10"
            ) from None
        if name in out:
            raise InvalidWeights(f"domain {name!r} is given twice ({name}={out[name]}, {item}); give each domain once")
        out[name] = share
    return out


def resolve(given: Mapping[str, int], *, domains: Sequence[str], active: str) -> dict[str, int]:
    """The whole split that `given` asks for: every share checked, the active domain taking what the
    others leave when it is not named. {} when the active takes everything (the default).

    Raises InvalidWeights for an unknown domain, a share outside 0..100, shares that do not add up to
    100 (or leave nothing for the active), and a fleet with no active domain yet."""
    if not active:
        raise InvalidWeights(
            "the fleet has no active domain yet: there is no traffic to split; wait for the first route"
        )
    for name, share in given.items():
        if name not in domains:
            known = ", ".join(domains) or "none"
            raise InvalidWeights(f"no domain {name!r} in this fleet (declared: {known})")
        if isinstance(share, bool) or not isinstance(share, int) or share < 0 or share > TOTAL:
            raise InvalidWeights(f"weight {name}={share!r} is not a whole percent between 0 and {TOTAL}")
    others = {d: w for d, w in given.items() if d != active}
    rest = sum(others.values())
    if active in given:
        if rest + given[active] != TOTAL:
            shown = " + ".join(f"{d} {w}" for d, w in given.items())
            raise InvalidWeights(
                f"weights add up to {rest + given[active]} ({shown}), not {TOTAL}; make them add up to "
                f"{TOTAL}, or leave the active domain {active!r} out and it takes what is left"
            )
        if given[active] == 0:
            raise InvalidWeights(_no_active_share(active, others))
    elif rest >= TOTAL:
        if rest == TOTAL:
            raise InvalidWeights(_no_active_share(active, others))
        raise InvalidWeights(
            f"weights of the other domains add up to {rest}, over {TOTAL}: the active domain "
            f"{active!r} takes what they leave, so give them less than {TOTAL} in all"
        )
    split = {active: TOTAL - rest}
    split.update((d, w) for d in domains if (w := others.get(d, 0)) > 0)  # declaration order
    return {} if split == {active: TOTAL} else split


def _no_active_share(active: str, others: Mapping[str, int]) -> str:
    to = next((d for d, w in others.items() if w), "<domain>")
    return (
        f"the weights leave nothing for the active domain {active!r}: to move all traffic, promote the other "
        f"domain (haru promote {to}), which moves the route pointer"
    )


def scope_of(model: str) -> str:
    """How a split's scope is written: `model M`, or `the fleet`."""
    return f"model {model!r}" if model else "the fleet"


def split_of(
    weights: Mapping[str, int], model_weights: Mapping[str, Mapping[str, int]], model: str, active: str
) -> dict[str, int]:
    """The split `model`'s traffic follows: its own, else the fleet's, else the active's 100."""
    got = model_weights.get(model) if model else None
    if got is None:
        got = weights
    if not got:
        return {active: TOTAL} if active else {}
    return dict(got)


def gaining(old: Mapping[str, int], new: Mapping[str, int], active: str) -> list[str]:
    """The domains other than the active that `new` gives a share `old` did not: each must be awake and
    probed before traffic goes there."""
    return [d for d, w in new.items() if d != active and w > 0 and old.get(d, 0) <= 0]


def changed_shares(
    weights: Mapping[str, int], model_weights: Mapping[str, Mapping[str, int]]
) -> list[tuple[str, dict[str, int]]]:
    """Every split in force: ('' for the fleet's, else the model, its split). Defaults are left out."""
    out: list[tuple[str, dict[str, int]]] = []
    if weights:
        out.append(("", dict(weights)))
    out.extend((m, dict(w)) for m, w in sorted(model_weights.items()) if w)
    return out


def spread(split: Mapping[str, int]) -> tuple[str, ...]:
    """The order in which requests go to the domains of a split: one cycle of smooth weighted round
    robin, shortened by the shares' common divisor (90/10 -> 10 slots). Empty for an empty split."""
    shares = [(d, w) for d, w in split.items() if w > 0]
    if not shares:
        return ()
    g = 0
    for _, w in shares:
        g = math.gcd(g, w)
    shares = [(d, w // g) for d, w in shares]
    total = sum(w for _, w in shares)
    current = [0] * len(shares)
    out: list[str] = []
    for _ in range(total):
        for i, (_, w) in enumerate(shares):
            current[i] += w
        best = max(range(len(shares)), key=lambda i: (current[i], -i))
        current[best] -= total
        out.append(shares[best][0])
    return tuple(out)


def describe(split: Mapping[str, int], active: str) -> str:
    """`a 90, b 10` (the active first), or `a 100 (default)`."""
    if not split:
        return f"{active} {TOTAL} (default)" if active else "(no active domain)"
    order = sorted(split, key=lambda d: d != active)
    return ", ".join(f"{d} {split[d]}" for d in order)


def lines(weights: Mapping[str, int], model_weights: Mapping[str, Mapping[str, int]], active: str) -> list[str]:
    """`haru status` / `haru route`: one line per split in force, or the default's one line."""
    out = [
        f"weights: {describe(split, active)}" + (f"  (model {model!r})" if model else "")
        for model, split in changed_shares(weights, model_weights)
    ]
    return out or [f"weights: {describe({}, active)}"]


# ------------------------------------------------------------------------- what the gateways report


class Count(msgspec.Struct, frozen=True, kw_only=True):
    """Requests a gateway sent to one domain for one model in one interval, and how many failed
    (a 5xx from upstream, unreachable, a timeout); `last_error` is what the last failure said."""

    domain: str
    model: str
    requests: int = 0
    errors: int = 0
    last_error: str = ""


class CanaryReport(msgspec.Struct, frozen=True, kw_only=True):
    """One gateway's counts for one fleet since its previous report (haru.canary.<fleet>.<gateway>).
    The gateway is named by the subject, not by this body."""

    fleet: str
    at: datetime
    interval_ms: int = 0
    counts: list[Count] = []


class Tally(msgspec.Struct, frozen=True, kw_only=True):
    """Counts summed over a window, for one domain (and model, '' = all): what a rollback cites."""

    requests: int = 0
    errors: int = 0
    gateways: list[str] = []
    last_error: str = ""

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


report_encoder = msgspec.json.Encoder()
report_decoder = msgspec.json.Decoder(CanaryReport)
