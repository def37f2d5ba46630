"""A follower's catch-up (haru/log/js_replay.py, "The catch-up"): what the stream holds read through a pull
consumer handled from nats-py's read loop (haru/log/nats_direct.py), then the ordered consumer. Each
record once, in order, across the hand-over, a consumer deleted mid-way, a handler that fails, and the
direct subscription's own contract (headers as nats-py gives them, a failing callback that does not
take the connection down)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import nats.errors
import nats.js.errors
import pytest
from nats.js import api

from haru.core import events as ev
from haru.core import subjects
from haru.host.tasks import cancel_and_wait
from haru.log import js_replay, nats_direct

T0 = datetime(2026, 11, 29, 3, 0, tzinfo=UTC)
SUBJECT = subjects.model("default", "a", "stories")


def loading(i: int) -> ev.ModelLoading:
    return ev.ModelLoading(at=T0 + timedelta(seconds=i), domain="a", model="stories", endpoint="127.0.0.1:18080", pid=i)


async def append(log, n: int, start: int = 0) -> int:
    seq = await log.last_seq_of(SUBJECT)
    for i in range(start, start + n):
        seq = await log.append(SUBJECT, loading(i), expect=seq)
    return seq


@pytest.fixture
def pull_consumers(event_log, monkeypatch):
    """The pull consumers (ack none, no deliver subject) the replays created."""
    made: list[api.ConsumerConfig] = []
    add = event_log.js.add_consumer

    async def counting(stream, config=None, **kwargs):
        if config is not None and config.ack_policy == api.AckPolicy.NONE and not config.deliver_subject:
            made.append(config)
        return await add(stream, config, **kwargs)

    monkeypatch.setattr(event_log.js, "add_consumer", counting)
    return made


async def until(cond, timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("subject_filter", [subjects.ALL_EVENTS, subjects.fleet_events("default")])
async def test_a_follower_catches_up_through_the_pull_consumer_then_follows_live(
    event_log, pull_consumers, subject_filter
):
    first = await append(event_log, 30)
    seen: list[int] = []
    follower = asyncio.create_task(event_log.replay(seen.append, follow=True, subject_filter=subject_filter))
    try:
        await until(lambda: len(seen) >= first)
        assert len(pull_consumers) == 1 and pull_consumers[0].filter_subject == subject_filter
        total = await append(event_log, 10, start=30)  # after the hand-over: the ordered consumer's
        await until(lambda: len(seen) >= total)
        await asyncio.sleep(0.2)  # nothing more, nothing twice
    finally:
        await cancel_and_wait(follower)
    assert [r.seq for r in seen] == list(range(1, total + 1))
    assert [r.event.pid for r in seen] == list(range(total))  # each its own body


async def test_the_catch_up_resumes_where_asked_and_hands_headers_as_nats_py_does(event_log, pull_consumers):
    last = await append(event_log, 12)
    seen: list = []
    follower = asyncio.create_task(event_log.replay(seen.append, from_seq=5, follow=True))
    try:
        await until(lambda: len(seen) >= last - 4)
    finally:
        await cancel_and_wait(follower)
    assert [r.seq for r in seen] == list(range(5, last + 1))
    assert pull_consumers[0].opt_start_seq == 5
    stored = await event_log.read_seq(7)  # the headers of an append, as the log's own read has them
    assert seen[2].headers == stored.headers and seen[2].headers  # non-empty: every append writes two


async def test_a_consumer_deleted_mid_catch_up_hands_over_and_nothing_is_lost_or_repeated(
    event_log, pull_consumers, monkeypatch
):
    monkeypatch.setattr(js_replay, "_CATCH_UP_BATCH", 4)  # many pull requests: the deletion lands mid-way
    monkeypatch.setattr(js_replay, "_CATCH_UP_SILENCE_S", 0.2)
    last = await append(event_log, 40)
    seen: list[int] = []
    deleting: list[asyncio.Task] = []

    async def delete_all() -> int:
        infos = await event_log.js.consumers_info(subjects.EVENTS_STREAM)
        for info in infos:
            await event_log.js.delete_consumer(subjects.EVENTS_STREAM, info.name)
        return len(infos)

    def handler(rec) -> None:
        seen.append(rec.seq)
        if len(seen) == 10:
            deleting.append(asyncio.get_running_loop().create_task(delete_all()))

    follower = asyncio.create_task(event_log.replay(handler, follow=True))
    try:
        await until(lambda: len(seen) >= last)
        total = await append(event_log, 5, start=40)
        await until(lambda: len(seen) >= total)
        await asyncio.sleep(0.2)
    finally:
        await cancel_and_wait(follower)
    assert await deleting[0] == 1
    assert seen == list(range(1, total + 1))


@pytest.mark.parametrize("refused", ["create", "pull"])
async def test_a_catch_up_whose_requests_fail_hands_over_and_the_follower_gets_everything(
    event_log, monkeypatch, refused
):
    """A consumer the server will not make, or pull requests that cannot be sent (NATS closing, ...): the
    ordered consumer reads everything instead, and nothing is raised to the follower."""
    last = await append(event_log, 12)
    nc = event_log.js._nc
    if refused == "create":

        async def add_consumer(*args, **kwargs):
            raise nats.js.errors.APIError(description="refused")

        monkeypatch.setattr(event_log.js, "add_consumer", add_consumer)
    else:
        publish = nc.publish

        async def failing(subject, *args, **kwargs):
            if subject.startswith("$JS.API.CONSUMER.MSG.NEXT."):
                raise nats.errors.ConnectionClosedError
            return await publish(subject, *args, **kwargs)

        monkeypatch.setattr(nc, "publish", failing)
    seen: list[int] = []
    follower = asyncio.create_task(event_log.replay(lambda rec: seen.append(rec.seq), follow=True))
    try:
        await until(lambda: len(seen) >= last)
        total = await append(event_log, 3, start=12)
        await until(lambda: len(seen) >= total)
        assert not follower.done()
    finally:
        await cancel_and_wait(follower)
    assert seen == list(range(1, total + 1))


async def test_pull_requests_lost_at_the_start_are_sent_again_and_the_catch_up_reads_it_all(event_log, monkeypatch):
    """In a cluster the first pull requests can be lost while the new consumer's interest reaches the other
    servers: after one silent window the catch-up asks again instead of handing over."""
    monkeypatch.setattr(js_replay, "_CATCH_UP_SILENCE_S", 0.3)
    last = await append(event_log, 12)
    nc = event_log.js._nc
    publish, dropped = nc.publish, []

    async def losing_the_first_two(subject, *args, **kwargs):
        if subject.startswith("$JS.API.CONSUMER.MSG.NEXT.") and len(dropped) < 2:
            dropped.append(subject)
            return None
        return await publish(subject, *args, **kwargs)

    monkeypatch.setattr(nc, "publish", losing_the_first_two)
    by_catch_up = [0]
    original = js_replay.Replay._on_direct

    def counting(self, catch, nc):
        on = original(self, catch, nc)

        def on_msg(subject, reply, data, hdr):
            before = self.last_handled
            on(subject, reply, data, hdr)
            by_catch_up[0] += self.last_handled != before

        return on_msg

    monkeypatch.setattr(js_replay.Replay, "_on_direct", counting)
    seen: list[int] = []
    follower = asyncio.create_task(event_log.replay(lambda rec: seen.append(rec.seq), follow=True))
    try:
        await until(lambda: len(seen) >= last)
    finally:
        await cancel_and_wait(follower)
    assert len(dropped) == 2 and seen == list(range(1, last + 1)) and by_catch_up[0] == last


async def test_a_skipped_consumer_sequence_ends_the_catch_up_before_anything_past_it(event_log):
    """Fed by hand: the callback hands nothing past a missed delivery and asks for the hand-over."""
    seen: list[int] = []

    async def rescan(*args, **kwargs):
        return 0

    r = js_replay.Replay(
        event_log.js,
        lambda rec: seen.append(rec.seq),
        from_seq=1,
        subject_filter=subjects.ALL_EVENTS,
        follow=True,
        headers=False,
        budget=None,
        strict=False,
        on_gap=None,
        rescan=rescan,
    )
    catch = js_replay._CatchUp(asyncio.get_running_loop())
    catch.consumer, catch.asked = b"c1", 1_000_000
    on = r._on_direct(catch, event_log.js._nc)
    body = ev.encode(loading(0))

    def deliver(consumer: str, seq: int, cseq: int, pending: int) -> None:
        reply = f"$JS.ACK.{subjects.EVENTS_STREAM}.{consumer}.1.{seq}.{cseq}.1764640000000000000.{pending}"
        on(SUBJECT.encode(), reply.encode(), body, None)

    deliver("c1", 1, 1, 9)
    deliver("c0", 2, 1, 8)  # another consumer's: dropped
    deliver("c1", 2, 2, 8)
    assert not catch.over
    deliver("c1", 4, 4, 6)  # consumer sequence 3 never came
    deliver("c1", 5, 5, 5)
    assert catch.over and catch.done.done()
    assert seen == [1, 2] and r.last_handled == 2


async def test_a_handler_failing_during_the_catch_up_fails_the_replay(event_log):
    await append(event_log, 10)

    def handler(rec) -> None:
        if rec.seq == 4:
            raise ValueError("the handler's own failure")

    with pytest.raises(ValueError, match="the handler's own failure"):
        await asyncio.wait_for(event_log.replay(handler, follow=True), 20)


async def test_an_async_handler_follows_with_the_ordered_consumer_only(event_log, pull_consumers):
    last = await append(event_log, 8)
    seen: list[int] = []

    async def handler(rec) -> None:
        seen.append(rec.seq)

    follower = asyncio.create_task(event_log.replay(handler, follow=True))
    try:
        await until(lambda: len(seen) >= last)
    finally:
        await cancel_and_wait(follower)
    assert seen == list(range(1, last + 1)) and pull_consumers == []


async def test_a_direct_subscription_gets_raw_messages_and_a_failing_callback_spares_the_connection(event_log):
    nc = event_log.js._nc
    got: list[tuple[bytes, bytes, bytes, dict | None]] = []

    def on(subject: bytes, reply: bytes, data: bytes, hdr: bytes | None) -> None:
        if data == b"boom":
            raise RuntimeError("a bug in the callback")
        got.append((subject, reply, data, nats_direct.header_dict(nc, hdr)))

    sub = await nats_direct.subscribe_direct(nc, "haru.test.direct", on)
    assert sub is not None
    plain = await nc.subscribe("haru.test.direct")
    try:
        await nc.publish("haru.test.direct", b"boom")
        await nc.publish("haru.test.direct", b"one", reply="r.1", headers={"A": "1", "Nats-Msg-Id": "x y"})
        await nc.publish("haru.test.direct", b"two")
        await nc.flush()
        await until(lambda: len(got) >= 2, 5)
        assert [(s, r, d) for s, r, d, _ in got] == [
            (b"haru.test.direct", b"r.1", b"one"),
            (b"haru.test.direct", b"", b"two"),
        ]
        msgs = [await plain.next_msg(2) for _ in range(3)]
        assert got[0][3] == msgs[1].headers and got[1][3] is None and msgs[2].headers is None
        assert await event_log.last_seq() >= 0  # the connection still answers requests
        assert "_process_msg" in nc.__dict__  # wrapped while a direct subscription is on
        sub.stop()
        assert "_process_msg" not in nc.__dict__  # the last one stopped: nats-py's own path again
        await nc.publish("haru.test.direct", b"three")
        await nc.flush()
        assert (await plain.next_msg(2)).data == b"three"
        assert len(got) == 2  # stopped: nothing more to the callback
    finally:
        await sub.unsubscribe()
        await plain.unsubscribe()
