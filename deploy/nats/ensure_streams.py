#!/usr/bin/env python3
"""Create (or check) Haru's streams on a NATS cluster as R3, once, with the admin user.

    python deploy/nats/ensure_streams.py --nats-url nats://admin:PASSWORD@nats-1:4222,nats://admin:PASSWORD@nats-2:4222,...

The control-plane users may not create, update, purge or delete streams (deploy/nats/accounts.conf), so
an admin creates HARU_EVENTS, HARU_ROUTE, the KV bucket haru_views and the object stores haru_adapters and
haru_checkpoints (trained adapters, training checkpoints) before the first service starts:
this is `EventLog.ensure(replicas=3)`. Run it before anything else on a new cluster: `haru apply`
and `haru up` also ensure the streams, with replicas 1, when their user is allowed to create them.
It waits (bounded by --wait) for the cluster to elect its JetStream meta leader, and exits 0 when
all of them exist with the requested replicas, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time


async def ensure(urls: list[str], replicas: int, wait: float, creds: str | None) -> int:
    from haru.core import subjects
    from haru.core.errors import LogError, LogUnavailable
    from haru.log.eventlog import EventLog

    deadline = time.monotonic() + wait
    async with EventLog.connect(urls, writer="deploy:ensure_streams", creds=creds) as log:
        while True:
            try:
                await log.ensure(replicas=replicas)
                break
            except (LogUnavailable, LogError) as exc:
                if time.monotonic() > deadline:
                    print(f"ensure_streams: {exc}", file=sys.stderr)
                    return 1
                await asyncio.sleep(0.5)
        status = 0
        for stream in (
            subjects.EVENTS_STREAM,
            subjects.ROUTE_STREAM,
            "KV_" + subjects.VIEWS_BUCKET,
            "OBJ_" + subjects.ADAPTERS_BUCKET,
            "OBJ_" + subjects.CHECKPOINTS_BUCKET,
        ):
            info = await log.js.stream_info(stream)
            have = info.config.num_replicas or 1
            peers = [info.cluster.leader] + [p.name for p in (info.cluster.replicas or [])] if info.cluster else []
            print(
                f"{stream}: replicas {have}, messages {info.state.messages}, peers {', '.join(p for p in peers if p)}"
            )
            if have != replicas:
                print(
                    f"  {stream} exists with {have} replicas, not {replicas}: change it with "
                    f"`nats stream edit {stream} --replicas {replicas}` (an operator's decision)",
                    file=sys.stderr,
                )
                status = 1
        return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--nats-url",
        default=os.environ.get("HARU_NATS_URL"),
        required=not os.environ.get("HARU_NATS_URL"),
        help="the admin user's URLs, comma-separated (env HARU_NATS_URL)",
    )
    p.add_argument("--nats-creds", default=os.environ.get("HARU_NATS_CREDS"), help="a .creds file (JWT mode)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--wait", type=float, default=30.0, help="seconds to wait for JetStream to be ready")
    args = p.parse_args(argv)
    urls = [u.strip() for u in args.nats_url.split(",") if u.strip()]
    return asyncio.run(ensure(urls, args.replicas, args.wait, args.nats_creds))


if __name__ == "__main__":
    raise SystemExit(main())
