"""The read model's cost tables and views (migration 6): the scripted day (tests/support/cost_day.py)
appended to a real log and written by the sink; each view's answer worked out by hand from the day."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import asyncpg
import pytest

from haru.projections.postgres import PostgresSink
from tests.support import cost_day as day

pytestmark = pytest.mark.postgres


async def test_the_cost_views_over_the_scripted_day(event_log, nats_server, pg_dsn):
    await day.append_script(event_log)
    await PostgresSink(pg_dsn, [nats_server.url], retry=False, batch_size=7).run(follow=False)
    conn = await asyncpg.connect(pg_dsn)
    try:
        periods = [
            tuple(r)
            for r in await conn.fetch(
                "SELECT domain, per_hour, currency, valid_from, valid_until FROM haru.price_periods "
                "WHERE fleet = 'day' ORDER BY domain, valid_from"
            )
        ]
        tokens = [tuple(r) for r in await conn.fetch("SELECT model, day, tokens, responses FROM haru.tokens_per_day")]
        failovers = [
            tuple(r)
            for r in await conn.fetch(
                "SELECT op_id, source, target, reason, outcome, seconds, target_per_hour, currency "
                "FROM haru.failover_costs WHERE fleet = 'day' ORDER BY requested_at"
            )
        ]
    finally:
        await conn.close()
    assert periods == [
        ("a", Decimal("2"), "USD", day.t("00:00:00"), day.t("06:00:00")),
        ("a", Decimal("2.5"), "USD", day.t("06:00:00"), None),
        ("b", Decimal("3"), "USD", day.t("00:00:00"), None),
    ]
    assert tokens == [("m1", day.DAY.replace(tzinfo=None), day.TOKENS, 4000)]
    # f1: requested 08:00:10, completed 08:00:21; f2: 12:00:05 -> 12:00:13 (the request to the operation's end)
    assert failovers == [
        ("f1", "a", "b", "gpu_detached", "completed", Decimal("11.0000000000000000"), Decimal("3"), "USD"),
        ("f2", "b", "a", "domain_unreachable", "completed", Decimal("8.0000000000000000"), Decimal("2.5"), "USD"),
    ]
    assert timedelta(seconds=11) == day.t("08:00:21") - day.t("08:00:10")
