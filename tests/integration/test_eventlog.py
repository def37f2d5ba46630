"""The event log against a real nats-server: races, expectations, lost acks, forgeries, crashes, refusals."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import nats
import nats.js.errors
import pytest

from haru.core import events as ev
from haru.core import subjects
from haru.core.errors import Conflict
from haru.core.specs import Policy
from haru.host.natsd import NatsServer
from haru.log.eventlog import MSG_ID, EventLog, msg_id
from tests.support import haru

T0 = datetime(2026, 11, 29, 3, 0, tzinfo=UTC)
SUBJECT = subjects.model("default", "a", "stories")


def loading(i: int = 0) -> ev.ModelLoading:
    return ev.ModelLoading(
        at=T0 + timedelta(seconds=i), domain="a", model="stories", endpoint="127.0.0.1:18080", pid=10121
    )


async def test_two_writers_race_exactly_one_wins(nats_server, event_log):
    first = await event_log.append(SUBJECT, loading(), expect=0)
    async with (
        EventLog.connect([nats_server.url], writer="w1") as w1,
        EventLog.connect([nats_server.url], writer="w2") as w2,
    ):
        results = await asyncio.gather(
            w1.append(SUBJECT, ev.ModelResident(at=T0, domain="a", model="stories", warmup_ms=256), expect=first),
            w2.append(SUBJECT, ev.ModelLost(at=T0, domain="a", model="stories", reason="evicted"), expect=first),
            return_exceptions=True,
        )
    wins = [r for r in results if isinstance(r, int)]
    losses = [r for r in results if isinstance(r, Conflict)]
    assert len(wins) == 1 and len(losses) == 1, results
    assert losses[0].current == wins[0]
    assert losses[0].expected == first
    assert len(await event_log.history(SUBJECT)) == 2


async def test_expect_zero_means_the_subject_must_be_empty(event_log):
    seq = await event_log.append(SUBJECT, loading(), expect=0)
    assert seq == 1
    with pytest.raises(Conflict) as err:
        await event_log.append(SUBJECT, loading(1), expect=0)
    assert err.value.current == seq
    other = subjects.model("default", "b", "stories")
    assert await event_log.append(other, loading(), expect=0) == 2


async def test_retrying_an_append_whose_ack_was_lost_is_one_event(nats_server, event_log):
    first = await event_log.append(SUBJECT, loading(), expect=0)
    event = ev.ModelResident(at=T0, domain="a", model="stories", warmup_ms=256, by="agent:a")
    # The first attempt reached the stream; its ack never reached the writer (a fresh process retries).
    stored = await event_log.append(SUBJECT, event, expect=first)
    async with EventLog.connect([nats_server.url], writer="agent:a") as retrying:
        again = await retrying.append(SUBJECT, event, expect=first)
    assert again == stored
    assert [r.seq for r in await event_log.history(SUBJECT)] == [first, stored]
    # The same publish replayed at the JetStream level is refused by the sequence check, not stored twice.
    rec = await event_log.last(SUBJECT)
    with pytest.raises(nats.js.errors.APIError):
        await event_log.js.publish(
            SUBJECT, rec.data, headers={"Nats-Expected-Last-Subject-Sequence": str(first), MSG_ID: rec.headers[MSG_ID]}
        )
    assert len(await event_log.history(SUBJECT)) == 2


async def test_append_builds_a_hash_chain_and_msg_ids(event_log):
    s1 = await event_log.append(SUBJECT, loading(), expect=0)
    s2 = await event_log.append(SUBJECT, ev.ModelResident(at=T0, domain="a", model="stories"), expect=s1)
    r1, r2 = await event_log.history(SUBJECT)
    assert r1.event.prev == "" and r1.event.by == "test"
    import hashlib

    assert r2.event.prev == hashlib.sha256(r1.data).hexdigest()
    assert r2.headers[MSG_ID] == msg_id(SUBJECT, s1, r2.data)
    assert r2.seq == s2


async def test_a_forged_event_makes_verify_fail_and_name_its_sequence(nats_server, event_log):
    s1 = await event_log.append(SUBJECT, loading(), expect=0)
    await event_log.append(
        subjects.decl("default"), ev.FleetDeclared(at=T0, fleet="default", policy=Policy()), expect=0
    )
    ok = haru("verify", nats_url=nats_server.url)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip().endswith("verify ok — 2 events on 2 subjects, history intact")
    # Someone with publish rights bypasses append: a plausible body, but not on the chain.
    forged = ev.encode(ev.ModelResident(at=T0, domain="a", model="stories", warmup_ms=1, by="mallory"))
    ack = await event_log.js.publish(SUBJECT, forged)
    bad = haru("verify", nats_url=nats_server.url)
    assert bad.returncode == 5, bad
    assert f"seq {ack.seq} on {SUBJECT}" in bad.stdout
    assert "chain is broken" in bad.stdout
    assert "verify FAILED" in bad.stdout
    assert s1 < ack.seq


async def test_an_invalid_body_is_flagged_by_verify(nats_server, event_log):
    await event_log.append(SUBJECT, loading(), expect=0)
    ack = await event_log.js.publish(subjects.model("default", "a", "other"), b'{"type":"model_lost","oops":1}')
    out = haru("verify", nats_url=nats_server.url)
    assert out.returncode == 5
    assert f"seq {ack.seq}" in out.stdout and "not a valid event" in out.stdout


async def test_sigkilled_server_restarted_on_its_store_keeps_every_acknowledged_event(tmp_path):
    server = NatsServer(tmp_path / "store")
    server.start_sync()
    try:
        async with EventLog.connect([server.url], writer="w") as log:
            await log.ensure()
            seq, acked = 0, []
            for i in range(200):
                seq = await log.append(SUBJECT, loading(i), expect=seq)
                acked.append(seq)
        server.kill()
        server.start_sync()  # same port, same store
        async with EventLog.connect([server.url], writer="w") as log:
            await log.ensure()
            got = [r.seq for r in await log.history(SUBJECT)]
            assert got == acked
            # and the chain continues where it stopped
            await log.append(SUBJECT, loading(999), expect=await log.last_seq_of(SUBJECT))
        out = haru("verify", nats_url=server.url)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "201 events on 1 subjects" in out.stdout
    finally:
        server.stop_sync()


async def test_deleting_or_purging_history_is_refused(event_log):
    seq = await event_log.append(SUBJECT, loading(), expect=0)
    with pytest.raises(nats.js.errors.APIError) as err:
        await event_log.js.delete_msg(subjects.EVENTS_STREAM, seq)
    assert "delete" in str(err.value).lower()
    with pytest.raises(nats.js.errors.APIError) as err:
        await event_log.js.purge_stream(subjects.EVENTS_STREAM)
    assert "purge" in str(err.value).lower()
    assert len(await event_log.history()) == 1
    # ensure() does not quietly relax the settings either
    await event_log.ensure()
    info = await event_log.js.stream_info(subjects.EVENTS_STREAM)
    assert info.config.deny_delete and info.config.deny_purge
    assert info.config.duplicate_window == 120
    assert (info.config.max_age or 0) == 0


async def test_replay_resumes_from_a_sequence_and_follows(event_log):
    seq = 0
    for i in range(50):
        seq = await event_log.append(SUBJECT, loading(i), expect=seq)
    seen: list[int] = []
    last = await event_log.replay(lambda r: seen.append(r.seq), from_seq=21)
    assert seen == list(range(21, 51)) and last == 50
    assert await event_log.replay(lambda r: None, from_seq=51) == 50  # nothing to do, returns at once

    got: list[int] = []
    done = asyncio.Event()

    def follow(r):
        got.append(r.seq)
        if r.seq == 53:
            done.set()

    task = asyncio.create_task(event_log.replay(follow, from_seq=49, follow=True))
    for i in range(3):
        seq = await event_log.append(SUBJECT, loading(100 + i), expect=seq)
    await asyncio.wait_for(done.wait(), 10)
    task.cancel()
    assert got == [49, 50, 51, 52, 53]


async def test_a_handler_failure_stops_the_replay(event_log):
    await event_log.append(SUBJECT, loading(), expect=0)

    def boom(rec):
        raise RuntimeError("handler failed")

    with pytest.raises(RuntimeError, match="handler failed"):
        await event_log.replay(boom)


async def test_views_and_intents_are_compare_and_swap(event_log):
    rev = await event_log.put_view("fleet.default", b'{"seq":1}', last=0)
    with pytest.raises(Conflict):
        await event_log.put_view("fleet.default", b'{"seq":0}', last=0)
    rev2 = await event_log.put_view("fleet.default", b'{"seq":2}', last=rev)
    with pytest.raises(Conflict) as err:
        await event_log.put_view("fleet.default", b'{"seq":3}', last=rev)
    assert err.value.current == rev2
    assert await event_log.get_view("fleet.default") == (b'{"seq":2}', rev2)

    i1 = await event_log.publish_intent("default", b"one", expect=0)
    with pytest.raises(Conflict):
        await event_log.publish_intent("default", b"two", expect=0)
    i2 = await event_log.publish_intent("default", b"two", expect=i1)
    assert await event_log.last_intent("default") == (b"two", i2)


# ------------------------------------------------------------------- the appends' ack inbox


async def test_ack_inbox_answers_times_out_and_reports_no_responders(event_log):
    """What `nc.request` would do, through the inbox appends use: a reply, a timeout (with one
    50 ms slot of slack), no responders; nothing is left waiting afterwards."""
    acks = event_log._acks

    async def echo(msg) -> None:
        await msg.respond(b"pong:" + msg.data)

    async def ignore(msg) -> None:
        pass

    await event_log.nc.subscribe("test.echo", cb=echo)
    await event_log.nc.subscribe("test.silent", cb=ignore)
    assert await acks.request("test.echo", b"1", {"X": "y"}, 2.0) == b"pong:1"
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(nats.errors.TimeoutError):
        await acks.request("test.silent", b"", {}, 0.3)
    assert 0.3 <= loop.time() - started < 1.5
    with pytest.raises(nats.errors.NoRespondersError):
        await acks.request("test.nobody", b"", {}, 2.0)
    replies = await asyncio.gather(*(acks.request("test.echo", b"%d" % i, {}, 5.0) for i in range(300)))
    assert replies == [b"pong:%d" % i for i in range(300)]
    assert not acks._waiting
    assert not any(acks._expiring.values())


async def test_ack_inbox_forgets_a_caller_that_went_away(event_log):
    async def ignore(msg) -> None:
        pass

    await event_log.nc.subscribe("test.silent2", cb=ignore)
    waiting = asyncio.create_task(event_log._acks.request("test.silent2", b"", {}, 30.0))
    await asyncio.sleep(0.1)
    assert len(event_log._acks._waiting) == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not event_log._acks._waiting


async def test_an_append_with_no_stream_to_answer_is_unavailable_not_lost(nats_server, tmp_path):
    """No stream holds the subject (JetStream answers nobody): the append retries until its deadline,
    then says the log is unavailable; it never reports a sequence it did not get."""
    from haru.core.errors import LogUnavailable

    async with EventLog.connect([nats_server.url], writer="w", timeout=0.2) as log:  # no ensure(): no streams
        started = asyncio.get_running_loop().time()
        with pytest.raises(LogUnavailable, match="no stream leader answered"):
            await log.append(SUBJECT, loading(), expect=0)
        assert asyncio.get_running_loop().time() - started >= 10.0


async def test_many_appends_in_flight_on_distinct_subjects_each_get_their_own_sequence(event_log):
    subjects_ = [subjects.model("default", "a", f"m{i}") for i in range(400)]
    seqs = await asyncio.gather(*(event_log.append(s, loading(), expect=0) for s in subjects_))
    assert len(set(seqs)) == 400
    for s, seq in zip(subjects_[:20], seqs[:20], strict=True):
        assert (await event_log.last(s)).seq == seq
