"""Prices as data: what a domain's host costs an hour, in which currency, and who said so.

A price is declared in the layout (a domain's own `price`, or the fleet's `gpu_prices` by GPU name,
summed over the domain's GPUs) and recorded on the fleet's decl subject as `price_declared`, so a past
period is priced at the prices of that period. A provisioned domain's price also comes from SkyPilot's
cost report, read when its cluster is torn down (`step_completed.costs` of the `down` step): that price
covers the cluster's life and, over that life, overrides the layout's (docs/cost.md).

Amounts are decimal strings (`"2.49"`), never floats, so a period's cost is exact to the cent.
Pure: no I/O. Every error is a `LayoutError` with the JSON path and the fix.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

import msgspec

from haru.core.errors import LayoutError

__all__ = ["Amount", "Currency", "Price", "amount", "layout_prices", "price_at_path", "LAYOUT_SOURCE"]

Amount = Annotated[str, msgspec.Meta(pattern=r"^[0-9]+(\.[0-9]+)?$")]
"""A non-negative decimal amount as text: `"2.49"`, `"0"`, `"1200.5"`."""

Currency = Annotated[str, msgspec.Meta(pattern=r"^[A-Z]{3}$")]
"""An ISO 4217 currency code: three capital letters (`USD`, `EUR`, `JPY`)."""

LAYOUT_SOURCE = "layout"

_CURRENCY = re.compile(r"[A-Z]{3}")
_PRICE_KEYS = ("per_hour", "currency")


class Price(msgspec.Struct, frozen=True, kw_only=True):
    """One domain's hourly price. `source`: `layout`, or `skypilot:<cluster>` for a cost report;
    `basis` says how it was made (`2 x L4 at 0.80`), '' when declared for the domain as a whole."""

    per_hour: Amount
    currency: Currency
    source: str = LAYOUT_SOURCE
    basis: str = ""

    @property
    def hourly(self) -> Decimal:
        return Decimal(self.per_hour)


def amount(value: Decimal) -> str:
    """A Decimal as `Amount` text: no exponent, no trailing zeros past the point (`2.5`, `0`, `12`)."""
    text = format(value.normalize(), "f")
    return text if text not in ("-0", "") else "0"


def price_at_path(raw: object, path: str) -> Price:
    """A price as a layout writes it, `{"per_hour": 2.49, "currency": "USD"}` (per_hour a number or a
    decimal string), checked: a JSON object with those two keys, a non-negative amount, an ISO 4217 code."""
    if not isinstance(raw, dict):
        raise LayoutError(
            f"a price must be a JSON object, got {type(raw).__name__}",
            path=path,
            fix='write it as {"per_hour": 2.49, "currency": "USD"}',
        )
    for key in raw:
        if isinstance(key, str) and key.startswith("_"):
            continue
        if key not in _PRICE_KEYS:
            raise LayoutError(
                f"unknown key {key!r} in a price",
                path=f"{path}.{key}",
                fix="a price has per_hour and currency (keys starting with '_' are comments)",
            )
    per_hour: Any = raw.get("per_hour")
    if per_hour is None or isinstance(per_hour, bool) or not isinstance(per_hour, (int, float, str)):
        raise LayoutError(
            f"per_hour is {per_hour!r}, not an amount",
            path=f"{path}.per_hour",
            fix='write what an hour of this host costs, e.g. 2.49 or "2.49"',
        )
    try:
        value = Decimal(str(per_hour).strip())
    except InvalidOperation:
        value = Decimal("NaN")
    if not value.is_finite():
        raise LayoutError(
            f"per_hour {per_hour!r} is not a number",
            path=f"{path}.per_hour",
            fix='write a decimal amount, e.g. 2.49 or "2.49"',
        )
    if value < 0:
        raise LayoutError(
            f"per_hour {per_hour!r} is negative",
            path=f"{path}.per_hour",
            fix="a price is what an hour costs: write 0 or more (a credit is not a price)",
        )
    currency = raw.get("currency")
    if not isinstance(currency, str) or not _CURRENCY.fullmatch(currency):
        hint = currency.upper() if isinstance(currency, str) and _CURRENCY.fullmatch(currency.upper()) else ""
        raise LayoutError(
            f"currency {currency!r} is not an ISO 4217 code",
            path=f"{path}.currency",
            fix=(f"did you mean {hint!r}? " if hint else "") + "write three capital letters, e.g. USD, EUR or JPY",
        )
    return Price(per_hour=amount(value), currency=currency)


def layout_prices(
    own: dict[str, tuple[object, str]],
    gpu_prices: dict[str, object],
    gpus: dict[str, list[str]],
) -> dict[str, Price]:
    """Each domain's price from a layout: its own (`own`: domain -> (raw price, its JSON path)), else
    the sum of its GPUs' prices by name (`gpu_prices`: GPU name -> raw price, at `$.gpu_prices.<name>`;
    `gpus`: domain -> its GPUs' names), else none (the domain is unpriced: its hours are reported as
    such, never as costing zero). One currency per fleet."""
    by_name = {name: price_at_path(raw, f"$.gpu_prices.{name}") for name, raw in gpu_prices.items()}
    out: dict[str, Price] = {}
    where: dict[str, str] = {}
    for domain, names in gpus.items():
        if domain in own:
            raw, path = own[domain]
            out[domain] = price_at_path(raw, path)
            where[domain] = path
            continue
        priced = [n for n in names if n in by_name]
        if not priced:
            continue
        if len(priced) != len(names):
            missing = sorted({n or "(unnamed)" for n in names if n not in by_name})
            raise LayoutError(
                f"domain {domain!r} has GPUs priced by gpu_prices and GPUs that are not ({', '.join(missing)})",
                path="$.gpu_prices",
                fix=f"price every GPU name of {domain!r} in gpu_prices, or give the domain its own "
                '"price": {"per_hour": ..., "currency": ...}',
            )
        currencies = {by_name[n].currency for n in priced}
        if len(currencies) > 1:
            raise LayoutError(
                f"domain {domain!r}'s GPUs are priced in {', '.join(sorted(currencies))}",
                path="$.gpu_prices",
                fix="price every GPU of a fleet in one currency",
            )
        total = sum((by_name[n].hourly for n in priced), Decimal(0))
        counts: dict[str, int] = {}
        for n in priced:
            counts[n] = counts.get(n, 0) + 1
        basis = " + ".join(f"{c} x {n} at {by_name[n].per_hour}" for n, c in counts.items())
        out[domain] = Price(per_hour=amount(total), currency=currencies.pop(), basis=basis)
        where[domain] = "$.gpu_prices"
    currencies = {p.currency for p in out.values()}
    if len(currencies) > 1:
        listing = ", ".join(f"{d} in {p.currency} ({where[d]})" for d, p in out.items())
        raise LayoutError(
            f"the fleet's prices are in {len(currencies)} currencies: {listing}",
            path=next(where[d] for d, p in out.items() if p.currency != next(iter(out.values())).currency),
            fix="price every domain of a fleet in one currency (convert the others at the rate you are billed), "
            "so its cost adds up",
        )
    return out
