"""The events part of the JetStream log: optimistic, sequence-checked appends to HARU_EVENTS and every
read of it (single messages, subjects' heads, history, counts, replays and followers).

Every append is optimistic and sequence-checked (`Nats-Expected-Last-Subject-Sequence`), carries a
deterministic `Nats-Msg-Id` (sha256 of subject, expected sequence and body, so a retry after a lost
ack is not a second event), and extends the subject's hash chain (`prev` = sha256 of the previous
body on the subject). A lost race raises `Conflict` with the subject's current sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import msgspec
import nats.errors
import nats.js.errors

from haru.core import subjects
from haru.core.errors import BatchUnsupported, Conflict, LogDamaged, LogError, LogUnavailable
from haru.core.events import Event, encode
from haru.core.receipts import Receipt
from haru.log.jetstream import (
    CONFLICT_CODES,
    IN_PROCESS,
    JetStreamClient,
    holds_nothing,
    not_an_answer,
    stream_state,
    translated,
)
from haru.log.js_replay import Replay
from haru.log.receipts import ReceiptGuard
from haru.log.record import (
    BATCH_COMMIT,
    BATCH_ID,
    BATCH_SEQ,
    EXPECTED_LAST_SUBJECT_SEQ,
    MSG_ID,
    Record,
    body_hash,
    datetime_to_ns,
    decode_record,
    msg_id,
    stage_batch,
)
from haru.log.seam import Handler

if TYPE_CHECKING:
    from haru.log.follow import Follower

__all__ = ["JetStreamEvents"]

# nats-server's codes for an atomic batch it refuses: atomic publish off for the stream, a batch it no longer
# holds all of (a leader changed between its messages), a message id it already stored (a retried batch)
BATCH_DISABLED, BATCH_INCOMPLETE, BATCH_DUPLICATE = 10174, 10176, 10201
_SUBJECTS_PAGE = 100_000  # nats-server's limit on the subjects one stream-info answer lists


class JetStreamEvents(JetStreamClient):
    """The event stream HARU_EVENTS: appends and reads (`haru.log.seam.EventStore`)."""

    receipt_guard: ReceiptGuard | None = None  # set by EventLog: checks receipts on reconnect and conflict
    _takes_batches: bool | None = None  # whether HARU_EVENTS takes atomic batches (`_atomic`)

    # --------------------------------------------------------------------------------- append

    async def append(self, subject: str, event: Event, *, expect: int) -> int:
        """Append `event` to `subject` if the subject's last sequence is `expect` (0 = empty).

        Fills `prev` (the hash chain) and `by` (when empty). Returns the new stream sequence.
        Raises Conflict(current) when another writer got there first. Retrying an append whose
        ack was lost returns the stored message's sequence instead of writing a second event.
        """
        prev, stored_last = await self._prev_at(subject, expect)
        if event.prev != prev or not event.by:
            event = msgspec.structs.replace(event, prev=prev, by=event.by or self.writer)
        data = encode(event)
        mid = msg_id(subject, expect, data)
        if stored_last is not None and stored_last[0] != expect:
            # The subject moved past `expect`: ours (a retry after a lost ack) or someone else's?
            if (stored_last[2] or {}).get(MSG_ID) == mid:
                self._tips[subject] = (stored_last[0], body_hash(stored_last[1]))
                self._receipts[subject] = Receipt(stored_last[0], body_hash(stored_last[1]))
                if self.receipt_guard is not None:
                    self.receipt_guard.changed()
                return stored_last[0]
            self._conflicted_below_receipt(subject, stored_last[0])
            raise Conflict(subject, expect, stored_last[0])
        try:
            seq = await self._publish_checked(subjects.EVENTS_STREAM, subject, data, expect, mid)
        except Conflict as exc:
            self._conflicted_below_receipt(subject, exc.current if exc.current is not None else expect)
            raise
        self._tips[subject] = (seq, body_hash(data))
        self._receipts[subject] = Receipt(seq, body_hash(data))
        if self.receipt_guard is not None:
            self.receipt_guard.changed()
        return seq

    async def _prev_at(
        self, subject: str, expect: int
    ) -> tuple[str, tuple[int, bytes, dict[str, str] | None, datetime] | None]:
        """The `prev` of an append to `subject` after `expect`: the hash of the body stored there, from this
        writer's tip or read; with the subject's last message when it had to be read. Raises Conflict when
        `expect` is not a message on `subject`."""
        tip = self._tips.get(subject)
        if expect == 0:
            return "", None
        if tip is not None and tip[0] == expect:
            return tip[1], None
        # The body at `expect` from the nearest replica: after a region loss the leader may be the one gone,
        # and a read from it waits out its timeout while the two regions left elect a new one. A replica
        # without it yet, or none answering, leaves the read to the leader. (The server checks `expect`.)
        with contextlib.suppress(LogError):
            at_expect = await self._get_seq(subjects.EVENTS_STREAM, expect, direct=True)
            if at_expect is not None and at_expect[0] == subject:
                return body_hash(at_expect[1]), None
        stored_last = await self._last_raw(subjects.EVENTS_STREAM, subject)
        if stored_last is None:
            self._conflicted_below_receipt(subject, 0)
            raise Conflict(subject, expect, 0)
        if stored_last[0] == expect:
            return body_hash(stored_last[1]), stored_last
        at_expect = await self._get_seq(subjects.EVENTS_STREAM, expect)
        if at_expect is None or at_expect[0] != subject:
            self._conflicted_below_receipt(subject, stored_last[0])
            raise Conflict(subject, expect, stored_last[0])
        return body_hash(at_expect[1]), stored_last

    async def append_batch(self, appends: Sequence[tuple[str, Event]], *, expect: Mapping[str, int]) -> list[int]:
        """Append each (subject, event) in order as one atomic batch (`haru.log.seam.EventWriter`).

        Each message carries its deterministic `Nats-Msg-Id`; the first one on each subject carries the
        subject's expected last sequence, which the server checks for every subject before it stores any
        (the later ones on a subject chain to the earlier: nothing can come between them). Returns the
        sequences: the ack names the last, the batch is stored contiguously before it.
        """
        if not appends:
            return []
        missing = sorted({s for s, _ in appends} - set(expect))
        if missing:
            raise ValueError(f"append_batch: no expected sequence for {', '.join(missing)}")
        if not await self._atomic():
            raise BatchUnsupported(
                f"{subjects.EVENTS_STREAM} does not take atomic batches (allow_atomic off, or nats-server "
                f"older than 2.12): Haru's services turn allow_atomic on as they start (EventLog.ensure); on an "
                f"older server, upgrade nats-server to 2.12 or later"
            )
        prevs = {s: (expect[s], (await self._prev_at(s, expect[s]))[0]) for s in dict.fromkeys(s for s, _ in appends)}
        messages = [(subject, data, headers) for subject, data, headers, _ in stage_batch(appends, prevs, self.writer)]
        try:
            last = await self._publish_batch(messages)
        except Conflict as exc:
            self._conflicted_below_receipt(exc.subject, exc.current if exc.current is not None else exc.expected)
            raise
        seqs = list(range(last - len(messages) + 1, last + 1))
        for seq, (subject, data, _) in zip(seqs, messages, strict=True):
            self._tips[subject] = (seq, body_hash(data))
            self._receipts[subject] = Receipt(seq, body_hash(data))
        if self.receipt_guard is not None:
            self.receipt_guard.changed()
        return seqs

    async def _atomic(self) -> bool:
        """Whether HARU_EVENTS takes atomic batches (asked once per connection)."""
        if self._takes_batches is None:
            with translated(f"reading {subjects.EVENTS_STREAM}'s configuration"):
                info = await self.js.stream_info(subjects.EVENTS_STREAM)
            self._takes_batches = bool(info.config.allow_atomic)
        return self._takes_batches

    async def _publish_batch(self, messages: list[tuple[str, bytes, dict[str, str]]]) -> int:
        """Publish `messages` as one atomic batch and return the last one's sequence. Every message but the
        last goes without a reply subject (no round trip each); the last commits and is acked. A batch the
        server lost (a leader change between its messages) or whose ack was lost is sent again under a new
        id: its messages' ids make a stored batch's retry a duplicate, which is read back as success."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(self.timeout * 2, 10.0)
        attempts = 0
        what = f"appending a batch of {len(messages)} to {messages[0][0]}"
        while True:
            attempts += 1
            batch = uuid.uuid4().hex
            try:
                with translated(what):
                    for i, (subject, data, headers) in enumerate(messages[:-1], 1):
                        await self.nc.publish(subject, data, headers={**headers, BATCH_ID: batch, BATCH_SEQ: str(i)})
                subject, data, headers = messages[-1]
                commit = {**headers, BATCH_ID: batch, BATCH_SEQ: str(len(messages)), BATCH_COMMIT: "1"}
                return await self._publish(subject, data, commit)
            except nats.js.errors.APIError as exc:
                if exc.err_code in CONFLICT_CODES or exc.err_code == BATCH_DUPLICATE:
                    stored = await self._stored_batch(messages)
                    if stored:
                        return stored
                    raise await self._batch_conflict(messages) from exc
                if exc.err_code == BATCH_DISABLED:
                    self._takes_batches = False
                    raise BatchUnsupported(f"{what}: JetStream refused: {exc.description}") from exc
                retry = exc.err_code in (BATCH_INCOMPLETE, IN_PROCESS) or isinstance(
                    exc, nats.js.errors.ServiceUnavailableError
                )
                if not retry:
                    raise LogError(f"{what}: JetStream refused: {exc.description} (code {exc.err_code})") from exc
            except (
                TimeoutError,
                nats.errors.TimeoutError,
                nats.js.errors.NoStreamResponseError,  # the 503 while a stream leader is elected
                nats.errors.ConnectionClosedError,
                nats.errors.ConnectionReconnectingError,
                LogUnavailable,
            ):
                if self.nc.is_closed:
                    raise LogUnavailable(f"{what}: the NATS connection is closed") from None
                stored = await self._stored_batch(messages)
                if stored:
                    return stored
            if loop.time() >= deadline:
                raise LogUnavailable(f"{what}: no stream leader stored it in time")
            await asyncio.sleep(min(0.25 * attempts, 1.0))

    async def _stored_batch(self, messages: list[tuple[str, bytes, dict[str, str]]]) -> int:
        """The last sequence of this batch if the log holds it (its last message, by its id), else 0."""
        subject, _, headers = messages[-1]
        try:
            last = await self._last_raw(subjects.EVENTS_STREAM, subject)
        except LogError:
            return 0
        return last[0] if last is not None and (last[2] or {}).get(MSG_ID) == headers[MSG_ID] else 0

    async def _batch_conflict(self, messages: list[tuple[str, bytes, dict[str, str]]]) -> Conflict:
        """The Conflict of a refused batch: the first subject no longer at its expected sequence."""
        for subject, _, headers in messages:
            if EXPECTED_LAST_SUBJECT_SEQ not in headers:
                continue
            want = int(headers[EXPECTED_LAST_SUBJECT_SEQ])
            last = await self._last_raw(subjects.EVENTS_STREAM, subject)
            current = 0 if last is None else last[0]
            if current != want:
                return Conflict(subject, want, current)
        subject, _, headers = messages[0]
        return Conflict(subject, int(headers.get(EXPECTED_LAST_SUBJECT_SEQ, 0)), None)

    def _conflicted_below_receipt(self, subject: str, current: int) -> None:
        """A conflict says the subject is at `current`: below this writer's receipt, the log forgot."""
        receipt = self._receipts.get(subject)
        if receipt is not None and current < receipt.seq and self.receipt_guard is not None:
            self.receipt_guard.schedule()

    def receipts(self) -> dict[str, Receipt]:
        """Per subject, the last event this writer was acknowledged (`haru.log.receipts.check`)."""
        return dict(self._receipts)

    def adopt_receipts(self, kept: dict[str, Receipt]) -> None:
        """Take a previous run's receipts (`ReceiptGuard.persist`) for the subjects this run has none of."""
        for subject, receipt in kept.items():
            self._receipts.setdefault(subject, receipt)

    def forget_receipt(self, subject: str, seq: int) -> None:
        """Drop the receipt of `subject` if it is still the one at `seq` (its loss was recorded)."""
        receipt = self._receipts.get(subject)
        if receipt is not None and receipt.seq == seq:
            del self._receipts[subject]
            self._tips.pop(subject, None)

    # ----------------------------------------------------------------------------------- reads

    async def last_seq(self) -> int:
        """The event stream's last sequence (0 when empty)."""
        with translated("reading the event stream's state"):
            info = await stream_state(self.js, subjects.EVENTS_STREAM)
        return info.state.last_seq

    async def last_seq_matching(self, subject_filter: str) -> int:
        """The last sequence of any event subject matching the filter (wildcards allowed; 0 when none)."""
        if subject_filter == subjects.ALL_EVENTS:
            return await self.last_seq()
        last = await self._last_raw(subjects.EVENTS_STREAM, subject_filter)
        return 0 if last is None else last[0]

    def follower(self, handler: Handler, *, from_seq: int = 1, **kwargs: Any) -> Follower:
        """A `haru.log.follow.Follower` of this log: catch-up, stall detection, reconnect and resume
        (`kwargs`: its `subject_filter`, `headers`, `name`, `stall_interval`, `stall_checks`, `busy`...)."""
        from haru.log.follow import Follower

        return Follower(self, handler, from_seq=from_seq, **kwargs)

    async def follow(self, handler: Handler, *, from_seq: int = 1, **kwargs: Any) -> None:
        """Follow the log from `from_seq` until cancelled (`follower(...).run()`)."""
        await self.follower(handler, from_seq=from_seq, **kwargs).run()

    async def subject_counts(self, subject_filter: str = subjects.ALL_EVENTS) -> dict[str, int]:
        """The event subjects matching the filter that hold messages, with how many each.

        One stream-info request (~0.5 ms) instead of reading the messages (a filtered replay of a
        100k-event stream takes 2-11 ms). The server lists at most _SUBJECTS_PAGE subjects per
        answer and nats-py cannot ask for the next page: a list that long is counted from a replay.
        """
        with translated(f"listing the subjects {subject_filter}"):
            info = await stream_state(self.js, subjects.EVENTS_STREAM, subjects_filter=subject_filter)
        found = dict(info.state.subjects or {})
        if len(found) < _SUBJECTS_PAGE:
            return found
        counts: dict[str, int] = {}

        def count(rec: Record) -> None:
            counts[rec.subject] = counts.get(rec.subject, 0) + 1

        await self.replay(count, subject_filter=subject_filter, headers=False)
        return counts

    async def last(self, subject: str, *, direct: bool = False) -> Record | None:
        """The last event on `subject`, or None when the subject is empty (`direct`: haru.log.seam)."""
        last = await self._last_raw(subjects.EVENTS_STREAM, subject, direct=direct)
        if last is None:
            return None
        seq, data, headers, time = last
        if not direct:  # a replica's answer is no tip to append after
            self._tips[subject] = (seq, body_hash(data))
        return decode_record(seq, subject, datetime_to_ns(time), data, headers)

    async def last_seq_of(self, subject: str) -> int:
        """The last sequence on `subject` (0 when empty): what to pass as `expect`."""
        rec = await self.last(subject)
        return 0 if rec is None else rec.seq

    async def history(
        self,
        subject_filter: str = subjects.ALL_EVENTS,
        *,
        from_seq: int = 1,
        timeout: float | None = None,
        strict: bool = False,
    ) -> list[Record]:
        """Every stored event matching the filter, from `from_seq`, in order (`timeout`, `strict`:
        `replay`'s). On `LogDamaged` the records read are in the exception's `records`."""
        out: list[Record] = []
        try:
            await self.replay(
                out.append, from_seq=from_seq, subject_filter=subject_filter, timeout=timeout, strict=strict
            )
        except LogDamaged as exc:
            exc.records = out  # what could be read, for a caller that shows it with the damage
            raise
        return out

    async def tail(
        self, subject_filter: str, limit: int, *, timeout: float | None = None, strict: bool = False
    ) -> list[Record]:
        """The last `limit` stored events matching the filter, oldest first, without reading the
        stream from its start: windows back from the end, four times wider each time, until one holds
        `limit` matches or reaches sequence 1 (`timeout`, `strict`: `history`'s)."""
        last = await self.last_seq()
        window = max(4 * limit, 256)
        while True:
            start = max(1, last - window + 1)
            records = await self.history(subject_filter, from_seq=start, timeout=timeout, strict=strict)
            if len(records) >= limit or start == 1:
                return records[-limit:] if limit else records
            window *= 4

    async def read_seq(self, seq: int) -> Record | None:
        """The event stored at stream sequence `seq` (None when the store cannot serve it)."""
        with translated(f"reading sequence {seq}"):
            try:
                raw = await self.js.get_msg(subjects.EVENTS_STREAM, seq=seq)
            except nats.js.errors.NotFoundError as exc:
                if not holds_nothing(exc):
                    raise not_an_answer(f"reading sequence {seq}", exc) from exc
                return None
        time = raw.time if isinstance(raw.time, datetime) else datetime.now(UTC)
        return decode_record(raw.seq or 0, raw.subject or "", datetime_to_ns(time), raw.data or b"", raw.headers)

    async def replay(
        self,
        handler: Handler,
        *,
        from_seq: int = 1,
        subject_filter: str = subjects.ALL_EVENTS,
        follow: bool = False,
        headers: bool = True,
        timeout: float | None = None,
        strict: bool = False,
        on_gap: Callable[[list[int]], Any] | None = None,
    ) -> int:
        """Call `handler(record)` for each stored message matching the filter, in order.

        Without `follow` it returns once it has handled what was stored when it started; with
        `follow` it goes on with new messages until cancelled. Returns the last sequence handled
        (from_seq - 1 when nothing matched). An exception from the handler stops the replay and
        is raised here.

        A replay never hangs on a damaged store and never passes over a hole in silence
        (haru/log/js_replay.py; what a hole is: haru/log/holes.py). Without `follow` it ends within
        `timeout` seconds (default: the log's `replay_timeout`) or raises `ReplayTimeout`, and holes
        raise `LogDamaged` (with the sequence numbers) after the handler has seen every readable
        event; filtered, `strict` also scans for holes the stream's state admits to. With `follow`,
        each hole found is passed to `on_gap(seqs)` (default: an error in the log).
        """
        return await Replay(
            self.js,
            handler,
            from_seq=from_seq,
            subject_filter=subject_filter,
            follow=follow,
            headers=headers,
            budget=self.replay_timeout if timeout is None else timeout,
            strict=strict,
            on_gap=on_gap,
            rescan=self.replay,
        ).run()
