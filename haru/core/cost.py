"""The accounting: what a fleet's hosts cost over a period, what their hours did, and what they served.

A pure fold (no I/O, no clock): records of one fleet in, a period's `Accounting` out. docs/cost.md says
how each figure is derived; in short:

- Every second of [since, until) that a domain's host exists (a static domain from its declaration, a
  provisioned one from its launch or its agent's start until its teardown) is in exactly one class, the
  first that holds (`CLASSES`, in this order):

      unreachable        the promoter wrote domain_unreachable (heartbeat silence), not yet reachable again
      lost               a declared model is lost or failed
      waking             a declared model is pulling, loading, waking, or has said nothing yet
      active             the domain is the route pointer's target
      standby_training   a standby with at least one training slot running
      standby_idle       a standby with nothing running in its lent VRAM

- Each second is priced at the domain's price at that second (haru.core.prices): the layout's as
  recorded by `price_declared`, overridden over a torn-down cluster's life by the hourly price SkyPilot's
  cost report gives (`step_completed.costs`: total over seconds). A second with no price, or a price in
  another currency than the fleet's, is counted in `unpriced` and costs nothing in the sums: the report
  says how much of the period is unpriced rather than pretending it was free.
- Money is `Decimal`, exact until it is shown (`cents`).

Time is the events' `at` (when the writer saw it); the reader chooses which records it hands in (`haru
cost --as-of` hands only those recorded by then, so a period can be costed as it was known).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from haru.core import authority, subjects
from haru.core import events as ev
from haru.core.prices import Price, amount
from haru.core.record import Record
from haru.core.specs import DomainSpec

__all__ = [
    "CLASSES",
    "Accounting",
    "DomainAccount",
    "Failover",
    "account",
    "cents",
    "money_of",
]

CLASSES: tuple[str, ...] = ("active", "standby_training", "standby_idle", "waking", "lost", "unreachable")
"""The classes of a host's seconds, in the order `account` tests them (the first that holds)."""

_US = timedelta(microseconds=1)
_US_PER_HOUR = Decimal(3_600_000_000)
_CENT = Decimal("0.01")
_MILLION = Decimal(1_000_000)

_WAKING = (ev.ModelPulling, ev.ModelLoading, ev.ModelWaking)
_UP = (ev.ModelResident, ev.ModelSleeping, ev.ModelAdopted, ev.ModelStopped)
_LOST = (ev.ModelLost, ev.ModelFailed)
_CLOUD = ("skypilot", "skyserve")


def cents(value: Decimal) -> Decimal:
    """Money as shown: rounded half up to the cent."""
    return value.quantize(_CENT, rounding=ROUND_HALF_UP)


def money_of(us: int, price: Price) -> Decimal:
    """What `us` microseconds cost at `price` (exact)."""
    return Decimal(us) * price.hourly / _US_PER_HOUR


@dataclass
class DomainAccount:
    """One domain's period. Times are microseconds; money is exact Decimal in the fleet's currency."""

    domain: str
    region: str = ""
    provider: str = ""
    gpu_type: str = ""
    us: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    unpriced_us: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    cost: dict[str, Decimal] = field(default_factory=lambda: {c: Decimal(0) for c in CLASSES})
    serving_us: int = 0  # while it was the route pointer's target, in any class
    serving_cost: Decimal = Decimal(0)
    serving_unpriced_us: int = 0
    training_us: int = 0  # slot-time of training runs (two slots for an hour: two hours)
    training_runs: int = 0  # runs that started in the period
    stopped_by_failover: int = 0  # runs stopped while a promotion of this domain was under way
    stopped_by_failover_us: int = 0  # what those runs had run, in the period
    prices: list[tuple[datetime, Price | None]] = field(default_factory=list)  # the prices in force, from when

    @property
    def total_cost(self) -> Decimal:
        return sum(self.cost.values(), Decimal(0))

    @property
    def total_us(self) -> int:
        return sum(self.us.values())

    @property
    def unpriced_total_us(self) -> int:
        return sum(self.unpriced_us.values())


@dataclass
class Failover:
    """A promotion requested in the period: from which domain to which, why, and what it cost in time."""

    op_id: str
    source: str
    target: str
    reason: str
    requested_at: datetime
    outcome: str = "in_flight"  # completed | aborted | in_flight
    moved_at: datetime | None = None  # the route_moved it made (None: routing did not move)
    ended_at: datetime | None = None

    @property
    def seconds(self) -> float | None:
        """Request to route move (a completed failover), or to the abort; None while in flight."""
        end = self.moved_at or self.ended_at
        return None if end is None else (end - self.requested_at) / _US / 1e6


@dataclass
class Accounting:
    fleet: str
    since: datetime
    until: datetime
    currency: str = ""
    domains: dict[str, DomainAccount] = field(default_factory=dict)
    failovers: list[Failover] = field(default_factory=list)
    tokens: dict[str, dict[str, int]] = field(default_factory=dict)  # model -> prompt, completion, responses
    problems: list[str] = field(default_factory=list)

    # ----------------------------------------------------------------------------- the sums

    @property
    def cost(self) -> Decimal:
        """What the fleet's hosts cost over the period (its priced seconds)."""
        return sum((d.total_cost for d in self.domains.values()), Decimal(0))

    @property
    def serving_cost(self) -> Decimal:
        """One replica: what the domain the route pointed at cost, second by second."""
        return sum((d.serving_cost for d in self.domains.values()), Decimal(0))

    @property
    def ha_premium(self) -> Decimal:
        """What high availability cost: everything but the serving replica (the standbys' seconds)."""
        return self.cost - self.serving_cost

    @property
    def harvested(self) -> Decimal:
        """What the standbys' training seconds are worth at their hosts' prices: compute that trained."""
        return sum((d.cost["standby_training"] for d in self.domains.values()), Decimal(0))

    @property
    def net_cost(self) -> Decimal:
        return self.cost - self.harvested

    @property
    def two_hot_replicas(self) -> Decimal:
        """The same service as two hot replicas: the serving replica and a hot copy of it, every second."""
        return 2 * self.serving_cost

    @property
    def difference(self) -> Decimal:
        """Two hot replicas less what the fleet cost net of the training it harvested."""
        return self.two_hot_replicas - self.net_cost

    @property
    def total_tokens(self) -> int:
        return sum(t["prompt"] + t["completion"] for t in self.tokens.values())

    @property
    def unpriced_us(self) -> int:
        return sum(d.unpriced_total_us for d in self.domains.values())

    def per_million(self, money: Decimal) -> Decimal | None:
        tokens = self.total_tokens
        return None if tokens == 0 else money * _MILLION / Decimal(tokens)

    # ------------------------------------------------------------------------------ JSON

    def to_builtins(self) -> dict[str, Any]:
        """The accounting as JSON-ready values: seconds as numbers, money as strings to the cent."""

        def money(v: Decimal | None) -> str | None:
            return None if v is None else str(cents(v))

        def secs(us: int) -> float:
            return us / 1e6

        domains = {}
        for name, d in self.domains.items():
            domains[name] = {
                "region": d.region,
                "provider": d.provider,
                "gpu_type": d.gpu_type,
                "seconds": {c: secs(d.us[c]) for c in CLASSES},
                "unpriced_seconds": {c: secs(d.unpriced_us[c]) for c in CLASSES},
                "cost": {c: money(d.cost[c]) for c in CLASSES},
                "total_seconds": secs(d.total_us),
                "total_cost": money(d.total_cost),
                "serving_seconds": secs(d.serving_us),
                "serving_cost": money(d.serving_cost),
                "training_seconds": secs(d.training_us),
                "training_runs": d.training_runs,
                "training_stopped_by_failover": d.stopped_by_failover,
                "training_stopped_by_failover_seconds": secs(d.stopped_by_failover_us),
                "prices": [
                    {
                        "from": t.isoformat(),
                        "per_hour": p.per_hour if p else None,
                        "currency": p.currency if p else None,
                        "source": p.source if p else None,
                        "basis": p.basis if p else "",
                    }
                    for t, p in d.prices
                ],
            }
        return {
            "fleet": self.fleet,
            "since": self.since.isoformat(),
            "until": self.until.isoformat(),
            "currency": self.currency or None,
            "domains": domains,
            "failovers": [
                {
                    "op_id": f.op_id,
                    "source": f.source,
                    "target": f.target,
                    "reason": f.reason,
                    "requested_at": f.requested_at.isoformat(),
                    "outcome": f.outcome,
                    "seconds": f.seconds,
                }
                for f in self.failovers
            ],
            "tokens": {m: dict(t) for m, t in self.tokens.items()},
            "total_tokens": self.total_tokens,
            "unpriced_seconds": secs(self.unpriced_us),
            "complete": self.unpriced_us == 0,
            "cost": money(self.cost),
            "serving_cost": money(self.serving_cost),
            "ha_premium": money(self.ha_premium),
            "harvested": money(self.harvested),
            "net_cost": money(self.net_cost),
            "two_hot_replicas": money(self.two_hot_replicas),
            "difference": money(self.difference),
            "per_million_tokens": {
                "with_ha": money(self.per_million(self.cost)),
                "without_ha": money(self.per_million(self.serving_cost)),
                "net_of_training": money(self.per_million(self.net_cost)),
            },
            "problems": list(self.problems),
        }


# ------------------------------------------------------------------------------------- prices


@dataclass
class _Prices:
    """One domain's prices over time: the layout's steps, and SkyPilot's reported spans over them."""

    steps: list[tuple[datetime, Price | None]] = field(default_factory=list)
    spans: list[tuple[datetime, datetime, Price]] = field(default_factory=list)

    def at(self, t: datetime) -> Price | None:
        for start, end, reported in self.spans:
            if start <= t < end:
                return reported
        current: Price | None = None
        for when, declared in self.steps:
            if when <= t:
                current = declared
            else:
                break
        return current

    def cuts(self, a: datetime, b: datetime) -> list[datetime]:
        points = {a, b}
        for when, _ in self.steps:
            if a < when < b:
                points.add(when)
        for start, end, _ in self.spans:
            for p in (start, end):
                if a < p < b:
                    points.add(p)
        return sorted(points)


def _reported_price(cost: ev.ClusterCost, op_target: str) -> Price | None:
    if cost.seconds <= 0:
        return None
    try:
        total = Decimal(cost.total)
    except ArithmeticError:
        return None
    if not total.is_finite() or total < 0:
        return None
    per_hour = total * Decimal(3600) / Decimal(repr(cost.seconds))
    return Price(
        per_hour=amount(per_hour.quantize(Decimal("0.000001"), rounding=ROUND_HALF_UP)),
        currency=cost.currency,
        source=f"skypilot:{cost.cluster}",
        basis=f"{cost.total} over {cost.seconds:g} s",
    )


# ------------------------------------------------------------------------------------- the fold


@dataclass
class _Domain:
    spec: DomainSpec | None = None
    declared: bool = False
    host: bool = False  # a host exists (billable)
    unreachable: bool = False
    models: set[str] = field(default_factory=set)  # declared model ids
    state: dict[str, str] = field(default_factory=dict)  # model -> waking | up | lost
    running: dict[str, datetime] = field(default_factory=dict)  # training slot -> started at

    def klass(self, active: bool) -> str:
        if self.unreachable:
            return "unreachable"
        states = [self.state.get(m, "waking") for m in self.models]
        if "lost" in states:
            return "lost"
        if "waking" in states:
            return "waking"
        if active:
            return "active"
        return "standby_training" if self.running else "standby_idle"


def _us(a: datetime, b: datetime) -> int:
    return max(0, (b - a) // _US)


def account(records: Iterable[Record], fleet: str, *, since: datetime, until: datetime) -> Accounting:
    """The accounting of `fleet` over [since, until) from its records (any order; others' are skipped).

    Records on the wrong subject for their type (haru.core.authority) are not applied, as in every fold;
    each is named in `problems`."""
    out = Accounting(fleet=fleet, since=since, until=until)
    items: list[tuple[datetime, int, ev.Event]] = []
    for rec in records:
        stored = rec.event
        if stored is None or subjects.fleet_of(rec.subject) != fleet:
            continue
        why = authority.misplaced(rec.subject, stored)
        if why:
            out.problems.append(authority.anomaly(rec.seq, rec.subject, stored, why))
            continue
        items.append((stored.at, rec.seq, stored))
    items.sort(key=lambda x: (x[0], x[1]))
    fold = _Fold(out, _price_pass(items, out))
    for at, _seq, e in items:
        if at >= until:
            break
        fold.advance(at)
        fold.apply(at, e)
    return fold.close()


class _Fold:
    """The accounting's state between two events: each domain's class of billing, the operations in flight
    (to tell a failover's stopped training), the failovers seen and the active domain. `advance` bills the
    seconds since the last event at the classes they had; `apply` then takes the event."""

    def __init__(self, out: Accounting, prices: dict[str, _Prices]) -> None:
        self.out, self.prices = out, prices
        self.since, self.until = out.since, out.until
        self.domains: dict[str, _Domain] = {}
        self.ops: dict[str, tuple[str, str]] = {}  # op id -> (kind, target)
        self.failovers: dict[str, Failover] = {}
        self.active = ""
        self.last: datetime | None = None

    def advance(self, at: datetime) -> None:
        if self.last is not None:
            self._spend(self.last, at)
        self.last = at

    def close(self) -> Accounting:
        out, until = self.out, self.until
        if self.last is not None:
            self._spend(self.last, until)
        for name, dom in self.domains.items():  # training still running at the end of the period
            if name in out.domains:
                for started in dom.running.values():
                    out.domains[name].training_us += _us(max(started, self.since), until)
        for name, acct in out.domains.items():
            book = self.prices.get(name)
            if book is not None:
                acct.prices = _prices_in(book, self.since, until)
        out.failovers = sorted(self.failovers.values(), key=lambda f: f.requested_at)
        return out

    def _spend(self, a: datetime, b: datetime) -> None:
        """Bill [a, b) (clipped to the period) to each domain with a host, at its class and its prices."""
        out = self.out
        a, b = max(a, self.since), min(b, self.until)
        if a >= b:
            return
        for name, dom in self.domains.items():
            if not dom.host:
                continue
            acct, serving = out.domains[name], name == self.active
            cls = dom.klass(serving)
            book = self.prices.get(name) or _Prices()
            cuts = book.cuts(a, b)
            for x, y in zip(cuts, cuts[1:], strict=False):
                us = _us(x, y)
                price = book.at(x)
                acct.us[cls] += us
                if serving:
                    acct.serving_us += us
                if price is None or price.currency != out.currency:
                    acct.unpriced_us[cls] += us
                    if serving:
                        acct.serving_unpriced_us += us
                    continue
                money = money_of(us, price)
                acct.cost[cls] += money
                if serving:
                    acct.serving_cost += money

    def _domain(self, name: str) -> _Domain:
        return self.domains.setdefault(name, _Domain())

    def apply(self, at: datetime, e: ev.Event) -> None:
        if isinstance(e, (ev.DomainDeclared, ev.DomainChanged, ev.DomainRetired, ev.ModelDeclared, ev.ModelRetired)):
            self._declared(e)
        elif isinstance(e, ev.RESIDENCY_EVENTS):
            dom = self._domain(getattr(e, "domain", ""))
            if isinstance(e, _WAKING):
                dom.state[e.model] = "waking"
            elif isinstance(e, _LOST):
                dom.state[e.model] = "lost"
            elif isinstance(e, _UP):
                dom.state[e.model] = "up"
        elif isinstance(e, (ev.DomainUnreachable, ev.DomainReachable)):
            self._domain(e.domain).unreachable = isinstance(e, ev.DomainUnreachable)
        elif isinstance(e, ev.AgentStarted):
            dom = self._domain(e.domain)
            dom.unreachable = False
            if dom.declared:
                dom.host = True
        elif isinstance(e, (ev.TrainingStarted, ev.TrainingStopped)):
            self._training(at, e)
        elif isinstance(e, (ev.OperationRequested, ev.PromotionRetargeted, ev.OperationCompleted, ev.OperationAborted)):
            self._operation(at, e)
        elif isinstance(e, ev.StepCompleted) and e.step in ("launch", "down") and e.op_id in self.ops:
            dom = self._domain(self.ops[e.op_id][1])  # a provisioned host: billed from its launch to its down
            if e.step == "launch":
                dom.host = dom.declared
            else:
                dom.host, dom.unreachable, dom.state, dom.running = False, False, {}, {}
        elif isinstance(e, ev.RouteMoved):
            self.active = e.active
            if e.op_id in self.failovers and self.failovers[e.op_id].moved_at is None:
                self.failovers[e.op_id].moved_at = at
        elif isinstance(e, ev.TokensCounted) and self.since <= at:
            for m in e.models:
                t = self.out.tokens.setdefault(m.model, {"prompt": 0, "completion": 0, "responses": 0})
                t["prompt"] += m.prompt
                t["completion"] += m.completion
                t["responses"] += m.responses

    def _declared(self, e: ev.Event) -> None:
        if isinstance(e, (ev.DomainDeclared, ev.DomainChanged)):
            name = e.spec.name
            dom = self._domain(name)
            dom.spec, dom.declared = e.spec, True
            if e.spec.provider not in _CLOUD:
                dom.host = True
            acct = self.out.domains.setdefault(name, DomainAccount(domain=name))
            acct.region, acct.provider, acct.gpu_type = e.spec.region, e.spec.provider, _gpu_type(e.spec)
        elif isinstance(e, ev.DomainRetired):
            if e.domain in self.domains:
                self.domains[e.domain].host = False
                self.domains[e.domain].declared = False
        elif isinstance(e, ev.ModelDeclared):
            self._domain(e.domain).models.add(e.spec.name)
        elif isinstance(e, ev.ModelRetired):
            self._domain(e.domain).models.discard(e.model)

    def _training(self, at: datetime, e: ev.TrainingStarted | ev.TrainingStopped) -> None:
        dom, accounted = self._domain(e.domain), e.domain in self.out.domains
        if isinstance(e, ev.TrainingStarted):
            dom.running[e.slot] = at
            if self.since <= at and accounted:
                self.out.domains[e.domain].training_runs += 1
            return
        started = dom.running.pop(e.slot, None)
        if started is None or not accounted:
            return
        ran = _us(max(started, self.since), min(at, self.until))
        acct = self.out.domains[e.domain]
        acct.training_us += ran
        promoting = any(kind == "promotion" and target == e.domain for kind, target in self.ops.values())
        if promoting and self.since <= at:  # stopped to give its GPU to a promotion of its domain
            acct.stopped_by_failover += 1
            acct.stopped_by_failover_us += ran

    def _operation(
        self,
        at: datetime,
        e: ev.OperationRequested | ev.PromotionRetargeted | ev.OperationCompleted | ev.OperationAborted,
    ) -> None:
        ops, failovers = self.ops, self.failovers
        if isinstance(e, ev.OperationRequested):
            ops[e.op_id] = (e.kind, e.target)
            if isinstance(e, ev.PromotionRequested) and self.since <= at:
                failovers[e.op_id] = Failover(
                    op_id=e.op_id, source=e.source, target=e.target, reason=e.reason, requested_at=at
                )
        elif isinstance(e, ev.PromotionRetargeted):
            if e.op_id in ops:
                ops[e.op_id] = (ops[e.op_id][0], e.target)
            if e.op_id in failovers:
                failovers[e.op_id].target = e.target
        else:
            ops.pop(e.op_id, None)
            if e.op_id in failovers:
                f = failovers[e.op_id]
                f.outcome = "completed" if isinstance(e, ev.OperationCompleted) else "aborted"
                f.ended_at = at


def _price_pass(items: list[tuple[datetime, int, ev.Event]], out: Accounting) -> dict[str, _Prices]:
    """Every domain's prices over all time (a cost report recorded after the period still prices it),
    and the fleet's currency: its layout prices' (one per fleet), else SkyPilot's."""
    books: dict[str, _Prices] = {}
    ops: dict[str, str] = {}
    reported: list[tuple[str, datetime, datetime, Price]] = []
    for at, _seq, e in items:
        if isinstance(e, ev.PriceDeclared):
            books.setdefault(e.domain, _Prices()).steps.append((at, e.price))
            if e.price is not None and not out.currency:
                out.currency = e.price.currency
        elif isinstance(e, ev.OperationRequested):
            ops[e.op_id] = e.target
        elif isinstance(e, ev.StepCompleted) and e.step == "down" and e.costs and e.op_id in ops:
            for c in e.costs:
                price = _reported_price(c, ops[e.op_id])
                if price is None:
                    out.problems.append(
                        f"{ops[e.op_id]}: SkyPilot's cost report for {c.cluster} gave no duration: not priced by it"
                    )
                    continue
                start = at - timedelta(seconds=c.seconds)
                reported.append((ops[e.op_id], start, at, price))
    for domain, start, end, price in reported:
        if not out.currency:
            out.currency = price.currency
        if price.currency != out.currency:
            out.problems.append(
                f"{domain}: SkyPilot reported {price.source[9:]} in {price.currency}, the fleet is priced in "
                f"{out.currency}: the layout's price stands"
            )
            continue
        books.setdefault(domain, _Prices()).spans.append((start, end, price))
    return books


def _prices_in(book: _Prices, since: datetime, until: datetime) -> list[tuple[datetime, Price | None]]:
    out: list[tuple[datetime, Price | None]] = []
    for t in book.cuts(since, until)[:-1]:
        p = book.at(t)
        if not out or out[-1][1] != p:
            out.append((t, p))
    return out


def _gpu_type(spec: DomainSpec) -> str:
    names: dict[str, int] = {}
    for g in spec.gpus:
        names[g.name or "gpu"] = names.get(g.name or "gpu", 0) + 1
    return "+".join(f"{n}x{name}" if n > 1 else name for name, n in names.items())
