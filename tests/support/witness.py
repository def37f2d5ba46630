"""A writer that remembers what it was acknowledged, for the region scenarios' history checker.

    python -m tests.support.witness --nats-url URL[,URL...] --fleet NAME --out FILE [--every 0.1]

Appends a `fleet_declared` to `haru.evt.<NAME>.decl` every `--every` seconds with the subject's expected
sequence, retrying the same event (same body, same Msg-Id) while the log is unreachable, as an agent
does; after each acknowledgement it writes `<seq> <at>` as one line to FILE and flushes. The checker then
asks the log for every line: an acknowledged append that is not there was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from datetime import UTC, datetime

from haru.core import subjects
from haru.core.errors import Conflict, LogError, LogUnavailable
from haru.core.events import FleetDeclared
from haru.core.specs import Policy
from haru.log.eventlog import EventLog


async def main(urls: list[str], fleet: str, out: str, every: float) -> None:
    subject = subjects.decl(fleet)
    async with EventLog.connect(urls, writer=f"witness:{fleet}", timeout=2.0) as log:
        expect = None
        with open(out, "a", buffering=1) as f:
            while True:
                event = FleetDeclared(at=datetime.now(UTC), by=f"witness:{fleet}", fleet=fleet, policy=Policy())
                while True:
                    try:
                        if expect is None:
                            expect = await log.last_seq_of(subject)
                        seq = await log.append(subject, event, expect=expect)
                        break
                    except Conflict as exc:
                        expect = exc.current
                    except (LogUnavailable, LogError):
                        await asyncio.sleep(0.2)
                expect = seq
                f.write(f"{seq} {event.at.isoformat()}\n")
                os.fsync(f.fileno())
                await asyncio.sleep(every)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--nats-url", required=True)
    p.add_argument("--fleet", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--every", type=float, default=0.1)
    a = p.parse_args()
    asyncio.run(main([u for u in a.nats_url.split(",") if u], a.fleet, a.out, a.every))
