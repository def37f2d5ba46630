"""A simulated fleet set up for rolling changes, and `haru apply` run against it."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime

from haru.core import subjects
from haru.core.events import RollingRequested
from tests.support import haru
from tests.support.promoter import PromoterProcess, wait_view
from tests.support.sim_fleet import FLEET, Fleet, sim_layout, steady


def context_4096(d, ms) -> None:
    for m in ms:
        if m["name"] == "m2":
            m["context_length"] = 4096


@contextlib.asynccontextmanager
async def rolling_fleet(tmp_path, nats_server, event_log, *, step_delay_ms: int = 0):
    """Two domains a (active) and b (standby) whose agents follow the declarations, a projector, a gateway,
    and one `haru promoter` child process (`fleet.promoter`, to kill and start again)."""
    from haru.core.layout import load_layout
    from haru.gateway.config import GatewayConfig
    from haru.gateway.server import Gateway
    from haru.host.tasks import cancel_and_wait
    from haru.log.apply import apply
    from haru.projections.projector import Projector

    layout = sim_layout(tmp_path / "layout.json", tmp_path)
    await apply(event_log, load_layout(layout), datetime.now(UTC))
    projector = asyncio.create_task(Projector(event_log).run(), name="projector")
    promoter = PromoterProcess(
        nats_server.url,
        "promoter:rolling",
        env={"HARU_PROMOTER_STEP_DELAY_MS": str(step_delay_ms)},
        log_path=tmp_path / "promoter.log",
    )
    fleet = None
    try:
        promoter.start()
        async with Gateway(GatewayConfig(port=0), event_log) as gw:
            fleet = Fleet(tmp_path, nats_server.url, layout, gw, declared=True)
            fleet.promoter = promoter  # type: ignore[attr-defined]
            for d in ("a", "b"):
                fleet.start(d)
            await wait_view(event_log, steady, timeout=90, fleet=FLEET, what="a active and resident, b a standby")
            yield fleet
    finally:
        promoter.kill()
        if fleet is not None:
            await fleet.stop()
        await cancel_and_wait(projector)


async def apply_cli(nats_url: str, layout, *extra: str):
    return await asyncio.to_thread(haru, "apply", "-f", str(layout), *extra, nats_url=nats_url, timeout=60)


async def rolling_op_id(event_log) -> str:
    for rec in reversed(await event_log.history(subjects.op(FLEET))):
        if isinstance(rec.event, RollingRequested):
            return rec.event.op_id
    raise AssertionError("no rolling_requested on the op subject")
