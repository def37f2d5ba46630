"""Hearing the route followers' reports (haru.router.<fleet>.<router>, core NATS): for `haru status` and
the gateway's console. The promoter keeps its own book (haru.promoter.router_acks).

    book = await ask_routers(bus, fleet, wait_s)    # ask every follower of `fleet` to report now; what came back
    reports = RouterReports(); await reports.listen(bus)   # every fleet's, kept as heard (the console)
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from haru.core import router_acks as acks
from haru.core import subjects
from haru.log.bus import Bus, Msg, Subscription

__all__ = ["RouterReports", "ask_routers"]


class RouterReports:
    """Every fleet's router reports, as heard: `books[fleet][router]`."""

    def __init__(self) -> None:
        self.books: dict[str, dict[str, acks.Heard]] = {}
        self.misplaced = 0

    def on_report(self, msg: Msg) -> None:
        heard = subjects.router_report_of(msg.subject)
        if heard is None:
            return
        fleet, router = heard
        try:
            report = acks.report_decoder.decode(msg.data)
        except msgspec.DecodeError:
            self.misplaced += 1
            return
        book, why = acks.heard(self.books.get(fleet, {}), fleet, router, report, time.monotonic())
        if why:
            self.misplaced += 1
            return
        self.books[fleet] = book

    async def listen(self, bus: Bus, fleet: str = "*") -> Subscription:
        return await bus.subscribe(
            subjects.ALL_ROUTER_REPORTS if fleet == "*" else subjects.router_report(fleet), self.on_report
        )

    def lag(self, fleet: str, revision: int) -> list[acks.Lag]:
        return acks.lag(self.books.get(fleet, {}), revision, time.monotonic())


async def ask_routers(bus: Bus, fleet: str, wait_s: float) -> RouterReports:
    """Ask `fleet`'s route followers to report now, and hear them for `wait_s` seconds."""
    reports = RouterReports()
    sub = await reports.listen(bus, fleet)
    try:
        await bus.publish(subjects.routers_ask(fleet), b"")
        await asyncio.sleep(wait_s)
    finally:
        await sub.unsubscribe()
    return reports
