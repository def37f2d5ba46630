"""haru/log/nats_direct.py's read of `MSG` lines against nats-py's own parser: the same protocol bytes,
cut into chunks at every position and at random, give the same messages in the same order (a direct
subscription's to its callback, everything else to nats-py's `_process_msg`, pings, infos...)."""

from __future__ import annotations

import asyncio
import random

import pytest
from nats.protocol.parser import Parser

from haru.log import nats_direct

pytestmark = pytest.mark.skipif(not nats_direct.direct_supported(), reason="another nats-py: the wrapper is not used")

DIRECT_SID = 7


def stream() -> bytes:
    """Protocol bytes as nats-server writes them: direct deliveries (with a reply, without one, an empty
    payload, a payload holding CRLF and 'MSG '), another subscription's, headers, and other operations."""
    parts = [
        b"MSG haru.evt.default.model.a.m 7 $JS.ACK.HARU_EVENTS.c.1.1.1.17.9 5\r\nhello\r\n",
        b"MSG haru.evt.default.model.a.m 7 $JS.ACK.HARU_EVENTS.c.1.2.2.17.8 0\r\n\r\n",
        b"MSG _INBOX.abc.1 7 12\r\nMSG x\r\nabc d\r\n",
        b'INFO {"server_id":"x","max_payload":1048576}\r\n',
        b"MSG other.subject 3 _INBOX.r 4\r\nabcd\r\n",
        b"PING\r\n",
        b"HMSG haru.evt.default.decl 7 $JS.ACK.HARU_EVENTS.c.1.3.3.17.7 18 21\r\nNATS/1.0\r\nA: b\r\n\r\nabc\r\n",
        b"+OK\r\n",
        b"MSG haru.evt.default.model.a.m 7 $JS.ACK.HARU_EVENTS.c.1.4.4.17.6 3\r\n{}x\r\n",
        b"PONG\r\n",
        b"MSG haru.evt.default.route 7 $JS.ACK.HARU_EVENTS.c.1.5.5.17.0 2\r\n{}\r\n",
    ]
    return b"".join(parts)


class FakeClient:
    """What the parser calls on its client, recorded in order."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    async def _process_msg(self, sid, subject, reply, payload, hdr) -> None:
        self.seen.append(("msg", sid, bytes(subject), bytes(reply), payload, hdr))

    async def _process_ping(self) -> None:
        self.seen.append(("ping",))

    async def _process_pong(self) -> None:
        self.seen.append(("pong",))

    async def _process_info(self, info) -> None:
        self.seen.append(("info", info["server_id"]))

    async def _process_err(self, err) -> None:
        self.seen.append(("err", err))


FAST: list[int] = []  # messages the wrapper read itself (not through nats-py's state machine)


async def feed(chunks: list[bytes], direct: bool) -> list[tuple]:
    nc = FakeClient()
    nc._ps = Parser(nc)  # type: ignore[attr-defined]
    if direct:

        def on(s, r, d, h) -> None:
            FAST.append(1)
            nc.seen.append(("msg", DIRECT_SID, bytes(s), bytes(r), d, h))

        nats_direct._wrap_parser(nc._ps, {DIRECT_SID: on})  # type: ignore[attr-defined]
    for chunk in chunks:
        await nc._ps.parse(chunk)  # type: ignore[attr-defined]
    return nc.seen


def cut(data: bytes, at: list[int]) -> list[bytes]:
    edges = [0, *sorted(at), len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:])]


async def test_one_chunk_gives_what_nats_py_gives():
    data = stream()
    want = await feed([data], direct=False)
    assert len([m for m in want if m[0] == "msg"]) == 7
    FAST.clear()
    assert await feed([data], direct=True) == want
    assert len(FAST) == 3  # the direct ones before the INFO; after it nats-py's parse reads the rest


async def test_cut_at_every_position_gives_what_nats_py_gives():
    data = stream()
    want = await feed([data], direct=False)
    FAST.clear()
    for i in range(1, len(data)):
        assert await feed(cut(data, [i]), direct=True) == want, i
    assert len(FAST) > 2 * len(data)  # most cuts leave several to the wrapper


async def test_random_chunks_give_what_nats_py_gives():
    data = stream() * 3
    want = await feed([data], direct=False)
    rng = random.Random(30)
    for _ in range(300):
        at = rng.sample(range(1, len(data)), rng.randint(1, 40))
        assert await feed(cut(data, at), direct=True) == want


async def test_a_reset_buffer_is_read_from_the_new_one():
    """nats-py's `reset` (a reconnect) replaces the parser's buffer: the wrapper reads the new one."""
    data = stream()
    want = await feed([data], direct=False)
    nc = FakeClient()
    nc._ps = Parser(nc)  # type: ignore[attr-defined]
    nats_direct._wrap_parser(
        nc._ps, {DIRECT_SID: lambda s, r, d, h: nc.seen.append(("msg", DIRECT_SID, bytes(s), bytes(r), d, h))}
    )  # type: ignore[attr-defined]
    await nc._ps.parse(data[:50])  # type: ignore[attr-defined]
    nc._ps.reset()  # type: ignore[attr-defined]
    nc.seen.clear()
    await nc._ps.parse(data)  # type: ignore[attr-defined]
    assert nc.seen == want


if __name__ == "__main__":  # pragma: no cover
    asyncio.run(test_cut_at_every_position_gives_what_nats_py_gives())
