"""A userspace TCP delay proxy for the region harness: WAN latency and cut links without netem.

    python -m tests.support.delay_proxy LISTEN_HOST PAIR=PORT:TARGET_HOST:TARGET_PORT ...

Each PAIR (a name such as `1-2`, meaning "from region 1 to region 2") listens on LISTEN_HOST:PORT and
forwards every connection to TARGET_HOST:TARGET_PORT. Every chunk read in either direction is written
to the other side `delay` seconds after it was read, in order, so a one-way delay d gives a round trip
of 2d on top of the path's own. Commands arrive one per line on stdin, each answered `ok` on stdout:

    delay SECONDS        the one-way delay of every pair (and of data already queued from now on)
    cut A B              the link between regions A and B is down: nothing flows either way on pairs
                         A-B and B-A (data is held, not dropped, as TCP over a downed link would
                         retransmit it); new connections are accepted and held unconnected
    heal A B             the link is up again: held data flows, held connections connect
    cut-routes A B       only the NATS routes between A and B stop (pairs named A-Br / B-Ar): the two
    heal-routes A B      nodes lose each other while clients still reach both
    quit                 stop

A cut holds bytes instead of closing sockets on purpose: a real partition closes nothing, and what
notices it is whoever waits for an answer (NATS route pings, Raft heartbeats, client pings).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import deque


class Link:
    """The state of the path between two regions: up or cut, and the event the held data waits on."""

    def __init__(self) -> None:
        self.up = asyncio.Event()
        self.up.set()


class Proxy:
    def __init__(self) -> None:
        self.delay = 0.0
        self.links: dict[frozenset[str], Link] = {}
        self.tasks: set[asyncio.Task] = set()

    def link(self, a: str, b: str, kind: str = "") -> Link:
        return self.links.setdefault(frozenset((a, b, kind)) if kind else frozenset((a, b)), Link())

    def links_of(self, pair: str) -> tuple[Link, ...]:
        """The links a pair's bytes wait on: the regions' link, and the routes' own for a route pair (A-Br)."""
        a, b = pair.split("-")
        if b.endswith("r"):
            b = b[:-1]
            return (self.link(a, b), self.link(a, b, "routes"))
        return (self.link(a, b),)

    async def pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, links: tuple[Link, ...]) -> None:
        queue: deque[tuple[float, bytes]] = deque()
        arrived = asyncio.Event()
        done = False

        async def read() -> None:
            nonlocal done
            try:
                while data := await reader.read(65536):
                    queue.append((time.monotonic() + self.delay, data))
                    arrived.set()
            except OSError:
                pass
            done = True
            arrived.set()

        reading = asyncio.create_task(read())
        try:
            while True:
                if not queue:
                    if done:
                        break
                    arrived.clear()
                    await arrived.wait()
                    continue
                due, data = queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                while not all(link.up.is_set() for link in links):
                    for link in links:
                        await link.up.wait()
                queue.popleft()
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            reading.cancel()
            writer.close()

    async def serve(self, pair: str, port: int, host: str, target: tuple[str, int]) -> asyncio.Server:
        async def accept(down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
            links = self.links_of(pair)
            while not all(link.up.is_set() for link in links):
                for link in links:
                    await link.up.wait()
            try:
                up_r, up_w = await asyncio.open_connection(*target)
            except OSError:
                down_w.close()
                return
            await asyncio.gather(self.pump(down_r, up_w, links), self.pump(up_r, down_w, links))

        return await asyncio.start_server(accept, host, port, reuse_address=True)

    async def commands(self) -> None:
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            words = line.split()
            if not words:
                continue
            if words[0] == "delay":
                self.delay = float(words[1])
            elif words[0] == "cut":
                self.link(words[1], words[2]).up.clear()
            elif words[0] == "heal":
                self.link(words[1], words[2]).up.set()
            elif words[0] == "cut-routes":
                self.link(words[1], words[2], "routes").up.clear()
            elif words[0] == "heal-routes":
                self.link(words[1], words[2], "routes").up.set()
            elif words[0] == "quit":
                break
            print("ok", flush=True)


async def main(argv: list[str]) -> None:
    host, pairs = argv[0], argv[1:]
    proxy = Proxy()
    servers = []
    for spec in pairs:
        pair, rest = spec.split("=")
        port, thost, tport = rest.split(":")
        servers.append(await proxy.serve(pair, int(port), host, (thost, int(tport))))
    print("ready", flush=True)
    await proxy.commands()
    for s in servers:
        s.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
