"""Event log benchmark: Haru's EventLog against raw nats-py, side by side, on one nats-server.

    .venv/bin/python bench/eventlog.py [--n 5000] [--replay 100000]

Prints three ratios (higher is better; 1.0 = as fast as the raw baseline):
  1. sequential EventLog.append (expected-sequence check + hash chain + Msg-Id) vs awaited js.publish
     target >= 0.9x
  2. pipelined appends across distinct subjects vs raw publish_async                     target >= 0.5x
  3. replay + decode of N events vs a raw ordered-consumer drain of the same stream       target >= 0.7x
Each pair alternates and the best of several rounds is kept: the machine is noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nats.js import api  # noqa: E402

from haru import events as ev  # noqa: E402
from haru import subjects  # noqa: E402
from haru.eventlog import EventLog, _parse_ack_reply  # noqa: E402
from haru.natsd import NatsServer  # noqa: E402

NOW = datetime.now(timezone.utc)


def event(i: int) -> ev.ModelResident:
    return ev.ModelResident(at=NOW, domain="a", model=f"m{i}", endpoint="127.0.0.1:18080", warmup_ms=i, by="bench")


async def seq_haru(log: EventLog, n: int, tag: str) -> float:
    subject = subjects.model("bench", "a", f"seq-{tag}")
    seq = 0
    t = time.perf_counter()
    for i in range(n):
        seq = await log.append(subject, event(i), expect=seq)
    return n / (time.perf_counter() - t)


async def seq_raw(log: EventLog, n: int, tag: str) -> float:
    subject = subjects.model("bench", "a", f"raw-{tag}")
    body = ev.encode(event(0))
    t = time.perf_counter()
    for _ in range(n):
        await log.js.publish(subject, body)
    return n / (time.perf_counter() - t)


async def seq_raw_headers(log: EventLog, n: int, tag: str) -> float:
    """Raw js.publish carrying the two headers every append must carry (expected sequence, Msg-Id).
    Not a target: it shows what the server's two checks cost before any Python of ours runs."""
    subject = subjects.model("bench", "a", f"rawh-{tag}")
    body = ev.encode(event(0))
    seq = 0
    t = time.perf_counter()
    for i in range(n):
        ack = await log.js.publish(subject, body, headers={
            "Nats-Expected-Last-Subject-Sequence": str(seq), "Nats-Msg-Id": f"{tag}-{i}"})
        seq = ack.seq
    return n / (time.perf_counter() - t)


async def pipe_haru(log: EventLog, n: int, tag: str) -> float:
    t = time.perf_counter()
    await asyncio.gather(*(log.append(subjects.model("bench", "p", f"h{tag}-{i}"), event(i), expect=0) for i in range(n)))
    return n / (time.perf_counter() - t)


async def pipe_raw(log: EventLog, n: int, tag: str) -> float:
    body = ev.encode(event(0))
    t = time.perf_counter()
    futures = [await log.js.publish_async(subjects.model("bench", "p", f"r{tag}-{i}"), body) for i in range(n)]
    await asyncio.wait_for(asyncio.gather(*futures), 60)
    return n / (time.perf_counter() - t)


async def replay_haru(log: EventLog, subject_filter: str) -> float:
    count = 0

    def handle(rec) -> None:
        nonlocal count
        count += 1

    t = time.perf_counter()
    await log.replay(handle, subject_filter=subject_filter, headers=False)
    return count / (time.perf_counter() - t)


async def replay_raw(log: EventLog, subject_filter: str, total: int) -> float:
    done = asyncio.Event()
    count = 0

    async def cb(msg) -> None:
        nonlocal count
        count += 1
        if _parse_ack_reply(msg.reply)[2] == 0:
            done.set()

    t = time.perf_counter()
    sub = await log.js.subscribe(subject_filter, cb=cb, stream=subjects.EVENTS_STREAM, ordered_consumer=True,
                                 deliver_policy=api.DeliverPolicy.ALL, pending_msgs_limit=-1, pending_bytes_limit=-1)
    await asyncio.wait_for(done.wait(), 120)
    rate = count / (time.perf_counter() - t)
    await sub.unsubscribe()
    return rate


def line(name: str, ours: float, base: float, target: float) -> None:
    ratio = ours / base
    verdict = "meets" if ratio >= target else "BELOW"
    print(f"{name:<52} {ours:>10,.0f}/s vs {base:>10,.0f}/s  = {ratio:4.2f}x  (target >= {target}x: {verdict})")


async def main(n: int, n_replay: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with NatsServer(tmp) as server:
            async with EventLog.connect([server.url], writer="bench") as log:
                await log.ensure()
                best = {k: 0.0 for k in ("sh", "sr", "srh", "ph", "pr", "rh", "rr")}
                for r in range(rounds):
                    best["sr"] = max(best["sr"], await seq_raw(log, n, str(r)))
                    best["srh"] = max(best["srh"], await seq_raw_headers(log, n, str(r)))
                    best["sh"] = max(best["sh"], await seq_haru(log, n, str(r)))
                    best["pr"] = max(best["pr"], await pipe_raw(log, n, str(r)))
                    best["ph"] = max(best["ph"], await pipe_haru(log, n, str(r)))
                # a stream of n_replay valid events for the replay comparison
                body_futs = []
                for i in range(n_replay):
                    body_futs.append(await log.js.publish_async(
                        subjects.model("replay", "a", f"m{i % 500}"), ev.encode(event(i))))
                await asyncio.wait_for(asyncio.gather(*body_futs), 120)
                for _ in range(rounds):
                    best["rr"] = max(best["rr"], await replay_raw(log, "haru.evt.replay.>", n_replay))
                    best["rh"] = max(best["rh"], await replay_haru(log, "haru.evt.replay.>"))
    print(f"event log benchmark: {n} appends per round, {n_replay} events replayed, best of {rounds} rounds")
    line("1. sequential append (CAS + chain) vs js.publish", best["sh"], best["sr"], 0.9)
    print(f"   of which the server's checks: js.publish with the same two headers = {best['srh'] / best['sr']:4.2f}x; "
          f"append vs that = {best['sh'] / best['srh']:4.2f}x")
    line("2. pipelined appends, distinct subjects vs publish_async", best["ph"], best["pr"], 0.5)
    line("3. replay + decode vs raw ordered-consumer drain", best["rh"], best["rr"], 0.7)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=3000)
    p.add_argument("--replay", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    asyncio.run(main(a.n, a.replay, a.rounds))
