"""One contract for the log and the bus, run against each implementation: JetStream (`EventLog` on a real
nats-server, `NatsBus`) and in memory (`MemoryLog`, `MemoryBus`), through tests/support/log_world.py.
It covers what haru/log/seam.py declares (events, views, intents, the link) and haru/log/bus.py's `Bus`;
mypy checks the signatures (haru/log/conformance.py), this checks the behaviour. As eventsourcing runs one recorder
suite against each recorder: what passes here may be relied on by the services whichever one they get.
What only a server shows (damaged stores, leader elections, lost acks) stays in test_eventlog.py and
test_damaged_log.py."""

from __future__ import annotations

import asyncio
import hashlib
from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from haru.core import events as ev
from haru.core import subjects
from haru.core.commands import Command, Reply, command_decoder
from haru.core.commands import command_encoder as reply_encoder
from haru.core.errors import AgentGone, Conflict, NoResponders, RequestTimeout
from haru.host.tasks import cancel_and_wait
from haru.log.bus import SERVICE_ERROR, SERVICE_ERROR_CODE, Endpoint, Msg, Service, send
from haru.log.history import Verifier
from haru.log.memory import subject_matches
from tests.support.wait import wait_until

T0 = datetime(2026, 11, 29, 3, 0, tzinfo=UTC)
F = "default"
A = subjects.model(F, "a", "stories")
B = subjects.model(F, "b", "stories")


def loading(i: int = 0, domain: str = "a") -> ev.ModelLoading:
    return ev.ModelLoading(at=T0 + timedelta(seconds=i), domain=domain, model="stories")


def resident(i: int = 0, domain: str = "a") -> ev.ModelResident:
    return ev.ModelResident(at=T0 + timedelta(seconds=i), domain=domain, model="stories")


@pytest.fixture
def log(world):
    return world.log


# ------------------------------------------------------------------------------------------- appends


async def test_appends_are_checked_against_the_subjects_last_sequence(log):
    first = await log.append(A, loading(), expect=0)
    assert first == 1
    with pytest.raises(Conflict) as err:
        await log.append(A, resident(), expect=0)
    assert (err.value.expected, err.value.current) == (0, first)
    second = await log.append(A, resident(), expect=first)
    with pytest.raises(Conflict) as err:
        await log.append(A, loading(2), expect=first)  # stale: the subject is at `second`
    assert err.value.current == second
    assert await log.last_seq_of(A) == second


async def test_one_dense_sequence_and_a_history_per_subject(log):
    s1 = await log.append(A, loading(), expect=0)
    s2 = await log.append(B, loading(domain="b"), expect=0)
    s3 = await log.append(A, resident(), expect=s1)
    assert (s1, s2, s3) == (1, 2, 3)
    assert await log.last_seq() == 3
    assert [r.seq for r in await log.history(A)] == [1, 3]
    assert [r.seq for r in await log.history(subjects.fleet_events(F))] == [1, 2, 3]
    assert [r.seq for r in await log.history(f"{subjects.EVT}.{F}.*.model.stories")] == [1, 2, 3]
    assert [r.seq for r in await log.history(from_seq=2)] == [2, 3]
    assert await log.subject_counts(subjects.fleet_events(F)) == {A: 2, B: 1}
    last = await log.last(A)
    assert last.seq == 3 and isinstance(last.event, ev.ModelResident)
    assert await log.last(subjects.model(F, "c", "stories")) is None
    assert (await log.read_seq(2)).subject == B and await log.read_seq(99) is None


async def test_last_seq_matching_takes_wildcards(log):
    await log.append(A, loading(), expect=0)
    await log.append(B, loading(domain="b"), expect=0)
    await log.append(subjects.route(F), ev.RouteMoved(at=T0, active="a"), expect=0)
    assert await log.last_seq_matching(f"{subjects.EVT}.{F}.*.model.>") == 2
    assert await log.last_seq_matching(f"{subjects.EVT}.*.route") == 3
    assert await log.last_seq_matching(f"{subjects.EVT}.other.>") == 0
    assert await log.last_seq_matching(subjects.ALL_EVENTS) == 3


async def test_appends_chain_bodies_and_name_their_writer(log):
    s1 = await log.append(A, loading(), expect=0)
    await log.append(A, resident(), expect=s1)
    r1, r2 = await log.history(A)
    assert r1.event.prev == "" and r1.event.by == "test"
    assert r2.event.prev == hashlib.sha256(r1.data).hexdigest()


async def test_a_retried_append_that_was_stored_is_one_event(log):
    first = await log.append(A, loading(), expect=0)
    event = msgspec.structs.replace(resident(), by="agent:a")
    stored = await log.append(A, event, expect=first)
    again = await log.append(A, event, expect=first)  # its ack was lost: the writer tries again
    assert again == stored
    assert [r.seq for r in await log.history(A)] == [first, stored]
    with pytest.raises(Conflict):  # a different body at that position is someone else's: a conflict
        await log.append(A, msgspec.structs.replace(event, warmup_ms=1), expect=first)


# ------------------------------------------------------------------------------------------ batches


async def test_a_batch_is_stored_whole_in_order_and_chained(log):
    a1 = await log.append(A, loading(), expect=0)
    seqs = await log.append_batch(
        [(A, resident(1)), (B, loading(2, domain="b")), (A, loading(3))], expect={A: a1, B: 0}
    )
    assert seqs == [a1 + 1, a1 + 2, a1 + 3]
    r1, r2, r3 = await log.history(A)
    assert [r.seq for r in (r1, r2, r3)] == [a1, a1 + 1, a1 + 3]
    assert r2.event.prev == hashlib.sha256(r1.data).hexdigest()  # chained to what was there before
    assert r3.event.prev == hashlib.sha256(r2.data).hexdigest()  # and within the batch
    assert r3.event.by == "test"
    assert (await log.last(B)).event.prev == ""
    assert await log.append(A, resident(4), expect=a1 + 3) == a1 + 4  # the batch moved the subject's tip
    verifier = Verifier()  # `haru verify`: every message is where its writer's check put it
    for rec in await log.history():
        verifier.add(rec)
    assert verifier.breaks == []


async def test_a_batch_whose_subject_moved_stores_nothing(log):
    a1 = await log.append(A, loading(), expect=0)
    b1 = await log.append(B, loading(domain="b"), expect=0)
    with pytest.raises(Conflict) as err:
        await log.append_batch([(A, resident(1)), (B, resident(2, domain="b"))], expect={A: a1, B: 0})
    assert (err.value.subject, err.value.expected, err.value.current) == (B, 0, b1)
    assert await log.last_seq() == b1  # not even the first message, whose subject was where it was expected
    assert await log.append_batch([(A, resident(1)), (B, resident(2, domain="b"))], expect={A: a1, B: b1}) == [3, 4]


async def test_a_retried_batch_that_was_stored_is_one_batch(log):
    batch = [
        (A, msgspec.structs.replace(loading(), by="agent:a")),
        (A, msgspec.structs.replace(resident(1), by="agent:a")),
    ]
    stored = await log.append_batch(batch, expect={A: 0})
    assert await log.append_batch(batch, expect={A: 0}) == stored  # its ack was lost: the writer tries again
    assert await log.last_seq() == stored[-1]


async def test_a_cause_relative_to_a_batch_reads_as_a_sequence(log):
    """A writer cites an earlier event of its own batch by its position (its sequence is not known yet):
    every read gives the sequence."""
    await log.append(B, loading(domain="b"), expect=0)
    seqs = await log.append_batch([(A, loading(1)), (A, msgspec.structs.replace(resident(2), cause=-1))], expect={A: 0})
    assert (await log.last(A)).event.cause == seqs[0]
    assert [r.event.cause for r in await log.history(A)] == [0, seqs[0]]
    followed: list = []
    await log.replay(followed.append, subject_filter=A)
    assert followed[-1].event.cause == seqs[0]


# ----------------------------------------------------------------------------------------- following


async def test_tail_reads_the_last_matching_events_oldest_first(log):
    seqs = [await log.append(A, loading(0), expect=0)]
    for i in range(1, 6):
        seqs.append(await log.append(A, loading(i) if i % 2 == 0 else resident(i), expect=seqs[-1]))
    await log.append(B, loading(domain="b"), expect=0)
    assert [r.seq for r in await log.tail(A, 3)] == seqs[-3:]
    assert [r.seq for r in await log.tail(A, 100)] == seqs
    assert [r.seq for r in await log.history(A, strict=True)] == seqs  # an intact store: strict finds nothing


async def test_replay_without_follow_returns_the_last_sequence_handled(log):
    for i in range(5):
        await log.append(subjects.model(F, "a", f"m{i}"), loading(i), expect=0)
    seen: list[int] = []
    assert await log.replay(lambda r: seen.append(r.seq), from_seq=3) == 5
    assert seen == [3, 4, 5]
    assert await log.replay(lambda r: None, from_seq=9) == 8  # nothing matched: from_seq - 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("is_async", [False, True])
async def test_a_follower_catches_up_then_follows_each_sequence_once(log, is_async):
    s1 = await log.append(A, loading(), expect=0)
    seen: list[int] = []
    if is_async:

        async def handler(rec) -> None:
            await asyncio.sleep(0)
            seen.append(rec.seq)
    else:

        def handler(rec) -> None:
            seen.append(rec.seq)

    follower = log.follower(handler, from_seq=1, name="contract")
    task = asyncio.create_task(follower.run())
    try:
        await wait_until(lambda: seen == [1], 10.0, interval_s=0.02)
        s2 = await log.append(B, loading(domain="b"), expect=0)
        await log.append(A, resident(), expect=s1)
        await wait_until(lambda: seen == [1, s2, 3], 10.0, interval_s=0.02)
        assert follower.position == 3
    finally:
        await cancel_and_wait(task)  # re-cancelled until it ends: one cancel can be eaten on 3.11 (haru/host/tasks.py)


@pytest.mark.timeout(60)
async def test_a_filtered_follower_resumes_from_its_position(log):
    for i in range(3):
        await log.append(B, loading(i, domain="b"), expect=i and await log.last_seq_of(B))
    s = await log.append(A, loading(), expect=0)
    seen: list[int] = []
    task = asyncio.create_task(log.follow(lambda r: seen.append(r.seq), from_seq=s, subject_filter=A, name="contract"))
    try:
        await wait_until(lambda: seen == [s], 10.0, interval_s=0.02)
        s2 = await log.append(A, resident(), expect=s)
        await wait_until(lambda: seen == [s, s2], 10.0, interval_s=0.02)
    finally:
        await cancel_and_wait(task)  # re-cancelled until it ends: one cancel can be eaten on 3.11 (haru/host/tasks.py)


@pytest.mark.timeout(90)
async def test_a_follower_replays_afresh_after_the_connection_comes_back(world, log):
    await log.append(A, loading(), expect=0)
    seen: list[int] = []
    restarts: list[str] = []
    links: list[bool] = []
    forget = log.on_link_change(links.append)
    follower = log.follower(
        lambda r: seen.append(r.seq),
        from_seq=1,
        name="contract",
        stall_interval=0.3,
        retry_s=0.2,
        on_restart=restarts.append,
    )
    task = asyncio.create_task(follower.run())
    try:
        await wait_until(lambda: seen == [1], 10.0, interval_s=0.02)
        assert log.connected
        await world.drop_link(0.5)
        async with asyncio.timeout(20):
            while True:  # the writer's own connection may need a moment too
                try:
                    last = await log.append(A, resident(), expect=1)
                    break
                except Exception:
                    await asyncio.sleep(0.2)
        await wait_until(lambda: seen == [1, last], 15, interval_s=0.02)  # without a fresh replay: ~20 s on JetStream
        assert restarts, "the follower did not start a fresh replay"
        assert links[:1] == [False] and links[-1] is True and log.connected  # listeners heard down, then up
        forget()
        await world.drop_link(0.1)
        assert links.count(False) == 1  # a forgotten listener hears nothing more
    finally:
        await cancel_and_wait(task)  # re-cancelled until it ends: one cancel can be eaten on 3.11 (haru/host/tasks.py)


async def test_a_handler_that_fails_ends_the_follower_with_its_error(log):
    await log.append(A, loading(), expect=0)

    def handler(rec) -> None:
        raise ValueError("a bug in the handler")

    with pytest.raises(ValueError, match="a bug in the handler"):
        async with asyncio.timeout(20):
            await log.follow(handler, from_seq=1, name="contract")


# -------------------------------------------------------------------------------- views and intents


async def test_views_are_compare_and_swap(log):
    assert await log.get_view("fleet.default") is None
    r1 = await log.put_view("fleet.default", b"one", last=0)
    with pytest.raises(Conflict):
        await log.put_view("fleet.default", b"two", last=0)
    r2 = await log.put_view("fleet.default", b"two", last=r1)
    with pytest.raises(Conflict):
        await log.put_view("fleet.default", b"three", last=r1)
    assert await log.get_view("fleet.default") == (b"two", r2)
    assert await log.views() == {"fleet.default": b"two"}


@pytest.mark.timeout(60)
async def test_every_view_is_listed_while_others_are_rewritten(log):
    """A view rewritten while the views are listed (a fleet failing over while `haru status` reads) is
    still listed: every key, every time, with a value that was stored."""
    revs = {f"fleet.f{i}": await log.put_view(f"fleet.f{i}", b"0", last=0) for i in range(6)}
    stop = asyncio.Event()

    async def rewrite() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            for key in ("fleet.f0", "fleet.f3", "fleet.f5"):
                revs[key] = await log.put_view(key, str(n).encode(), last=revs[key])
            await asyncio.sleep(0)

    writer = asyncio.create_task(rewrite())
    try:
        for _ in range(40):
            got = await log.views()
            assert sorted(got) == sorted(revs), got
            assert all(v.isdigit() for v in got.values()), got
    finally:
        stop.set()
        await writer


async def test_intents_are_appended_against_the_last_one(log):
    assert await log.last_intent(F) is None
    i1 = await log.publish_intent(F, b"{}", expect=0)
    assert await log.publish_intent(F, b"{}", expect=0) == i1  # the same intent again (a lost ack): one message
    with pytest.raises(Conflict):
        await log.publish_intent(F, b'{"n":1}', expect=0)
    i2 = await log.publish_intent(F, b'{"n":2}', expect=i1)
    assert await log.last_intent(F) == (b'{"n":2}', i2)


@pytest.mark.timeout(60)
async def test_watches_deliver_the_current_value_then_changes(log):
    r1 = await log.put_view("fleet.x", b"one", last=0)
    await log.publish_intent("x", b"i1", expect=0)
    views: list[tuple] = []
    intents: list[tuple] = []

    async def watch_views() -> None:
        async for item in log.watch_views():
            views.append(item)

    async def watch_intents() -> None:
        async for item in log.watch_intents():
            intents.append(item)

    tasks = [asyncio.create_task(watch_views()), asyncio.create_task(watch_intents())]
    try:
        await wait_until(
            lambda: views == [("fleet.x", b"one", r1)] and [i[:2] for i in intents] == [("x", b"i1")],
            10.0,
            interval_s=0.02,
        )
        r2 = await log.put_view("fleet.x", b"two", last=r1)
        await log.publish_intent("x", b"i2", expect=intents[0][2])
        await wait_until(
            lambda: views[-1] == ("fleet.x", b"two", r2) and intents[-1][:2] == ("x", b"i2"), 10.0, interval_s=0.02
        )
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---------------------------------------------------------------------------------------------- bus


@pytest.mark.timeout(60)
async def test_bus_publish_reaches_wildcard_subscribers(log):
    got: list[Msg] = []
    sub = await log.bus.subscribe(subjects.heartbeats("*"), got.append)
    await log.bus.publish(subjects.heartbeat(F, "a"), b"beat")
    await log.bus.publish("haru.other", b"no")
    await wait_until(lambda: len(got) == 1, 10.0, interval_s=0.02)
    assert got[0].subject == subjects.heartbeat(F, "a") and got[0].data == b"beat"
    await sub.unsubscribe()
    await log.bus.publish(subjects.heartbeat(F, "a"), b"again")
    await asyncio.sleep(0.2)
    assert len(got) == 1


async def _answer(bus, subject: str, respond) -> object:
    async def on(msg: Msg) -> None:
        data, headers = respond(msg)
        await bus.publish(msg.reply, data, headers=headers)

    return await bus.subscribe(subject, on)


@pytest.mark.timeout(60)
async def test_bus_request_reply_no_responders_and_timeout(log):
    bus = log.bus
    await _answer(bus, "test.echo", lambda m: (m.data.upper(), None))
    assert (await bus.request("test.echo", b"hi", timeout=5)).data == b"HI"
    with pytest.raises(NoResponders):
        await bus.request("test.nobody", b"", timeout=2)
    await bus.subscribe("test.silent", lambda m: None)
    with pytest.raises(RequestTimeout):
        await bus.request("test.silent", b"", timeout=0.3)


@pytest.mark.timeout(60)
async def test_send_has_one_meaning_for_each_outcome(log):
    bus = log.bus
    answers = {
        "status": lambda m: (reply_encoder.encode(Reply(ok=True, detail=command_decoder.decode(m.data).op_id)), None),
        "wake": lambda m: (b"", {SERVICE_ERROR: "CUDA out of memory", SERVICE_ERROR_CODE: "out_of_memory"}),
        "probe": lambda m: (b"", {SERVICE_ERROR: "no code given"}),
        "sleep": lambda m: (b"not a reply", None),
    }
    for verb, respond in answers.items():
        await _answer(bus, subjects.command(F, "b", verb), respond)
    ok = await send(bus, F, "b", "status", Command(op_id="op1"), timeout=5)
    assert ok.ok and ok.detail == "op1"
    oom = await send(bus, F, "b", "wake", Command(), timeout=5)
    assert not oom.ok and (oom.error.code, oom.error.message) == ("out_of_memory", "CUDA out of memory")
    uncoded = await send(bus, F, "b", "probe", Command(), timeout=5)
    assert not uncoded.ok and uncoded.error.code == "service_error"
    bad = await send(bus, F, "b", "sleep", Command(), timeout=5)
    assert not bad.ok and bad.error.code == "bad_reply"
    with pytest.raises(AgentGone, match="nothing subscribed"):
        await send(bus, F, "c", "status", Command(), timeout=2)


async def test_a_served_endpoint_answers_each_request_in_its_own_task_until_stopped(log):
    bus = log.bus
    release = asyncio.Event()
    started: list[bytes] = []

    async def slow(data: bytes) -> bytes:
        started.append(data)
        await release.wait()
        return b"slow " + data

    async def fast(data: bytes) -> bytes:
        return data.upper()

    served = await bus.serve(
        Service(name="haru-test", version="1.0.0", metadata={"fleet": F}, queue_group="haru-test-q"),
        [Endpoint("slow", "test.slow", slow), Endpoint("fast", "test.fast", fast)],
    )
    waiting = asyncio.ensure_future(bus.request("test.slow", b"one", timeout=10))
    await wait_until(lambda: started == [b"one"], 10.0, interval_s=0.02)
    # the slow answer is still running: another request on the service is answered meanwhile
    assert (await bus.request("test.fast", b"two", timeout=5)).data == b"TWO"
    release.set()
    assert (await waiting).data == b"slow one"
    await served.stop()
    with pytest.raises((NoResponders, RequestTimeout)):
        await bus.request("test.fast", b"three", timeout=0.5)


async def test_stopping_a_service_cancels_the_answers_in_flight(log):
    bus = log.bus
    cancelled = asyncio.Event()

    async def forever(data: bytes) -> bytes:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return b""

    served = await bus.serve(Service(name="haru-test", version="1.0.0"), [Endpoint("forever", "test.forever", forever)])
    waiting = asyncio.ensure_future(bus.request("test.forever", b"", timeout=0.5))
    await asyncio.sleep(0.1)
    await served.stop()
    assert cancelled.is_set()
    with pytest.raises(RequestTimeout):
        await waiting


def test_subject_matching_is_nats_matching():
    assert subject_matches("haru.evt.>", "haru.evt.f.decl")
    assert not subject_matches("haru.evt.>", "haru.evt")
    assert subject_matches("haru.evt.*.route", "haru.evt.f.route")
    assert not subject_matches("haru.evt.*.route", "haru.evt.f.g.route")
    assert not subject_matches("haru.hb.*", "haru.hb.f.a")
    assert subject_matches("a.b", "a.b") and not subject_matches("a.b", "a.b.c")
