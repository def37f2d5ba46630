"""Event log benchmark: Haru's EventLog against raw nats-py, side by side, on one nats-server.

    .venv/bin/python bench/eventlog.py [--n 6000] [--pairs 20] [--replay 100000]

Prints three ratios (higher is better; 1.0 = as fast as the raw baseline):
  1. sequential EventLog.append (expected-sequence check + hash chain + Msg-Id) vs awaited js.publish
     target >= 0.9x
  2. pipelined appends across distinct subjects vs raw publish_async                     target >= 0.5x
  3. replay + decode of N events vs a raw ordered-consumer drain of the same stream       target >= 0.7x
and what durability costs (no target: the price of `sync_interval: always`, the shipped setting, against
nats-server's default 2 min fsync, two servers side by side on the same disk, alternating slices):
  4. sequential appends, pipelined appends, and the ack latency p50/p99 of a sequential append
  5. the same on two of the shipped three-node clusters (deploy/nats, R3 streams), side by side
    .venv/bin/python bench/eventlog.py --only durability
The machine is noisy, so appends are compared in alternating slices (who goes first alternates
too) and the median of the per-slice ratios is printed with the median rates; replay keeps the best
of several rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nats.js import api

from haru.core import events as ev
from haru.core import subjects
from haru.host.natsd import NatsServer
from haru.log.eventlog import EventLog
from haru.log.jetstream import parse_ack_reply

NOW = datetime.now(UTC)


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
        ack = await log.js.publish(
            subject, body, headers={"Nats-Expected-Last-Subject-Sequence": str(seq), "Nats-Msg-Id": f"{tag}-{i}"}
        )
        seq = ack.seq
    return n / (time.perf_counter() - t)


async def pipe_haru(log: EventLog, n: int, tag: str) -> float:
    t = time.perf_counter()
    await asyncio.gather(
        *(log.append(subjects.model("bench", "p", f"h{tag}-{i}"), event(i), expect=0) for i in range(n))
    )
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
        if parse_ack_reply(msg.reply)[2] == 0:
            done.set()

    t = time.perf_counter()
    sub = await log.js.subscribe(
        subject_filter,
        cb=cb,
        stream=subjects.EVENTS_STREAM,
        ordered_consumer=True,
        deliver_policy=api.DeliverPolicy.ALL,
        pending_msgs_limit=-1,
        pending_bytes_limit=-1,
    )
    await asyncio.wait_for(done.wait(), 120)
    rate = count / (time.perf_counter() - t)
    await sub.unsubscribe()
    return rate


def line(name: str, ours: float, base: float, target: float, ratio: float | None = None) -> None:
    """One result; `ratio` is the median of paired slices when there is one, else ours / base."""
    ratio = ours / base if ratio is None else ratio
    verdict = "meets" if ratio >= target else "BELOW"
    print(f"{name:<52} {ours:>10,.0f}/s vs {base:>10,.0f}/s  = {ratio:4.2f}x  (target >= {target}x: {verdict})")


async def paired(a, b, log: EventLog, n: int, pairs: int, tag: str) -> tuple[float, float, float]:
    """Run `a` and `b` in `pairs` alternating slices of n // pairs operations each (who goes first
    alternates too), so both see the same machine: a slow second on this noisy 2-core box lands on
    one slice pair, not on one side. Returns (a's rate, b's rate, median of the per-pair ratios a/b)."""
    m = max(1, n // pairs)
    rates_a, rates_b, ratios = [], [], []
    for k in range(pairs):
        if k % 2:
            rb = await b(log, m, f"{tag}-{k}")
            ra = await a(log, m, f"{tag}-{k}")
        else:
            ra = await a(log, m, f"{tag}-{k}")
            rb = await b(log, m, f"{tag}-{k}")
        rates_a.append(ra)
        rates_b.append(rb)
        ratios.append(ra / rb)
    return statistics.median(rates_a), statistics.median(rates_b), statistics.median(ratios)


async def seq_timed(log: EventLog, n: int, tag: str) -> list[float]:
    """n sequential appends on one subject; each one's ack latency in ms."""
    subject = subjects.model("bench", "d", f"dur-{tag}")
    seq, took = 0, []
    for i in range(n):
        t = time.perf_counter()
        seq = await log.append(subject, event(i), expect=seq)
        took.append((time.perf_counter() - t) * 1000)
    return took


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def durability(n: int, pairs: int) -> None:
    """The shipped `sync_interval: always` against nats-server's default, in one run on one disk."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("HARU_BENCH_DIR")) as tmp:
        async with (
            NatsServer(Path(tmp) / "always") as always_server,
            NatsServer(Path(tmp) / "default", sync_interval=None) as default_server,
            EventLog.connect([always_server.url], writer="bench") as always,
            EventLog.connect([default_server.url], writer="bench") as default,
        ):
            await always.ensure()
            await default.ensure()
            await compare_durability(always, default, n, pairs, "single node", "4")


async def durability_r3(n: int, pairs: int) -> None:
    """The same on two of the shipped three-node clusters (deploy/nats, R3 streams), one with the shipped
    setting and one with the default, six nats-servers on one disk side by side."""
    from tests.support.cluster import Cluster, ensure_r3
    from tests.support.powerloss import default_fsync

    with tempfile.TemporaryDirectory(dir=os.environ.get("HARU_BENCH_DIR")) as tmp:
        clusters = {"always": Cluster(Path(tmp) / "always"), "default": default_fsync(Cluster(Path(tmp) / "default"))}
        try:
            for c in clusters.values():
                c.start()
                await ensure_r3(c)
            async with (
                clusters["always"].log("admin", "bench") as always,
                clusters["default"].log("admin", "bench") as default,
            ):
                await compare_durability(always, default, n, pairs, "3-node cluster, R3", "5")
        finally:
            for c in clusters.values():
                c.stop()


async def compare_durability(always: EventLog, default: EventLog, n: int, pairs: int, what: str, row: str) -> None:
    lat: dict[str, list[float]] = {"always": [], "default": []}
    seq_rates: dict[str, list[float]] = {"always": [], "default": []}
    pipe_rates: dict[str, list[float]] = {"always": [], "default": []}
    m = max(1, n // pairs)
    for k in range(pairs):
        order = [("always", always), ("default", default)]
        for name, log in order if k % 2 == 0 else order[::-1]:
            t = time.perf_counter()
            lat[name] += await seq_timed(log, m, f"{name}-{k}")
            seq_rates[name].append(m / (time.perf_counter() - t))
            pipe_rates[name].append(await pipe_haru(log, m, f"{name}-{k}"))
    med = {k: statistics.median(v) for k, v in seq_rates.items()}
    pipe = {k: statistics.median(v) for k, v in pipe_rates.items()}
    print(f"durability: sync_interval always (shipped) vs nats-server's default (2 min), {what}, {pairs} slices")
    rate_row(f"{row}a. sequential appends", med["always"], med["default"])
    rate_row(f"{row}b. pipelined appends", pipe["always"], pipe["default"])
    for q, label in ((0.5, "p50"), (0.99, "p99")):
        a, d = pct(lat["always"], q), pct(lat["default"], q)
        print(
            f"{row}c. ack latency {label:<8} always {a:>8.2f} ms vs default {d:>8.2f} ms  = {a / d:5.2f}x the default's"
        )


def rate_row(name: str, always: float, default: float) -> None:
    print(f"{name:<24} always {always:>9,.0f}/s vs default {default:>9,.0f}/s  = {always / default:4.2f}x")


async def main(n: int, n_replay: int, rounds: int, pairs: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with NatsServer(tmp) as server:
            async with EventLog.connect([server.url], writer="bench") as log:
                await log.ensure()
                await seq_haru(log, 200, "warm")
                await seq_raw(log, 200, "warm")
                sh, sr, seq_ratio = await paired(seq_haru, seq_raw, log, n, pairs, "s")
                srh, sr2, hdr_ratio = await paired(seq_raw_headers, seq_raw, log, n, pairs, "h")
                ph, pr, pipe_ratio = await paired(pipe_haru, pipe_raw, log, n * rounds, rounds * 3, "p")
                # a stream of n_replay valid events for the replay comparison
                body_futs = []
                for i in range(n_replay):
                    body_futs.append(
                        await log.js.publish_async(subjects.model("replay", "a", f"m{i % 500}"), ev.encode(event(i)))
                    )
                await asyncio.wait_for(asyncio.gather(*body_futs), 120)
                rh = rr = 0.0
                for _ in range(rounds):
                    rr = max(rr, await replay_raw(log, "haru.evt.replay.>", n_replay))
                    rh = max(rh, await replay_haru(log, "haru.evt.replay.>"))
    print(
        f"event log benchmark: {n} sequential appends in {pairs} alternating slices, "
        f"{n * rounds} pipelined in {rounds * 3}, {n_replay} events replayed (best of {rounds} rounds)"
    )
    line("1. sequential append (CAS + chain) vs js.publish", sh, sr, 0.9, seq_ratio)
    print(
        f"   of which the server's checks: js.publish with the same two headers = {hdr_ratio:4.2f}x "
        f"({srh:,.0f}/s vs {sr2:,.0f}/s)"
    )
    line("2. pipelined appends, distinct subjects vs publish_async", ph, pr, 0.5, pipe_ratio)
    line("3. replay + decode vs raw ordered-consumer drain", rh, rr, 0.7)
    await durability(n // 2, pairs)
    await durability_r3(n // 4, pairs)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=6000)
    p.add_argument("--replay", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pairs", type=int, default=20, help="alternating slices for the sequential comparison")
    p.add_argument("--only", choices=["durability"], help="run only the durability comparison")
    a = p.parse_args()
    if a.only == "durability":

        async def both() -> None:
            await durability(a.n // 2, a.pairs)
            await durability_r3(a.n // 4, a.pairs)

        asyncio.run(both())
    else:
        asyncio.run(main(a.n, a.replay, a.rounds, a.pairs))
