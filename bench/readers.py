"""How fast nats-py can hand the stored events to Python, two ways, with a callback that only counts: the
ordered consumer (what `EventLog.replay` reads with, and bench/projector.py's baseline) against a plain
push consumer (ack none, no flow control) read by a core subscription, which skips nats-py's
ordered-consumer bookkeeping per message (the reply subject's metadata parsed, sequence tracking).
Same server, same stream (bench/projector.py's history), 4 rounds alternating; best of each printed.
It measures what a leaner reader could save a rebuild (docs/performance.md, "The projector's rebuild").

    flock /tmp/haru-cpu.lock .venv/bin/python bench/readers.py [EVENTS]
"""

import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from nats.js import api
from projector import history, load

from haru.core import subjects as sj
from haru.host.natsd import NatsServer
from haru.log.eventlog import EventLog


async def ordered(log, last):
    done = asyncio.get_running_loop().create_future()
    n = 0

    async def cb(msg):
        nonlocal n
        n += 1
        if n >= last and not done.done():
            done.set_result(None)

    t0 = time.perf_counter()
    sub = await log.js.subscribe(
        sj.ALL_EVENTS,
        cb=cb,
        stream=sj.EVENTS_STREAM,
        ordered_consumer=True,
        deliver_policy=api.DeliverPolicy.ALL,
        pending_msgs_limit=-1,
        pending_bytes_limit=-1,
    )
    await done
    dt = time.perf_counter() - t0
    await sub.unsubscribe()
    return dt


async def plain(log, last):
    nc = log.nc
    done = asyncio.get_running_loop().create_future()
    n = 0

    async def cb(msg):
        nonlocal n
        n += 1
        if n >= last and not done.done():
            done.set_result(None)

    inbox = nc.new_inbox()
    t0 = time.perf_counter()
    sub = await nc.subscribe(inbox, cb=cb, pending_msgs_limit=-1, pending_bytes_limit=-1)
    info = await log.js.add_consumer(
        sj.EVENTS_STREAM,
        api.ConsumerConfig(
            deliver_subject=inbox,
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.ALL,
            filter_subject=sj.ALL_EVENTS,
            mem_storage=True,
            inactive_threshold=5.0,
        ),
    )
    try:
        await asyncio.wait_for(done, 30)
    except TimeoutError:
        print("plain: got", n, "of", last)
        raise
    dt = time.perf_counter() - t0
    await sub.unsubscribe()
    await log.js.delete_consumer(sj.EVENTS_STREAM, info.name)
    return dt


async def main():
    bodies = history(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000)
    with tempfile.TemporaryDirectory() as tmp:
        async with NatsServer(Path(tmp)) as server:
            async with EventLog.connect([server.url], writer="bench") as log:
                await log.ensure()
                last = await load(log, bodies)
                res = {"ordered": [], "plain": []}
                for r in range(4):
                    for name, f in (
                        (("ordered", ordered), ("plain", plain)) if r % 2 else (("plain", plain), ("ordered", ordered))
                    ):
                        res[name].append(await f(log, last))
                for k, v in res.items():
                    print(
                        f"{k:8s} best {min(v):.3f} s ({min(v) / last * 1e6:.2f} "
                        f"us/event), all {' '.join(f'{x:.2f}' for x in v)}"
                    )


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())
